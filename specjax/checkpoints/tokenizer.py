"""Tokenizer: a Hugging Face ``tokenizers.Tokenizer`` plus the model's chat template.

Two ways in:
  * ``Tokenizer.from_file``: a ``tokenizer.json`` (and optionally the parsed ``tokenizer_config.json``) from a
    Hugging Face model directory.
  * ``Tokenizer.from_gguf_fields``: the ``tokenizer.*`` metadata of a GGUF file, built from the ``tokenizers``
    library's own model, normalizer, pre-tokenizer and decoder classes:
      - ``tokenizer.ggml.model == "gpt2"``: the vocabulary, merges and token types as a byte-level BPE, the
        pre-tokenizer chosen by ``tokenizer.ggml.pre``;
      - ``tokenizer.ggml.model == "llama"`` (SentencePiece BPE, e.g. Gemma 3): the vocabulary as a BPE with
        byte fallback whose merges are recovered from the order of the vocabulary, spaces written as ▁.

Token ids are plain Python ints.  ``encode`` parses special-token strings in the text (``"<|im_end|>"``
becomes its id) and prepends BOS only when the model asks for it (``add_bos``).
"""
from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from specjax.errors import CheckpointError, ConfigError

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# End-of-turn markers used by common chat templates.  When a template uses one of these and the vocabulary
# has it, generation should stop on it as well as on the declared EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>",
                      "<|endoftext|>", "</s>")

# Pre-tokenizer split patterns (the regexes the reference tokenizers use, as llama.cpp reproduces them).
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# ----------------------------------------------------------------------------------------------------------
# Byte-level BPE from GGUF metadata


def _gpt2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
  return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
  # StarCoder-style: every digit on its own, then GPT-2 byte-level splitting.
  return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def _regex_pre_tokenizer(pattern: str) -> pre_tokenizers.PreTokenizer:
  return pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
  ])


# tokenizer.ggml.pre value -> (pre-tokenizer factory, BPE ignore_merges)
_GGUF_PRE_TOKENIZERS = {
    "gpt2": (_gpt2_pre_tokenizer, False),
    "default": (_gpt2_pre_tokenizer, False),
    "smollm": (_smollm_pre_tokenizer, False),
    "starcoder": (_smollm_pre_tokenizer, False),
    "llama-bpe": (lambda: _regex_pre_tokenizer(_LLAMA3_PATTERN), True),
    "llama3": (lambda: _regex_pre_tokenizer(_LLAMA3_PATTERN), True),
    "qwen2": (lambda: _regex_pre_tokenizer(_QWEN2_PATTERN), False),
}


def _split_merge(merge: str) -> tuple[str, str]:
  left, sep, right = merge.partition(" ")
  if not sep or not left or not right:
    raise CheckpointError(f"GGUF tokenizer merge {merge!r} is not of the form 'A B'; the file's "
                          "tokenizer.ggml.merges is malformed")
  return left, right


def build_gguf_bpe(tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int] | None,
                   pre: str) -> tokenizers.Tokenizer:
  """A byte-level BPE ``tokenizers.Tokenizer`` from GGUF vocabulary, merges and token types.

  Control tokens (type 3) and user-defined tokens (type 4) are registered as added tokens, so their strings
  in a text map straight to their ids; control tokens are special (dropped by ``skip_special_tokens``).
  """
  if pre not in _GGUF_PRE_TOKENIZERS:
    raise CheckpointError(f"GGUF pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported; supported: "
                          f"{', '.join(sorted(_GGUF_PRE_TOKENIZERS))}")
  make_pre, ignore_merges = _GGUF_PRE_TOKENIZERS[pre]
  vocab = {}
  for i, tok in enumerate(tokens):
    vocab.setdefault(tok, i)   # keep the first id if a string repeats
  try:
    bpe = models.BPE(vocab=vocab, merges=[_split_merge(m) for m in merges], dropout=None,
                     unk_token=None, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges)
  except Exception as e:  # tokenizers raises a bare Exception, e.g. for a merge of unknown tokens
    raise CheckpointError(f"GGUF tokenizer vocabulary/merges are inconsistent ({e})") from e
  tok = tokenizers.Tokenizer(bpe)
  tok.pre_tokenizer = make_pre()
  tok.decoder = decoders.ByteLevel()
  if token_types is not None:
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, token_types) if ty == TOKEN_TYPE_CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, token_types) if ty == TOKEN_TYPE_USER_DEFINED]
    if special:
      tok.add_special_tokens(special)
    if user:
      tok.add_tokens(user)
  return tok


