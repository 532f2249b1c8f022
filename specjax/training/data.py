"""Distillation data: what the target says, and what it thinks while saying it, stored once on disk.

Two stages, each resumable and each finished by an atomic rename (a half-written stage never looks done):

  1. ``generate_responses``: the target answers every prompt with the project's batched decoding
     (``api.generate``); one JSON line per prompt in ``responses.jsonl`` (prompt ids, response ids).  A killed
     run continues after the last complete line.
  2. ``compute_features``: one teacher-forced target pass over every prompt + response stores, per token,
     the final hidden state (EAGLE's feature), the residual stream after a few layers (EAGLE-3's fused
     features) and the target's top-k log-probabilities, in ``features/`` as flat memory-mappable arrays:

       tokens.npy     int32 [T]          all sequences end to end
       offsets.npy    int64 [S+1]        sequence s is tokens[offsets[s]:offsets[s+1]]
       prompt_lens.npy int32 [S]         the first prompt_lens[s] tokens of sequence s are the prompt
       final.npy      float16 [T, D]     the final hidden state at each token (after the final norm)
       fused.npy      float16 [T, F]     residual stream after ``fused_layers``, concatenated
       topk_ids.npy   int32 [T, K]       the target's K most likely next tokens at each position
       topk_logp.npy  float16 [T, K]      and their log-probabilities
       meta.json                          what made it (target, layers, counts); written last

Any JSONL (``{"prompt": ...}`` or Spec-Bench records) or text file can be added to the prompts by path.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import progress as progress_lib
from specjax.models import quant
from specjax.errors import SpecjaxError
from specjax.training.jsonl import read_records

RESPONSES = "responses.jsonl"
FEATURES = "features"


def read_responses(path: Path) -> list[dict]:
  """The complete records of a responses file (a last line cut by a kill is ignored, any other bad line is an
  error naming it)."""
  def check(rec):
    if not isinstance(rec.get("prompt_ids"), list) or not isinstance(rec.get("response_ids"), list):
      raise ValueError("needs 'prompt_ids' and 'response_ids' lists")
  return read_records(path, check, "delete that line or the file to regenerate")


def generate_responses(m, prompts: Sequence[dict], out_dir: str | Path, *, max_new_tokens: int = 256,
                       batch_size: int = 16, temperature: float = 0.0, seed: int = 0, max_len: int = 512,
                       chunk: int | None = None, capture=None, token_budget: int | None = None) -> Path:
  """Stage 1: the target's replies to ``prompts`` (``{"id", "prompt", ...}``) appended to responses.jsonl.

  ``capture`` (``speculative.Record``): also keep what the decode computed — the tapped features and the
  top-k at every position — one shard per batch in ``captured/`` (each line names its shard and row), so that
  ``compute_features`` assembles the store instead of running the target again.  A shard is renamed into
  place before its lines are appended; a kill between the two leaves an unreferenced shard, removed on
  resume.

  ``token_budget``: stop after the batch whose replies bring this call's prompts to that many reply tokens
  (the prompts are answered in random chunks, so the replies made are a fair sample of all of them)."""
  from specjax import api
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / RESPONSES
  done = read_responses(path)
  done_ids = {r["id"] for r in done}
  if path.exists():                                  # drop a torn last line before appending
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
      path.write_text(text[:text.rfind("\n") + 1], encoding="utf-8")
  shards = None
  if capture is not None:
    shards = _CaptureShards(out_dir, capture, m.cfg, {r["shard"] for r in done if "shard" in r})
    chunk = batch_size                               # one shard per batch: a kill loses at most one batch
  todo = [p for p in prompts if p["id"] not in done_ids]
  asked = {p["id"] for p in prompts}
  have_tokens = sum(len(r["response_ids"]) for r in done if r["id"] in asked)
  # Similar lengths together: fewer padding buckets, less padding.
  enc = api.encode_prompts(m, [p["prompt"] for p in todo])
  too_long = [i for i, e in enumerate(enc) if len(e) + max_new_tokens > max_len]
  if too_long:
    raise SpecjaxError(f"{len(too_long)} prompts do not fit {max_len} positions with {max_new_tokens} new "
                       f"tokens (e.g. '{todo[too_long[0]]['prompt'][:60]}...'): raise max_len")
  chunk = chunk or batch_size * 4
  order = generation_order([len(e) for e in enc], chunk, seed)
  new_tokens = 0
  t0 = time.perf_counter()
  with progress_lib.progress() as bar, path.open("a", encoding="utf-8") as f:
    task = bar.add_task("target replies", total=len(prompts), completed=len(prompts) - len(todo), info="")
    for start in range(0, len(order), chunk):
      if token_budget and have_tokens + new_tokens >= token_budget:
        progress_lib.say(f"replies hold {have_tokens + new_tokens} tokens, the budget {token_budget}: the "
                         f"remaining {len(order) - start} prompts are not answered")
        break
      idx = order[start:start + chunk]
      gens, _ = api.generate(m, [todo[i]["prompt"] for i in idx], max_new_tokens=max_new_tokens,
                             temperature=temperature, seed=seed + start, batch_size=batch_size,
                             max_len=max_len, record=capture)
      where = shards.write(gens) if shards is not None else [{}] * len(gens)
      lines = []
      for i, g, w in zip(idx, gens, where):
        rec = {"id": todo[i]["id"], "category": todo[i].get("category", ""), "prompt": todo[i]["prompt"],
               "prompt_ids": enc[i], "response_ids": g.token_ids, **w}
        lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
        new_tokens += len(g.token_ids)
      f.write("".join(lines))
      f.flush()
      rate = new_tokens / (time.perf_counter() - t0)
      bar.update(task, advance=len(idx), info=f"{rate:.0f} tok/s")
  return path


CAPTURED = "captured"


class _CaptureShards:
  """``captured/NNNNNN/`` shards of recorded features (``features.npy`` [T, F] float16, ``topk_ids.npy``,
  ``topk_logp.npy``, ``offsets.npy``), and ``captured/record.json``: what was recorded (layers, top-k), so
  that a resumed run cannot mix layouts."""

  def __init__(self, out_dir: Path, capture, cfg, referenced: set[str]):
    self.dir = out_dir / CAPTURED
    self.dir.mkdir(exist_ok=True)
    want = {"taps": list(capture.taps), "final": bool(capture.final), "top_k": int(capture.top_k),
            "d_model": cfg.d_model, "target_config": cfg.name}
    info = self.dir / "record.json"
    if info.exists():
      have = json.loads(info.read_text())
      if have != want:
        raise SpecjaxError(f"{self.dir} holds features recorded as {have}, this run records {want}: use "
                           "another data directory, or the settings that made it")
    else:
      info.write_text(json.dumps(want, indent=1))
    for d in self.dir.iterdir():       # torn (.tmp) or never referenced (killed before its lines were written)
      if d.is_dir() and d.name not in referenced:
        shutil.rmtree(d)
    names = [int(d.name) for d in self.dir.iterdir() if d.is_dir() and d.name.isdigit()]
    self.next = max(names, default=-1) + 1

  def write(self, gens) -> list[dict]:
    name = f"{self.next:06d}"
    self.next += 1
    tmp = self.dir / (name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    recs = [g.recorded for g in gens]
    lens = [len(r["features"]) for r in recs]
    np.save(tmp / "offsets.npy", np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
    for key, file in (("features", "features.npy"), ("topk_ids", "topk_ids.npy"), ("topk_logp", "topk_logp.npy")):
      np.save(tmp / file, np.concatenate([r[key] for r in recs]))
    os.replace(tmp, self.dir / name)
    return [{"shard": name, "row": i} for i in range(len(gens))]


def generation_order(lengths: Sequence[int], chunk: int, seed: int = 0) -> list[int]:
  """The order prompts are answered in: a random permutation cut into chunks, each chunk sorted by length.

  Within a chunk similar lengths share a batch (less padding); across chunks the order is random, so a stage
  stopped after any chunk has answered a fair sample of the prompts (every category, short and long ones), not
  just the shortest."""
  perm = np.random.default_rng(seed).permutation(len(lengths)).tolist()
  return [i for a in range(0, len(perm), chunk) for i in sorted(perm[a:a + chunk], key=lambda i: lengths[i])]


def _pad_bucket(n: int) -> int:
  return max(64, -(-n // 64) * 64)


def compute_features(m, data_dir: str | Path, *, fused_layers: Sequence[int] | None = None, top_k: int = 8,
                     batch_size: int = 8) -> Path:
  """Stage 2: a teacher-forced target pass over every stored sequence; arrays in ``features/``.

  Written to ``features.tmp/`` and renamed when complete, so an existing ``features/`` is always whole."""
  from specjax.parallel import distributed, sharding
  from specjax.models import decoder as model_lib
  from specjax.models.kv_cache import init_cache
  data_dir = Path(data_dir)
  mesh = getattr(m, "mesh", None)          # a sharded target: the pass runs over its mesh
  records = read_responses(data_dir / RESPONSES)
  if not records:
    raise SpecjaxError(f"no responses in {data_dir / RESPONSES}: run the generation stage first")
  cfg = m.cfg
  fused = tuple(fused_layers) if fused_layers is not None else default_fused_layers(cfg.num_layers)
  if all("shard" in r for r in records):
    info = json.loads((data_dir / CAPTURED / "record.json").read_text())
    if tuple(info["taps"]) == fused and info["final"] and info["top_k"] >= top_k:
      return assemble_features(data_dir, records, m.source, cfg, fused, top_k)
    progress_lib.say(f"the replies' recorded features tap layers {info['taps']} (top-{info['top_k']}), the store "
                     f"asks for {list(fused)} (top-{top_k}): running the target over the data instead")
  seqs = [r["prompt_ids"] + r["response_ids"] for r in records]
  store = _NewStore(data_dir, records, cfg.d_model, fused, top_k)
  lens, offsets = store.lens, store.offsets
  tokens, final, fusedf, top_ids, top_lp = store.arrays

  @jax.jit
  def run(params, toks_BxT):
    B, T = toks_BxT.shape
    cache = init_cache(cfg, B, T, quant.activation_dtype(m.params) if hasattr(m, "params") else jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    out = model_lib.forward(params, cfg, toks_BxT, pos, cache, feature_layers=fused)
    lp, ids = jax.lax.top_k(jax.nn.log_softmax(out.logits, axis=-1), top_k)
    return out.hidden, out.features, ids, lp

  order = np.argsort(lens)
  biggest = 0.0
  with progress_lib.progress() as bar:
    task = bar.add_task("target features", total=len(seqs), info="")
    for start in range(0, len(order), batch_size):
      idx = order[start:start + batch_size]
      P = _pad_bucket(int(lens[idx].max()))
      arr = np.zeros((batch_size, P), np.int32)
      for row, s in enumerate(idx):
        arr[row, :lens[s]] = seqs[s]
      out = run(m.prefill_params, jax.device_put(arr) if mesh is None else sharding.shard_batch(arr, mesh))
      hid, feat, ids, lp = (distributed.to_host(x) for x in out)
      biggest = max(biggest, float(np.abs(feat).max()), float(np.abs(hid).max()))
      for row, s in enumerate(idx):
        a, b, n = offsets[s], offsets[s + 1], lens[s]
        tokens[a:b] = arr[row, :n]
        final[a:b] = hid[row, :n]
        fusedf[a:b] = feat[row, :n]
        top_ids[a:b] = ids[row, :n]
        top_lp[a:b] = lp[row, :n]
      bar.update(task, advance=len(idx), info=f"{int(offsets[-1])} tokens")
  if biggest > 6e4:
    raise SpecjaxError(f"a feature reaches {biggest:.3g}, beyond float16: this target needs another storage "
                       "dtype")
  return store.finish(m.source, cfg, biggest)


def assemble_features(data_dir: Path, records: list[dict], source: str, cfg, fused: tuple[int, ...],
                      top_k: int) -> Path:
  """``features/`` from the shards recorded while the replies were generated (no target pass): the same
  arrays as ``compute_features``' except that the top-k before the last prompt token and everything at each
  sequence's last token are zeros (training reads neither)."""
  D = cfg.d_model
  store = _NewStore(data_dir, records, D, fused, top_k)
  lens, offsets = store.lens, store.offsets
  tokens, final, fusedf, top_ids, top_lp = store.arrays
  shards: dict[str, dict] = {}
  biggest = 0.0
  with progress_lib.progress() as bar:
    task = bar.add_task("assembling recorded features", total=len(records), info="")
    for s, r in enumerate(records):
      if r["shard"] not in shards:
        shards.clear()                  # records come shard by shard: keep one open
        d = data_dir / CAPTURED / r["shard"]
        try:
          shards[r["shard"]] = {n: np.load(d / f"{n}.npy", mmap_mode="r")
                                for n in ("offsets", "features", "topk_ids", "topk_logp")}
        except (OSError, ValueError) as e:
          raise SpecjaxError(f"recorded shard {d} is missing or damaged ({e}): delete it and the lines of "
                             f"{RESPONSES} that name it, then rerun to regenerate them") from e
      sh = shards[r["shard"]]
      a, b = int(sh["offsets"][r["row"]]), int(sh["offsets"][r["row"] + 1])
      if b - a != lens[s]:
        raise SpecjaxError(f"record {r['id']}: shard {r['shard']} row {r['row']} holds {b - a} positions, the "
                           f"record {lens[s]}: the data directory is inconsistent; regenerate it")
      o0, o1 = offsets[s], offsets[s + 1]
      feats = sh["features"][a:b]
      biggest = max(biggest, float(np.abs(feats).max()))
      tokens[o0:o1] = r["prompt_ids"] + r["response_ids"]
      fusedf[o0:o1] = feats[:, :-D]
      final[o0:o1] = feats[:, -D:]
      top_ids[o0:o1] = sh["topk_ids"][a:b, :top_k]
      top_lp[o0:o1] = sh["topk_logp"][a:b, :top_k]
      bar.update(task, advance=1, info=f"{int(o1)} tokens")
  if not np.isfinite(biggest):
    raise SpecjaxError("a recorded feature overflowed float16: this target needs another storage dtype")
  return store.finish(source, cfg, biggest, recorded=True)


