"""The map between two tokenizers' vocabularies that lets a draft model of another tokenizer draft for a target
(``speculative/cross_vocab.py`` runs it): made once at load, on the host, from the two ``Tokenizer``s.

Each token is read as the bytes it decodes to, whatever the tokenizer's spelling: byte-level BPE (GPT-2's byte
alphabet: Qwen, SmolLM2, Llama 3), SentencePiece (``▁`` for a space, ``<0xNN>`` byte pieces: Gemma), or plain
text.  Special tokens are matched by their text (``<|im_end|>`` in both ChatML vocabularies), never by bytes.

  * **Mapped tokens** (the token-level intersection): the tokens whose bytes are one token in both
    vocabularies, as pairs ``draft_ids[i]`` ↔ ``target_ids[i]``.  They are all the draft may propose: its
    distribution restricted to them and renormalized, q over the target's vocabulary is zero elsewhere, and
    the target's rejection rule stays lossless.
  * **Pieces**: how the draft reads each target token of the context, its bytes spelled in the draft's
    vocabulary by the draft's own BPE model (a mapped token is its one draft token; ``:\\n`` of Qwen is ``:``
    then ``\\n`` for SmolLM2): at most ``width`` draft ids per target token (a longer spelling keeps its first
    ``width``, so the draft reads less of that token; nothing else changes), at least one (a token the draft
    cannot spell at all reads as the draft's unknown token, or token 0).

  vm = build(target.tokenizer, draft.tokenizer, target_vocab=151936, draft_vocab=49152)
  vm.mapped, vm.target_share, vm.draft_share        # 39237, 0.258, 0.798 (Qwen2.5-Coder and SmolLM2)
  vm.pieces_VxW, vm.piece_counts_V                  # [V_target, width] draft ids, [V_target] how many
"""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np

from specjax.checkpoints.tokenizer import Tokenizer

DEFAULT_WIDTH = 2            # draft ids per target token read: 2 spell 99.9% of Qwen's tokens in SmolLM2's
MIN_SHARE = 0.10             # refuse a pair sharing fewer tokens than this share of the smaller vocabulary

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_byte_alphabet() -> dict[int, str]:
  """GPT-2's byte → printable character map (the alphabet byte-level BPE vocabularies are written in)."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  out, extra = {b: chr(b) for b in keep}, 0
  for b in range(256):
    if b not in out:
      out[b] = chr(256 + extra)
      extra += 1
  return out


BYTE_TO_CHAR = _gpt2_byte_alphabet()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def spelling(tok: Tokenizer) -> str:
  """How a tokenizer writes bytes in its tokens: "bytelevel", "sentencepiece" or "text" (read off its decoder)."""
  state = json.loads(tok.hf.decoder.__getstate__()) if tok.hf.decoder is not None else {}
  kinds = {d.get("type") for d in state.get("decoders", [state])}
  if "ByteLevel" in kinds:
    return "bytelevel"
  if "ByteFallback" in kinds or "Metaspace" in kinds or any(
      d.get("type") == "Replace" and d.get("pattern", {}).get("String") == "▁" for d in state.get("decoders", [])):
    return "sentencepiece"
  return "text"


def _specials(tok: Tokenizer) -> dict[int, str]:
  return {i: a.content for i, a in tok.hf.get_added_tokens_decoder().items() if a.special}


def token_bytes(tok: Tokenizer, vocab: int) -> list:
  """Per id below ``vocab``: the bytes the token decodes to, ("special", text) for a special token, or None
  (an id the tokenizer does not have, such as an embedding row past its vocabulary)."""
  how, specials = spelling(tok), _specials(tok)
  added = {i: a.content for i, a in tok.hf.get_added_tokens_decoder().items()}
  out = []
  for i in range(vocab):
    s = tok.hf.id_to_token(i)
    if s is None:
      out.append(None)
    elif i in specials:
      out.append(("special", specials[i]))
    elif i in added:
      out.append(added[i].encode())
    elif how == "bytelevel":
      out.append(bytes(CHAR_TO_BYTE[c] for c in s) if all(c in CHAR_TO_BYTE for c in s) else s.encode())
    elif how == "sentencepiece":
      m = _BYTE_PIECE.fullmatch(s)
      out.append(bytes([int(m.group(1), 16)]) if m else s.replace("▁", " ").encode())
    else:
      out.append(s.encode())
  return out


def _spell(draft: Tokenizer, how: str, data: bytes) -> list[int]:
  """The draft's own BPE spelling of ``data`` (one pre-token: no pre-tokenizer split, no special parsing)."""
  model = draft.hf.model
  if how == "bytelevel":
    return [t.id for t in model.tokenize("".join(BYTE_TO_CHAR[b] for b in data))]
  text = data.decode("utf-8", errors="surrogateescape")
  if how == "text":
    return [t.id for t in model.tokenize(text)] if text else []
  ids, run = [], ""
  for ch in text + "\0":                       # byte pieces for bytes that are no character on their own
    if "\udc80" <= ch <= "\udcff" or ch == "\0":
      if run:
        ids += [t.id for t in model.tokenize(run.replace(" ", "▁"))]
        run = ""
      piece = draft.hf.token_to_id(f"<0x{ord(ch) - 0xDC00:02X}>") if ch != "\0" else None
      ids += [piece] if piece is not None else []
    else:
      run += ch
  return ids


