"""Tokenizer: a Hugging Face ``tokenizers.Tokenizer`` plus the model's chat template.

Two ways in:
  * ``Tokenizer.from_file``: a ``tokenizer.json`` (and optionally the parsed ``tokenizer_config.json``) from a
    Hugging Face model directory.
  * ``Tokenizer.from_gguf_fields``: the ``tokenizer.*`` metadata of a GGUF file, its vocabulary rebuilt by
    ``gguf_vocab`` (byte-level BPE for ``tokenizer.ggml.model == "gpt2"``, SentencePiece BPE for "llama").

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

# build_gguf_bpe, build_gguf_spm and spm_merges are re-exported: they lived here before gguf_vocab.
from specjax.checkpoints.gguf_vocab import (build_gguf_bpe, build_gguf_spm, hf_tokenizer_from_gguf,  # noqa: F401
                                            spm_merges)
from specjax.errors import CheckpointError, ConfigError

# End-of-turn markers used by common chat templates.  When a template uses one of these and the vocabulary
# has it, generation should stop on it as well as on the declared EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>",
                      "<|endoftext|>", "</s>")

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
    hf = hf_tokenizer_from_gguf(fields)
    tokens = fields["tokenizer.ggml.tokens"]
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