class _NewStore:
  """A ``features/`` store being written (to ``features.tmp/``): its memory-mapped arrays for ``records``
  and, once filled, ``finish`` — meta.json last, then the rename that makes it complete."""

  def __init__(self, data_dir: Path, records: list[dict], D: int, fused: tuple[int, ...], top_k: int):
    self.data_dir, self.records, self.fused, self.top_k = data_dir, records, fused, top_k
    self.lens = np.array([len(r["prompt_ids"]) + len(r["response_ids"]) for r in records], np.int64)
    self.offsets = np.concatenate([[0], np.cumsum(self.lens)])
    T = int(self.offsets[-1])
    self.tmp = data_dir / (FEATURES + ".tmp")
    shutil.rmtree(self.tmp, ignore_errors=True)
    self.tmp.mkdir(parents=True)
    mm = lambda name, dtype, shape: np.lib.format.open_memmap(self.tmp / name, "w+", dtype, shape)
    self.arrays = (mm("tokens.npy", np.int32, (T,)), mm("final.npy", np.float16, (T, D)),
                   mm("fused.npy", np.float16, (T, D * len(fused))), mm("topk_ids.npy", np.int32, (T, top_k)),
                   mm("topk_logp.npy", np.float16, (T, top_k)))
    np.save(self.tmp / "offsets.npy", self.offsets)
    np.save(self.tmp / "prompt_lens.npy", np.array([len(r["prompt_ids"]) for r in records], np.int32))

  def finish(self, source: str, cfg, biggest: float, recorded: bool = False) -> Path:
    for arr in self.arrays:
      arr.flush()
    meta = {"target": source, "target_config": cfg.name, "d_model": cfg.d_model, "vocab_size": cfg.vocab_size,
            "fused_layers": list(self.fused), "top_k": self.top_k, "sequences": len(self.records),
            "tokens": int(self.offsets[-1]),
            "response_tokens": int(sum(len(r["response_ids"]) for r in self.records)), "max_abs_feature": biggest,
            **({"recorded": True} if recorded else {})}
    (self.tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    dest = self.data_dir / FEATURES
    if dest.exists():
      shutil.rmtree(dest)
    os.replace(self.tmp, dest)
    return dest


def default_fused_layers(num_layers: int) -> tuple[int, ...]:
  """EAGLE-3's low, middle and high layers: near the bottom, the middle, and a few below the top."""
  return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 4, 0))


