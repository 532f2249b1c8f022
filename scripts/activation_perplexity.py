"""Perplexity of a model at each weight type and activation choice, over real texts, as the decode-sized
kernels compute it (each text fed through the cache a few tokens at a time, as a verification is: ``api.score``
with ``block``), against the fp32 model on the same texts.

  python scripts/activation_perplexity.py --model smollm2-135m \\
      --kinds int8+fp32,int8+int8,int4+fp32,int4+int8 \\
      --humaneval ../shared/data/humaneval/HumanEval_0-99.jsonl --spec-bench ../shared/data/spec_bench/question.jsonl

A kind is ``WEIGHTS+ACTIVATIONS`` (``--weights`` and ``--activations``).  Texts: the first ``--texts`` HumanEval
tasks (prompt + canonical solution) and as many Spec-Bench summarization articles, each cut to ``--tokens``
tokens.  Prints each kind's perplexity over all tokens, per source, and its change against fp32.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

from specjax import api


def texts(humaneval: str | None, spec_bench: str | None, n: int) -> dict[str, list[str]]:
  out = {}
  if humaneval:
    rows = [json.loads(line) for line in open(humaneval, encoding="utf-8")][:n]
    out["humaneval"] = [r["prompt"] + r["canonical_solution"] for r in rows]
  if spec_bench:
    rows = [json.loads(line) for line in open(spec_bench, encoding="utf-8")]
    out["summarization"] = [r["turns"][0] for r in rows if r.get("category") == "summarization"][:n]
  if not out:
    raise SystemExit("give --humaneval and/or --spec-bench")
  return out


def nll(m, docs: list[str], tokens: int, block: int) -> tuple[float, int]:
  """Summed negative log-likelihood and token count over ``docs``, each cut to ``tokens`` tokens."""
  total, count = 0.0, 0
  for doc in docs:
    ids = m.tokenizer.encode(doc)[:tokens]
    text = m.tokenizer.decode(ids)
    lp = np.asarray(api.score(m, text, block=block).logprobs)
    total -= float(lp.sum())
    count += lp.size
  return total, count


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--kinds", default="int8+fp32,int8+int8,int4+fp32,int4+int8")
  ap.add_argument("--humaneval")
  ap.add_argument("--spec-bench")
  ap.add_argument("--texts", type=int, default=8, help="texts per source")
  ap.add_argument("--tokens", type=int, default=384, help="tokens per text")
  ap.add_argument("--block", type=int, default=8, help="tokens per forward (a verification's rows)")
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args()
  from specjax.measure import provenance
  docs = texts(args.humaneval, args.spec_bench, args.texts)
  print(f"[ppl] {provenance.short(provenance.describe())}; {args.model}; "
        + ", ".join(f"{k}: {len(v)} texts" for k, v in docs.items()), flush=True)
  results = {}
  for spec in ["fp32", *args.kinds.split(",")]:
    weights, _, acts = spec.partition("+")
    t0 = time.perf_counter()
    m = api.load(args.model, dtype="float32", weights=weights, activations=acts or "fp32")
    per = {src: nll(m, d, args.tokens, args.block) for src, d in docs.items()}
    total = sum(v[0] for v in per.values()) / sum(v[1] for v in per.values())
    results[spec] = {"perplexity": math.exp(total), **{src: math.exp(s / c) for src, (s, c) in per.items()}}
    base = results["fp32"]
    print(f"[ppl] {spec:16s} " + "  ".join(
        f"{key} {val:.4f} ({100 * (val / base[key] - 1):+.2f}%)" for key, val in results[spec].items())
        + f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
  if args.json:
    print(json.dumps(results))


if __name__ == "__main__":
  main()
