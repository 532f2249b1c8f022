"""What the `specjax` commands share: flags, loading, drafter checks, output."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from specjax.cli import flags


def log(msg: str) -> None:
  sys.stderr.write(msg + "\n")     # one write per line: helper threads may log too
  sys.stderr.flush()


def drafters():
  """The drafter registry (``speculative/registry.py``), imported on use: ``--help`` needs no jax."""
  from specjax.speculative import registry
  return registry


def emit(obj: Any, as_json: bool, human) -> None:
  from specjax.parallel import distributed
  if not distributed.is_main():     # a multi-process run: process 0 reports for all
    return
  if as_json:
    sys.stdout.write(json.dumps(obj, default=json_default) + "\n")
  else:
    human(obj)


def json_default(o):
  import numpy as np
  if isinstance(o, (np.integer,)):
    return int(o)
  if isinstance(o, (np.floating,)):
    return float(o)
  if isinstance(o, np.ndarray):
    return o.tolist()
  return str(o)


def add_model_flags(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default="smollm2-135m",
                 help="registry name, a .gguf file, or a Hugging Face safetensors directory")
  p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                 help="weights, KV buffers and activations (logits and softmax statistics stay fp32); auto: "
                      "bfloat16 on GPU and TPU, float32 on the CPU")
  p.add_argument("--weights", default="auto", choices=["auto", "fp32", "bf16", "int8", "int4"],
                 help="the weights' type, quantized at load and widened inside the matmuls (int8: a scale per "
                      "64 inputs; int4: scale and offset per 32, embedding and head int8); auto: --dtype's")
  p.add_argument("--activations", default="auto", choices=["auto", *flags.ACTIVATIONS],
                 help="what int8/int4 weights multiply when decoding and verifying: fp32 activations, or int8 "
                      "on integer dot products (int8-64, int8-256: one scale per 64 or 256 inputs, else 32); "
                      "auto: $SPECJAX_ACTIVATIONS, else the default (docs/guides/quantized-weights.md)")
  p.add_argument("--draft-weights", default=None, choices=["auto", "fp32", "bf16", "int8", "int4"],
                 help="the draft model's or trained head's weight type (default: the target's; the "
                      "registry's draft at the type `specjax models` names, e.g. int8 beside an fp32 coder "
                      "target; a head's layer, input projections and head rows)")
  p.add_argument("--max-len", type=flags.COUNT, default=None,
                 help="KV cache positions per sequence (default: generate and bench size them to the longest "
                      "prompt + --max-new-tokens + speculative headroom, rounded up to a power of two ≥ 256; "
                      "other commands 2048)")
  p.add_argument("--no-compile-cache", action="store_true",
                 help="do not read or write the persistent compilation cache (also SPECJAX_COMPILE_CACHE=0)")


def add_mesh_flags(p: argparse.ArgumentParser) -> None:
  p.add_argument("--mesh", help="DATAxMODEL devices, e.g. 2x4: shard the model over a device mesh of all "
                                "processes' devices (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N "
                                "makes N devices); docs/guides/multi-device.md")
  add_process_flags(p)


def add_process_flags(p: argparse.ArgumentParser) -> None:
  """The multi-process flags of every command that takes --mesh (``specjax/parallel/distributed.py`` reads them)."""
  from specjax.parallel import distributed as d
  p.add_argument("--coordinator", default=None,
                 help=f"multi-process: HOST:PORT of process 0's coordinator (or ${d.ENV_COORDINATOR})")
  p.add_argument("--num-processes", type=flags.COUNT, default=None,
                 help=f"multi-process: how many (or ${d.ENV_NUM_PROCESSES})")
  p.add_argument("--process-id", type=flags.NONNEG, default=None,
                 help=f"multi-process: this one's index (or ${d.ENV_PROCESS_ID})")
  p.add_argument("--distributed", action="store_true",
                 help="multi-process, values detected by jax from the cluster launcher (SLURM, Open MPI, TPU)")


def add_drafter_flags(p: argparse.ArgumentParser, trees: bool = True, default: str = "none",
                 many_trees: bool = False) -> None:
  p.add_argument("--drafter", default=default, help="none | ngram | layerskip | model | hybrid | eagle | "
                 "eagle-parallel | eagle-hybrid | suffix (hybrid: prompt lookup where the last --ngram tokens "
                 "occurred before, the draft model elsewhere; eagle-hybrid: the same with a trained head; suffix: "
                 "suffix decoding over earlier requests)")
  p.add_argument("--draft", default=None, help="--drafter model or hybrid: a draft model (hybrid: same tokenizer as --model; "
                 "model: another tokenizer drafts through a map of the tokens both vocabularies hold); "
                 "--drafter eagle, eagle-parallel or eagle-hybrid: a trained drafter's directory "
                 "(`specjax models` lists them)")
  if trees:
    p.add_argument("--k", type=flags.NONNEG, default=4, help="tokens drafted per speculative step (a chain)")
    p.add_argument("--tree", default=None, action="append" if many_trees else "store",
                   help="token tree of N draft nodes instead of the chain of --k: chain:K, branch:W1,W2,..., "
                        "paths:FILE, sequoia:N[:D] (needs --acceptance) or dynamic:N[:TOPK[:D]]"
                        + ("; repeat it to compare several trees in the same run" if many_trees else ""))
    p.add_argument("--acceptance", default=None,
                   help="acceptance vector file (from `specjax acceptance-vector`) for --tree sequoia:N")
  p.add_argument("--ngram", type=flags.COUNT, default=3, help="longest n-gram matched by --drafter ngram; "
                 "the match --drafter hybrid or eagle-hybrid needs before it drafts by lookup")
  p.add_argument("--ngram-caps", default="1,3",
                 help="--drafter ngram: most tokens drafted after a match of only 1, 2, ... tokens (longer "
                      "matches draft --k); 'none' drafts --k after any match (default 1,3)")
  p.add_argument("--draft-layers", default=None,
                 help="--drafter layerskip: a count L (the first L layers) or indices like 0,1,2,5")
  p.add_argument("--index-tokens", type=flags.COUNT, default=None,
                 help="--drafter suffix: the index of earlier requests' tokens, in token slots (4 bytes each on "
                      "the device; the oldest evicted past it; default 65536)")


def add_adapt_flags(p: argparse.ArgumentParser) -> None:
  """Online adaptation of a trained feature drafter from the served traffic (``training/online.py``)."""
  p.add_argument("--adapt", action="store_true",
                 help="keep training the --drafter eagle head on the served requests' recorded target features "
                      "(between steps while idle; the output stays the target's, only acceptance changes)")
  p.add_argument("--adapt-dir", default=None,
                 help="--adapt: save the adapted head here (orbax) and start from the last one saved there")
  p.add_argument("--adapt-lr", type=flags.POSITIVE, default=1e-4, help="--adapt: the AdamW learning rate")
  p.add_argument("--adapt-buffer-tokens", type=flags.COUNT, default=16384,
                 help="--adapt: positions the replay buffer keeps (oldest requests evicted first)")
  p.add_argument("--adapt-batch", type=flags.COUNT, default=2, help="--adapt: rows per training batch")
  p.add_argument("--adapt-seq-len", type=flags.COUNT, default=256, help="--adapt: positions per training row")
  p.add_argument("--adapt-replay", type=flags.POSITIVE, default=4.0,
                 help="--adapt: times each served position is trained on, on average (the step budget traffic earns)")
  p.add_argument("--adapt-every", type=flags.NONNEG, default=0,
                 help="--adapt: also one step every N busy decode steps (0: only while no request waits)")
  p.add_argument("--adapt-accumulate", type=flags.COUNT, default=1,
                 help="--adapt: update the head once every N steps from their averaged gradients (short steps: "
                      "a request arriving while the idle server trains waits at most one)")
  p.add_argument("--adapt-checkpoint-every", type=flags.COUNT, default=50,
                 help="--adapt-dir: save every N adaptation steps (and when the server stops)")


def adapter_factory(args):
  """None, or what ``ContinuousBatcher(adapter_factory=...)`` calls with the built drafter and its params."""
  from specjax.errors import SpecjaxError
  if not getattr(args, "adapt", False):
    if getattr(args, "adapt_dir", None):
      raise SpecjaxError("--adapt-dir needs --adapt")
    return None
  if not drafters().get(args.drafter).head:
    raise SpecjaxError(f"--adapt trains a feature drafter's head from served traffic: use --drafter eagle (or "
                       f"eagle-parallel) --draft DIR, not --drafter {args.drafter}")
  import functools
  from specjax.training import online
  cfg = online.AdaptConfig(learning_rate=args.adapt_lr, batch_size=args.adapt_batch, seq_len=args.adapt_seq_len,
                           buffer_tokens=args.adapt_buffer_tokens, every=args.adapt_every, replay=args.adapt_replay,
                           checkpoint_every=args.adapt_checkpoint_every, accumulate=args.adapt_accumulate,
                           min_tokens=min(args.adapt_seq_len, args.adapt_buffer_tokens))
  return functools.partial(online.OnlineAdapter.for_engine, cfg=cfg, checkpoint_dir=args.adapt_dir, log=log,
                           fingerprint={"drafter": str(args.draft)})


def add_serving_flags(p: argparse.ArgumentParser) -> None:
  from specjax.serving.policies import POLICIES
  p.add_argument("--k", type=flags.NONNEG, default=4, help="k for --policy fixed and off-above")
  p.add_argument("--policy", default="fixed", choices=POLICIES,
                 help="fixed k; off-above (k up to --max-batch live sequences, else 0); adaptive (smoothed "
                      "acceptance moves k); goodput (the cost model's best k, per sequence)")
  p.add_argument("--buckets", default="0,1,2,4,8", help="compiled k values for adaptive and goodput")
  p.add_argument("--tree", action="append", default=None,
                 help="a token tree served as a bucket (chain:K, branch:W1,W2,..., paths:FILE, dynamic:N[:TOPK[:D]]): "
                      "--policy fixed or off-above runs it instead of the chain of --k; --policy goodput chooses "
                      "among the chains of --buckets and every --tree (repeat it) each step")
  p.add_argument("--max-batch", type=flags.NONNEG, default=4, help="--policy off-above: speculate up to this many")
  p.add_argument("--slots", type=flags.COUNT, default=8, help="sequences decoded at once (fixed KV buffers)")
  p.add_argument("--device", default=None, help="cost model for --policy goodput: a published spec or a "
                                               "calibration JSON (default: this machine, calibrated)")
  p.add_argument("--seed", type=flags.NONNEG, default=0)


def parse_buckets(text: str) -> tuple[int, ...]:
  from specjax.errors import SpecjaxError
  try:
    vals = tuple(sorted({int(x) for x in str(text).split(",") if x.strip()}))
  except ValueError:
    raise SpecjaxError(f"--buckets must be comma-separated k values like 0,1,2,4,8, got {text!r}") from None
  if not vals or min(vals) < 0:
    raise SpecjaxError(f"--buckets must be k values >= 0, got {text!r}")
  return vals


def serving_nodes(args) -> int:
  """The most draft nodes a served step verifies: the largest chain bucket (or --k) and every --tree's N."""
  from specjax import api
  trees = [api.resolve_tree(t, drafter=args.drafter, max_len=api.AUTO_MAX_LEN_LIMIT).num_nodes
           for t in (args.tree or ())]
  return max(parse_buckets(args.buckets) + (args.k,) + tuple(trees))