def _index(draft: Tokenizer, d_bytes: list) -> dict:
  """The draft token of each byte string: the first id, except that a byte piece (``<0x31>``) gives way to a
  piece of the same bytes (``1``), the one the draft's own tokenizer writes."""
  index, byte_piece = {}, set()
  for i, b in enumerate(d_bytes):
    if b is None or b == b"":
      continue
    is_byte = bool(_BYTE_PIECE.fullmatch(draft.hf.id_to_token(i) or ""))
    if b not in index or (b in byte_piece and not is_byte):
      index[b] = i
      byte_piece.discard(b)
      if is_byte:
        byte_piece.add(b)
  return index


@dataclasses.dataclass(frozen=True)
class VocabMap:
  """The map, as host arrays (``cross_vocab.map_params`` puts them on device)."""
  draft_ids: np.ndarray        # [I] the mapped tokens' draft ids
  target_ids: np.ndarray       # [I] ... and their target ids
  pieces_VxW: np.ndarray       # [V_target, width] each target token spelled in draft ids (padded with 0)
  piece_counts_V: np.ndarray   # [V_target] how many of the row are real (1..width)
  draft_bos: int               # the draft's BOS, put before the prompt when its tokenizer adds one; -1: none
  target_vocab: int
  draft_vocab: int
  truncated: int               # target tokens whose draft spelling is longer than ``width`` (cut to it)

  @property
  def width(self) -> int:
    return self.pieces_VxW.shape[1]

  @property
  def mapped(self) -> int:
    return len(self.target_ids)

  @property
  def target_share(self) -> float:
    return self.mapped / self.target_vocab

  @property
  def draft_share(self) -> float:
    return self.mapped / self.draft_vocab

  @property
  def smaller_share(self) -> float:
    return self.mapped / min(self.target_vocab, self.draft_vocab)

  def summary(self, target: str, draft: str) -> str:
    """One line: the mapped share of both vocabularies."""
    return (f"drafting across tokenizers: {self.mapped:,} tokens map between {draft} ({self.draft_share:.1%} of "
            f"its {self.draft_vocab:,}) and {target} ({self.target_share:.1%} of its {self.target_vocab:,}); "
            f"the draft proposes only those (lossless)")

  def to_dict(self) -> dict:
    return {"mapped_tokens": self.mapped, "target_vocab": self.target_vocab, "draft_vocab": self.draft_vocab,
            "target_share": round(self.target_share, 4), "draft_share": round(self.draft_share, 4),
            "width": self.width, "truncated_spellings": self.truncated}


def build(target: Tokenizer, draft: Tokenizer, *, target_vocab: int | None = None, draft_vocab: int | None = None,
          width: int = DEFAULT_WIDTH) -> VocabMap:
  """The map from ``target``'s vocabulary (``target_vocab`` ids: the target model's logits) to ``draft``'s
  (ids below ``draft_vocab``: its embedding rows)."""
  if width < 1:
    raise ValueError(f"a target token is read as 1 or more draft tokens, got width {width}")
  Vt, Vd = target_vocab or target.vocab_size, draft_vocab or draft.vocab_size
  t_bytes, d_bytes = token_bytes(target, Vt), token_bytes(draft, Vd)
  index = _index(draft, d_bytes)
  how = spelling(draft)
  unk = draft.hf.token_to_id(draft.hf.model.unk_token) if getattr(draft.hf.model, "unk_token", None) else None
  fallback = unk if unk is not None and unk < Vd else 0
  pieces = np.full((Vt, width), fallback, np.int32)
  counts = np.ones((Vt,), np.int32)
  pairs, truncated = [], 0
  for t, b in enumerate(t_bytes):
    if b is None or b == b"":
      continue
    d = index.get(b)
    if d is not None:
      pairs.append((d, t))
      pieces[t, 0] = d
      continue
    ids = (draft.encode(b[1], add_bos=False) if isinstance(b, tuple) else _spell(draft, how, b))
    ids = [i for i in ids if i is not None and 0 <= i < Vd]
    truncated += len(ids) > width
    if ids:
      pieces[t, :min(len(ids), width)] = ids[:width]
      counts[t] = min(len(ids), width)
  pairs_arr = np.asarray(pairs, np.int32).reshape(-1, 2)
  bos = draft.bos_token_id if draft.add_bos and draft.bos_token_id is not None else -1
  return VocabMap(pairs_arr[:, 0].copy(), pairs_arr[:, 1].copy(), pieces, counts, int(bos), Vt, Vd, truncated)