# ----------------------------------------------------------------------------------------------------------
# SentencePiece BPE from GGUF metadata (tokenizer.ggml.model "llama")
#
# SentencePiece BPE encodes by repeatedly merging the adjacent pair of pieces whose concatenation is the best
# piece of the vocabulary; the vocabulary lists its pieces best-first (a normal piece's score is minus its
# rank).  The same algorithm is a ``tokenizers`` BPE whose merges are every cut of a piece into two pieces,
# ranked by the position of the piece they make.  The file's scores are not used as the rank: user-defined
# and control pieces carry a placeholder (-1000), so only the position orders them with the rest.

SPM_SPACE = "\u2581"   # ▁: how SentencePiece writes a space inside a piece


def _spm_piece(token: str) -> str:
  """A GGUF SentencePiece token as the model looks it up.  Gemma's files store the tokens that are runs of
  spaces with real spaces, while the text's spaces become ▁ before any lookup: those are spelled as ▁s."""
  return SPM_SPACE * len(token) if token and set(token) == {" "} else token


def spm_merges(pieces: Sequence[str], mergeable: Sequence[bool]) -> list[tuple[str, str]]:
  """BPE merges reproducing SentencePiece BPE over ``pieces`` (listed best-first): for each mergeable piece
  in order, every cut into two mergeable pieces (the longer left part first)."""
  index = {}
  for i, (piece, ok) in enumerate(zip(pieces, mergeable)):
    if ok:
      index.setdefault(piece, i)
  merges = []
  for i, (piece, ok) in enumerate(zip(pieces, mergeable)):
    if not ok or index[piece] != i:
      continue
    for cut in range(len(piece) - 1, 0, -1):
      left, right = piece[:cut], piece[cut:]
      if left in index and right in index:
        merges.append((left, right))
  return merges


def _check_best_first(scores: Sequence[float], token_types: Sequence[int]) -> None:
  """The normal pieces' scores must not rise along the vocabulary (the order ``spm_merges`` ranks by)."""
  last, last_i = float("inf"), None
  for i, (score, ty) in enumerate(zip(scores, token_types)):
    if ty != TOKEN_TYPE_NORMAL:
      continue
    if score > last:
      raise CheckpointError(f"GGUF SentencePiece vocabulary is not listed best-first (token {i} scores "
                            f"{score} > {last} of token {last_i}): specjax builds SentencePiece tokenizers "
                            "from BPE vocabularies only; load the model's Hugging Face directory instead")
    last, last_i = score, i