def serving_engine(args, m, max_len: int, **kwargs):
  from specjax.measure import calibrate
  from specjax.serving import factory
  draft = load_draft(args, m)
  if getattr(args, "mesh", None):
    from specjax import api
    m = api.on_mesh(m, args.mesh)
    if draft is not None and not isinstance(draft, str):
      draft = api.on_mesh(draft, m.mesh)
  spec = calibrate.load_or_calibrate(args.device, log=log) if args.policy == "goodput" else None
  adapt = adapter_factory(args)
  if adapt is not None:
    kwargs["adapter_factory"] = adapt
  return factory.make_batcher(m, drafter=args.drafter, policy=args.policy, k=args.k, buckets=parse_buckets(args.buckets),
                              trees=tuple(args.tree or ()),
                              slots=args.slots, max_len=max_len, max_batch=args.max_batch, spec=spec,
                              draft=draft, draft_layers=args.draft_layers, seed=args.seed, **kwargs,
                              **index_kwargs(args), **head_kwargs(args),
                              **({"ngram": args.ngram, "ngram_caps": parse_ngram_caps(args.ngram_caps)}
                                 if drafters().get(args.drafter).ngram_caps else {}))


def load_model(args):
  from specjax import api
  if getattr(args, "no_compile_cache", False):
    api.use_compile_cache(False)
  if getattr(args, "mesh", None):          # a mesh that cannot be made fails before the weights load
    api.make_mesh(args.mesh)
  dtype = api.default_dtype() if args.dtype == "auto" else args.dtype
  weights = getattr(args, "weights", "auto")
  log(f"[specjax] loading {args.model} ({dtype}{'' if weights == 'auto' else f', {weights} weights'})")
  m = api.load(args.model, dtype=dtype, weights=weights, activations=getattr(args, "activations", "auto"))
  log(f"[specjax] loaded in {m.load_s:.1f}s")
  return m


