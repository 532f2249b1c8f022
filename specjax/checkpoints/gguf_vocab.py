"""GGUF vocabularies as ``tokenizers`` tokenizers: the ``tokenizer.ggml.*`` metadata of a GGUF file rebuilt
from the ``tokenizers`` library's own model, normalizer, pre-tokenizer and decoder classes.

  * ``tokenizer.ggml.model == "gpt2"`` (``build_gguf_bpe``): the vocabulary, merges and token types as a
    byte-level BPE, the pre-tokenizer chosen by ``tokenizer.ggml.pre``;
  * ``tokenizer.ggml.model == "llama"`` (``build_gguf_spm``, SentencePiece BPE, e.g. Gemma): the vocabulary as
    a BPE with byte fallback whose merges are recovered from the order of the vocabulary, spaces written as ▁.

``hf_tokenizer_from_gguf`` picks between them; ``tokenizer.Tokenizer.from_gguf_fields`` adds the special ids
and the chat template.  Kept apart from ``tokenizer`` because this is the one place that knows llama.cpp's
vocabulary conventions.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from specjax.errors import CheckpointError

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

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
# Choosing by tokenizer.ggml.model


def hf_tokenizer_from_gguf(fields: Mapping[str, Any]) -> tokenizers.Tokenizer:
  """The ``tokenizers`` tokenizer that GGUF ``tokenizer.*`` metadata (key -> decoded Python value) describes.

  Needs ``tokenizer.ggml.tokens`` and, by ``tokenizer.ggml.model``: "gpt2" (byte-level BPE, the default)
  ``tokenizer.ggml.merges``; "llama" (SentencePiece BPE) ``scores`` and ``token_type``, and no space prefix.
  Uses ``token_type``, ``pre`` and ``unknown_token_id`` when present.
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
    return build_gguf_bpe(tokens, list(fields["tokenizer.ggml.merges"]),
                          fields.get("tokenizer.ggml.token_type"), fields.get("tokenizer.ggml.pre", "gpt2"))
  # llama.cpp prepends a space to SentencePiece text unless the file says not to (Gemma's do).
  if fields.get("tokenizer.ggml.add_space_prefix", True):
    raise CheckpointError("GGUF SentencePiece tokenizer asks for a space prefix "
                          "(tokenizer.ggml.add_space_prefix, Llama-2 style), which specjax does not "
                          "build; load the model's Hugging Face directory instead")
  unk = fields.get("tokenizer.ggml.unknown_token_id")
  return build_gguf_spm(tokens, list(fields["tokenizer.ggml.scores"]),
                        list(fields["tokenizer.ggml.token_type"]), None if unk is None else int(unk))