def merge_stores(sources: Sequence[str | Path], out_dir: str | Path) -> Path:
  """One data directory holding the sequences of several (``responses.jsonl`` and ``features/`` end to end),
  so data made at different times trains together.  The sources must come from the same target with the same
  fused layers and top-k; the merged store is written to a temporary name and renamed when complete."""
  out_dir = Path(out_dir)
  metas, records = [], []
  for src in sources:
    meta_path = Path(src) / FEATURES / "meta.json"
    if not meta_path.exists():
      raise SpecjaxError(f"{src} has no complete feature store: finish its data stages first")
    metas.append(json.loads(meta_path.read_text()))
    records.append(read_responses(Path(src) / RESPONSES))
    if len(records[-1]) != metas[-1]["sequences"]:
      raise SpecjaxError(f"{src}: responses.jsonl has {len(records[-1])} records but the feature store "
                         f"{metas[-1]['sequences']} sequences: recompute its features")
  same = ("target_config", "d_model", "vocab_size", "fused_layers", "top_k")
  for src, meta in zip(sources[1:], metas[1:]):
    diff = [k for k in same if meta.get(k) != metas[0].get(k)]
    if diff:
      raise SpecjaxError(f"{src} differs from {sources[0]} in {', '.join(diff)}: only stores of one target "
                         "and one feature layout merge")
  if (out_dir / FEATURES / "meta.json").exists():
    raise SpecjaxError(f"{out_dir} already holds a feature store: choose another directory")
  out_dir.mkdir(parents=True, exist_ok=True)
  tmp = out_dir / (FEATURES + ".tmp")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir()
  load = lambda src, name: np.load(Path(src) / FEATURES / name, mmap_mode="r")
  for name in ("tokens.npy", "final.npy", "fused.npy", "topk_ids.npy", "topk_logp.npy", "prompt_lens.npy"):
    parts = [load(src, name) for src in sources]
    shape = (sum(len(a) for a in parts),) + parts[0].shape[1:]
    dst = np.lib.format.open_memmap(tmp / name, "w+", parts[0].dtype, shape)
    at = 0
    for a in parts:
      for i in range(0, len(a), 1 << 16):          # in slices: the stores can be larger than memory
        piece = a[i:i + (1 << 16)]
        dst[at + i:at + i + len(piece)] = piece
      at += len(a)
    dst.flush()
    del dst
  offsets, base = [np.zeros(1, np.int64)], 0
  for src in sources:
    off = np.asarray(load(src, "offsets.npy"))
    offsets.append(off[1:] + base)
    base += int(off[-1])
  np.save(tmp / "offsets.npy", np.concatenate(offsets))
  meta = {**metas[0], "sequences": sum(m["sequences"] for m in metas), "tokens": base,
          "response_tokens": sum(m["response_tokens"] for m in metas),
          "max_abs_feature": max(m["max_abs_feature"] for m in metas), "merged_from": [str(s) for s in sources]}
  (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
  with (out_dir / (RESPONSES + ".tmp")).open("w", encoding="utf-8") as f:
    for i, (src, recs) in enumerate(zip(sources, records)):     # ids stay distinct across the sources
      for r in recs:
        f.write(json.dumps({**r, "id": f"{i}:{Path(src).name}:{r['id']}"}, ensure_ascii=False) + "\n")
  os.replace(out_dir / (RESPONSES + ".tmp"), out_dir / RESPONSES)
  os.replace(tmp, out_dir / FEATURES)
  return out_dir