def build_gguf_spm(tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int],
                   unk_id: int | None) -> tokenizers.Tokenizer:
  """A SentencePiece-BPE ``tokenizers.Tokenizer`` from GGUF vocabulary, scores and token types.

  The text's spaces become ▁ (no space is prepended), pieces merge by vocabulary order, and a character
  that no piece covers falls back to its UTF-8 byte tokens <0xXX>.  Control tokens (type 3) are special
  added tokens and user-defined ones (type 4: newline and tab runs, HTML tags, ...) plain added tokens, both
  matched whole in the text as written; a user-defined run of spaces (respelled ▁▁...) is an ordinary piece.
  """
  if not (len(tokens) == len(scores) == len(token_types)):
    raise CheckpointError(f"GGUF tokenizer has {len(tokens)} tokens, {len(scores)} scores and "
                          f"{len(token_types)} token types; the file's tokenizer.ggml.* arrays are damaged")
  _check_best_first(scores, token_types)
  pieces = [_spm_piece(t) for t in tokens]
  respelled = [p != t for p, t in zip(pieces, tokens)]
  mergeable = [ty == TOKEN_TYPE_NORMAL or r for ty, r in zip(token_types, respelled)]
  vocab = {}
  for i, piece in enumerate(pieces):
    vocab.setdefault(piece, i)   # keep the first id if a string repeats
  unk = pieces[unk_id] if unk_id is not None and 0 <= unk_id < len(pieces) else None
  try:
    bpe = models.BPE(vocab=vocab, merges=spm_merges(pieces, mergeable), dropout=None, unk_token=unk,
                     fuse_unk=True, byte_fallback=True)
  except Exception as e:  # tokenizers raises a bare Exception
    raise CheckpointError(f"GGUF SentencePiece vocabulary is inconsistent ({e})") from e
  tok = tokenizers.Tokenizer(bpe)
  tok.normalizer = normalizers.Replace(" ", SPM_SPACE)
  tok.decoder = decoders.Sequence([decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
  special = [AddedToken(t, special=True, normalized=False)
             for t, ty in zip(tokens, token_types) if ty == TOKEN_TYPE_CONTROL]
  user = [AddedToken(t, special=False, normalized=False)
          for t, ty, r in zip(tokens, token_types, respelled) if ty == TOKEN_TYPE_USER_DEFINED and not r]
  if special:
    tok.add_special_tokens(special)
  if user:
    tok.add_tokens(user)
  return tok


# ----------------------------------------------------------------------------------------------------------
# Chat templates


def _raise_exception(message: str):
  raise ConfigError(f"chat template rejected the messages: {message}")


def _tojson(value: Any, indent: int | None = None) -> str:
  return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
  """Compile a chat template in a sandboxed jinja2 environment (as transformers renders them)."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                     extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  try:
    return env.from_string(source)
  except jinja2.TemplateError as e:
    raise CheckpointError(f"chat template does not compile: {e}") from e


def fallback_chat_format(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
  """The plain format used when a model has no chat template: 'User: ...\\nAssistant: ...'."""
  lines = [f"{str(m['role']).capitalize()}: {m['content']}" for m in messages]
  text = "\n".join(lines)
  if add_generation_prompt:
    text = f"{text}\nAssistant:" if text else "Assistant:"
  return text


def _token_content(value: Any) -> str | None:
  """tokenizer_config.json stores tokens as strings or as {"content": ...} dicts."""
  if isinstance(value, Mapping):
    return value.get("content")
  return value if isinstance(value, str) else None


def _pick_template(value: Any) -> str | None:
  """tokenizer_config.json ``chat_template``: a string, or a list of {"name", "template"} dicts."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, Sequence):
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
    return named.get("default") or next(iter(named.values()), None)
  return None


# ----------------------------------------------------------------------------------------------------------
# The tokenizer


class Tokenizer:
  """Text <-> token ids, special tokens, and chat formatting for one model.

  If the model has no chat template, ``apply_chat_template`` falls back to a plain
  ``"User: ...\\nAssistant:"`` format (see ``fallback_chat_format``) and ``has_chat_template`` is False.
  """

  def __init__(self, hf: tokenizers.Tokenizer, *, bos_token_id: int | None,
               eos_token_ids: Sequence[int], chat_template: str | None, add_bos: bool,
               bos_token: str | None = None, eos_token: str | None = None):
    self._hf = hf
    self.bos_token_id = bos_token_id
    self.add_bos = bool(add_bos) and bos_token_id is not None
    self.chat_template = chat_template
    self.bos_token = bos_token if bos_token is not None else self._id_to_token(bos_token_id)
    declared = [int(i) for i in eos_token_ids]
    self.eos_token = eos_token if eos_token is not None else (
        self._id_to_token(declared[0]) if declared else None)
    self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(declared + self._end_of_turn_ids()))
    self._template = compile_chat_template(chat_template) if chat_template else None

  # -- construction -----------------------------------------------------------------------------------

  @classmethod
  def from_file(cls, tokenizer_json_path: str | os.PathLike, tokenizer_config: dict | None = None, *,
                chat_template: str | None = None, bos_token_id: int | None = None,
                eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
    """Load a Hugging Face ``tokenizer.json``.

    Args:
      tokenizer_json_path: path of ``tokenizer.json``.
      tokenizer_config: parsed ``tokenizer_config.json`` (bos/eos tokens, ``add_bos_token``,
        ``chat_template``), or None.
      chat_template: overrides the config's template (e.g. a separate ``chat_template.jinja``).
      bos_token_id / eos_token_ids: ids declared by the model config; used when the tokenizer config does
        not name them, and the eos ids are merged with the tokenizer config's.
    """
    try:
      hf = tokenizers.Tokenizer.from_file(os.fspath(tokenizer_json_path))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
      raise CheckpointError(f"{tokenizer_json_path}: cannot read tokenizer ({e})") from e
    config = dict(tokenizer_config or {})
    bos_token = _token_content(config.get("bos_token"))
    eos_token = _token_content(config.get("eos_token"))
    bos_id = hf.token_to_id(bos_token) if bos_token else None
    if bos_id is None:
      bos_id = bos_token_id
    eos_ids = list(eos_token_ids)
    if eos_token and hf.token_to_id(eos_token) is not None:
      eos_ids.insert(0, hf.token_to_id(eos_token))
    if "add_bos_token" in config:
      add_bos = bool(config["add_bos_token"])
    else:
      add_bos = _post_processor_adds_bos(hf, bos_id)
    template = chat_template if chat_template is not None else _pick_template(config.get("chat_template"))
    return cls(hf, bos_token_id=bos_id, eos_token_ids=eos_ids, chat_template=template, add_bos=add_bos,
               bos_token=bos_token, eos_token=eos_token)

  @classmethod
  def from_gguf_fields(cls, fields: Mapping[str, Any]) -> "Tokenizer":
    """Build from GGUF ``tokenizer.*`` metadata (key -> decoded Python value).

    Needs ``tokenizer.ggml.tokens`` and, by ``tokenizer.ggml.model``: "gpt2" (byte-level BPE, the default)
    ``tokenizer.ggml.merges``; "llama" (SentencePiece BPE) ``scores`` and ``token_type``, and no space
    prefix.  Uses ``token_type``, ``pre``, ``bos/eos/eot/unknown_token_id``, ``add_bos_token`` and
    ``tokenizer.chat_template`` when present.
    """
    kind = fields.get("tokenizer.ggml.model", "gpt2")
    needs = {"gpt2": ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"),
             "llama": ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")}
    if kind not in needs:
      raise CheckpointError(f"GGUF tokenizer model {kind!r} is not supported (supported: byte-level BPE "
                            "'gpt2', SentencePiece BPE 'llama'); convert the model's Hugging Face directory "
                            "instead")
    for key in needs[kind]:
      if key not in fields:
        raise CheckpointError(f"GGUF metadata has no {key}; the file carries no usable {kind!r} tokenizer")
    tokens = list(fields["tokenizer.ggml.tokens"])
    if kind == "gpt2":
      hf = build_gguf_bpe(tokens, list(fields["tokenizer.ggml.merges"]),
                          fields.get("tokenizer.ggml.token_type"), fields.get("tokenizer.ggml.pre", "gpt2"))
    else:
      # llama.cpp prepends a space to SentencePiece text unless the file says not to (Gemma's do).
      if fields.get("tokenizer.ggml.add_space_prefix", True):
        raise CheckpointError("GGUF SentencePiece tokenizer asks for a space prefix "
                              "(tokenizer.ggml.add_space_prefix, Llama-2 style), which specjax does not "
                              "build; load the model's Hugging Face directory instead")
      unk = fields.get("tokenizer.ggml.unknown_token_id")
      hf = build_gguf_spm(tokens, list(fields["tokenizer.ggml.scores"]),
                          list(fields["tokenizer.ggml.token_type"]), None if unk is None else int(unk))
    bos = fields.get("tokenizer.ggml.bos_token_id")
    eos = fields.get("tokenizer.ggml.eos_token_id")
    eot = fields.get("tokenizer.ggml.eot_token_id")
    eos_ids = [int(i) for i in (eos, eot) if i is not None and 0 <= int(i) < len(tokens)]
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False))
    return cls(hf, bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_ids,
               chat_template=fields.get("tokenizer.chat_template"), add_bos=add_bos)

  # -- serialisation (the converted-weight cache stores tokenizers this way) ----------------------------

  def to_json(self) -> dict[str, Any]:
    """Everything needed to rebuild this tokenizer exactly: the ``tokenizers`` JSON and our settings."""
    return {"tokenizer_json": self._hf.to_str(), "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids), "chat_template": self.chat_template,
            "add_bos": self.add_bos, "bos_token": self.bos_token, "eos_token": self.eos_token}

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "Tokenizer":
    """Inverse of ``to_json``."""
    hf = tokenizers.Tokenizer.from_str(d["tokenizer_json"])
    return cls(hf, bos_token_id=d["bos_token_id"], eos_token_ids=d["eos_token_ids"],
               chat_template=d["chat_template"], add_bos=d["add_bos"], bos_token=d["bos_token"],
               eos_token=d["eos_token"])

  # -- basics -------------------------------------------------------------------------------------------

  @property
  def hf(self) -> tokenizers.Tokenizer:
    return self._hf

  @property
  def vocab_size(self) -> int:
    return self._hf.get_vocab_size(with_added_tokens=True)

  @property
  def has_chat_template(self) -> bool:
    return self._template is not None

  def token_to_id(self, token: str) -> int | None:
    return self._hf.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    return self._id_to_token(token_id)

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    """Token ids of ``text``; special-token strings map to their ids.

    BOS is prepended when ``add_bos`` (default: the model's own setting) and the text does not already
    start with it.
    """
    ids = list(self._hf.encode(text, add_special_tokens=False).ids)
    use_bos = self.add_bos if add_bos is None else (add_bos and self.bos_token_id is not None)
    if use_bos and (not ids or ids[0] != self.bos_token_id):
      ids.insert(0, self.bos_token_id)
    return ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  # -- chat ---------------------------------------------------------------------------------------------

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = True) -> str:
    """Render ``messages`` ([{"role", "content"}, ...]) with the model's chat template."""
    if self._template is None:
      return fallback_chat_format(messages, add_generation_prompt)
    try:
      return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "")
    except jinja2.TemplateError as e:
      raise ConfigError(f"chat template failed to render: {e}") from e

  def encode_chat(self, user_message: str, system: str | None = None) -> list[int]:
    """Token ids of a single-turn chat prompt, ready for generation."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user_message}]
    return self.encode(self.apply_chat_template(messages, add_generation_prompt=True))

  # -- helpers ------------------------------------------------------------------------------------------

  def _id_to_token(self, token_id: int | None) -> str | None:
    return None if token_id is None else self._hf.id_to_token(int(token_id))

  def _end_of_turn_ids(self) -> list[int]:
    if not self.chat_template:
      return []
    ids = []
    for tok in END_OF_TURN_TOKENS:
      if tok in self.chat_template and self._hf.token_to_id(tok) is not None:
        ids.append(self._hf.token_to_id(tok))
    return ids

  def __repr__(self) -> str:
    return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_ids}, "
            f"chat_template={'yes' if self.has_chat_template else 'no (fallback)'})")


def _post_processor_adds_bos(hf: tokenizers.Tokenizer, bos_id: int | None) -> bool:
  """Whether the tokenizer.json post-processor prepends BOS (how Llama-3 tokenizers declare add_bos)."""
  if bos_id is None:
    return False
  with_special = hf.encode("a", add_special_tokens=True).ids
  return bool(with_special) and with_special[0] == bos_id