def load_draft(args, m, ds=None):
  """The draft of ``--drafter``/``--draft`` for the target ``m`` (``api.load_draft``): a loaded draft model
  (``--draft``, else the registry's draft for ``--model``; at ``--draft-weights``, else the target's weight
  type, or the type the registry's draft measured fastest at beside it), a trained drafter's directory, or
  None."""
  from specjax import api
  ds = ds or api.DecodeSpec(drafter=args.drafter)
  weights = getattr(args, "draft_weights", None) or "auto"
  return api.load_draft(m, ds, args.draft, weights=None if weights == "auto" else weights, log=log_specjax)


def log_specjax(msg: str) -> None:
  log(f"[specjax] {msg}")


def decode_spec(args, **overrides):
  """The decode the flags describe (``api.decode_spec``; ``overrides`` replace flags, e.g. one of several
  ``--tree``): every model-free check runs here, once, and ``--draft`` is checked (``api.check_draft``), all
  before any model loads."""
  from specjax import api
  settings = dict(drafter=args.drafter, ngram=args.ngram, draft_layers=args.draft_layers,
                  ngram_caps=args.ngram_caps, **index_kwargs(args), **head_kwargs(args))
  for name in ("k", "tree", "acceptance", "temperature", "top_k", "top_p", "verify"):
    if getattr(args, name, None) is not None:
      settings[name] = getattr(args, name)
  ds = api.decode_spec(**{**settings, **overrides})
  api.check_draft(ds, getattr(args, "draft", None))
  if getattr(args, "max_len", None):
    ds.check_room(args.max_len)
  return ds


