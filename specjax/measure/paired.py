"""Paired timing: run every method on the same prompt back to back, and summarise the per-prompt ratios.

A shared machine's speed drifts: a neighbour's job slows everything for a minute, then stops.  If all plain
decoding ran first and all speculative decoding after, a slowdown during one half lands on one side of the
speedup.  Here each prompt is decoded by every method in turn (the order rotated from one prompt to the next,
so no method always goes first), and the speedup is computed per prompt from runs seconds apart: a drift
slower than one prompt's runs cancels in each ratio.

Pure functions over numpy arrays; ``specjax.eval.bench`` does the decoding.
"""
from __future__ import annotations

import warnings

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def schedule(num_methods: int, num_prompts: int, repeats: int = 1, paired: bool = True) -> list[tuple]:
  """Execution order as (repeat, prompt, method) triples.

  paired: for each repeat and prompt, every method back to back, the order rotated by one each time (with
  two methods: A B, B A, A B, ...).  Not paired ("blocked"): each method over all prompts before the next,
  as benchmarks used to do (kept to show what pairing removes)."""
  order = []
  for r in range(repeats):
    if paired:
      for p in range(num_prompts):
        shift = (r * num_prompts + p) % num_methods
        order += [(r, p, (shift + i) % num_methods) for i in range(num_methods)]
    else:
      order += [(r, p, i) for i in range(num_methods) for p in range(num_prompts)]
  return order


def ratios(base_s_RxP: np.ndarray, other_s_RxP: np.ndarray, base_tokens_RxP: np.ndarray,
           other_tokens_RxP: np.ndarray) -> np.ndarray:
  """Per (repeat, prompt) speedup: other's tokens/s ÷ base's tokens/s; NaN where a method decoded nothing (the
  prompt's first token was an end-of-sequence token: no decode step ran, there is no speed to compare)."""
  base_t, other_t = np.asarray(base_tokens_RxP, np.float64), np.asarray(other_tokens_RxP, np.float64)
  base_s, other_s = np.asarray(base_s_RxP, np.float64), np.asarray(other_s_RxP, np.float64)
  ok = (base_t > 0) & (other_t > 0) & (base_s > 0) & (other_s > 0)
  with np.errstate(divide="ignore", invalid="ignore"):
    return np.where(ok, (other_t / other_s) / (base_t / base_s), np.nan)


def bootstrap_median_ci(ratio_RxP: np.ndarray, level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                        seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
  """Confidence interval of the median ratio, by resampling prompts (all repeats of a drawn prompt come
  along); a fixed seed, so the same data always gives the same interval."""
  ratio_RxP = np.asarray(ratio_RxP, np.float64)
  P = ratio_RxP.shape[1]
  rng = np.random.default_rng(seed)
  picks = rng.integers(0, P, size=(resamples, P))
  with np.errstate(all="ignore"), warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)     # a resample drawing only prompts without a ratio
    medians = np.nanmedian(ratio_RxP[:, picks].transpose(1, 0, 2).reshape(resamples, -1), axis=1)
  medians = medians[np.isfinite(medians)]
  if medians.size == 0:
    return float("nan"), float("nan")
  lo, hi = np.quantile(medians, [(1 - level) / 2, 1 - (1 - level) / 2])
  return float(lo), float(hi)


def spread(tokens_RxP: np.ndarray, seconds_RxP: np.ndarray) -> list[float]:
  """[min, median, max] over repeats of tokens/s (each repeat's totals over all prompts)."""
  per_repeat = np.sum(tokens_RxP, axis=1) / np.sum(seconds_RxP, axis=1)
  return [float(np.min(per_repeat)), float(np.median(per_repeat)), float(np.max(per_repeat))]


def summarize(base_s_RxP, base_tokens_RxP, other_s_RxP, other_tokens_RxP) -> dict:
  """The paired statistics ``bench`` reports for one method against the base (plain decoding).

  ``speedup`` is the ratio of totals (all prompts, all repeats), as before; ``speedup_median`` and
  ``speedup_iqr`` describe the per-prompt, per-repeat ratios; ``speedup_ci95`` bootstraps the median over
  prompts."""
  r = ratios(base_s_RxP, other_s_RxP, base_tokens_RxP, other_tokens_RxP)
  finite = r[np.isfinite(r)]
  q25, q50, q75 = np.quantile(finite, [0.25, 0.5, 0.75]) if finite.size else (np.nan,) * 3
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)     # a prompt no method decoded (all NaN)
    by_prompt = np.nanmedian(r, axis=0)
  base_tps = float(np.sum(base_tokens_RxP) / np.sum(base_s_RxP))
  other_tps = float(np.sum(other_tokens_RxP) / np.sum(other_s_RxP))
  return {"speedup": other_tps / base_tps, "speedup_median": float(q50),
          "speedup_iqr": [float(q25), float(q75)], "speedup_ci95": list(bootstrap_median_ci(r)),
          "speedup_by_prompt": [None if np.isnan(x) else float(x) for x in by_prompt],
          "prompts_without_decode": int(np.sum(np.all(~np.isfinite(r), axis=0))),
          "ar_tokens_per_s_spread": spread(base_tokens_RxP, base_s_RxP),
          "spec_tokens_per_s_spread": spread(other_tokens_RxP, other_s_RxP)}