def parse_ngram_caps(text: str) -> tuple[int, ...]:
  from specjax.runtime.request import parse_ngram_caps as parse
  return parse(text)


def drafter_kwargs(args) -> dict:
  return {"drafter": args.drafter, "k": args.k, "ngram": args.ngram, "draft_layers": args.draft_layers,
          "ngram_caps": parse_ngram_caps(args.ngram_caps), "tree": args.tree, "acceptance": args.acceptance,
          **index_kwargs(args), **head_kwargs(args)}


def head_kwargs(args) -> dict:
  """``head_weights`` from ``--draft-weights`` when the drafter is a trained head (a draft model takes the
  flag when it is loaded, ``load_draft``)."""
  w = getattr(args, "draft_weights", None)
  if w in (None, "auto") or not drafters().get(args.drafter).head:
    return {}
  return {"head_weights": w}


def index_kwargs(args) -> dict:
  """``index_tokens`` when ``--index-tokens`` was given (only learning drafters take it)."""
  n = getattr(args, "index_tokens", None)
  return {} if n is None else {"index_tokens": n}


def check_drafter(args) -> None:
  """Everything about the drafter and the tree that can fail without a model, for the commands that hand the
  flags on to a library call (``bench``, ``serve``, ...): the decode of each ``--tree`` (``decode_spec``),
  ``--buckets`` and ``--adapt``, all before any loading."""
  trees = args.tree if isinstance(getattr(args, "tree", None), list) else [getattr(args, "tree", None)]
  rules = args.verify if isinstance(getattr(args, "verify", None), list) else [getattr(args, "verify", None)]
  for tree in trees:
    acc = None if len(trees) > 1 and str(tree).startswith("dynamic") else getattr(args, "acceptance", None)
    for rule in rules:                      # bench: each verification rule it compares
      decode_spec(args, tree=tree, acceptance=acc, **({} if rule is None else {"verify": rule}))
  if getattr(args, "buckets", None) is not None:
    parse_buckets(args.buckets)
  adapter_factory(args)                     # --adapt with a drafter that has no head, bad settings


def default_max_len(args) -> int:
  from specjax.api import DEFAULT_MAX_LEN
  return args.max_len or DEFAULT_MAX_LEN


def executables() -> dict:
  """This process's XLA executables: compiled here, or read back from the persistent compilation cache."""
  from specjax.runtime import compile_cache
  c = compile_cache.counts()
  return {"executables_compiled": c["compiled"], "executables_from_cache": c["cache_hits"],
          "compile_cache_dir": str(compile_cache.directory() or "") or None}


def model_config(name: str):
  """A preset's config, or a model's config alone (a directory's config.json, a GGUF file's metadata): no
  tokenizer, no weights."""
  from specjax.checkpoints import load_config
  from specjax.models import config
  if name in config.PRESETS:
    return config.PRESETS[name]
  return load_config(name)
