"""Flag types and the parser of the `specjax` commands: a value out of range is refused while the command line
is parsed, in one line with exit status 2, before anything is imported, loaded or measured.

  --port 70000          specjax serve: error: argument --port: must be an integer from 0 to 65535, got '70000'
  --top-p 0             ... argument --top-p: must be a number in (0, 1], got '0'
"""
from __future__ import annotations

import argparse
import math
import sys


# --activations (kernels/cpu_qdot.ACTIVATIONS, named here so that --help imports no jax; a test keeps them equal)
ACTIVATIONS = ("fp32", "int8", "int8-64", "int8-256")
# --verify (speculative/acceptance.VERIFY_RULES, named here for the same reason; tests/speculative/test_block_verify.py)
VERIFY = ("tokenwise", "block")


class Parser(argparse.ArgumentParser):
  """argparse's parser, with its errors as one line (the usage it would print is one ``--help`` away).

  Subparsers are made of the same class, so every command's errors read alike."""

  def error(self, message: str):  # noqa: D401 -- argparse's hook
    sys.stderr.write(f"specjax: error: {self.prog}: {message} (`{self.prog} --help` lists the flags)\n")
    sys.stderr.flush()
    raise SystemExit(2)


def integer(lo: int | None = None, hi: int | None = None):
  """An argparse type: an integer in [lo, hi] (either end open when None)."""

  def parse(text: str) -> int:
    try:
      v = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
      bounds = f"from {lo} to {hi}" if lo is not None and hi is not None else _range(lo, hi)
      raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {text!r}")
    return v

  parse.__name__, parse.bounds = "integer", (lo, hi)
  return parse


def number(lo: float | None = None, hi: float | None = None, lo_open: bool = False):
  """An argparse type: a finite number in [lo, hi], or (lo, hi] with ``lo_open``."""

  def parse(text: str) -> float:
    try:
      v = float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    low_bad = lo is not None and (v <= lo if lo_open else v < lo)
    if not math.isfinite(v) or low_bad or (hi is not None and v > hi):
      raise argparse.ArgumentTypeError(f"must be a number {_range(lo, hi, lo_open)}, got {text!r}")
    return v

  parse.__name__, parse.bounds = "number", (lo, hi)
  return parse


def _range(lo, hi, lo_open: bool = False) -> str:
  if lo is not None and hi is not None:
    return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
  if lo is not None:
    return f"{'>' if lo_open else '>='} {lo:g}"
  return f"<= {hi:g}"


# The flags the commands share, by meaning.
COUNT = integer(1)              # prompts, tokens, requests, slots, repeats: at least one
NONNEG = integer(0)             # k (0: no speculation where a command allows it), top-k (0: off), seeds
PORT = integer(0, 65535)        # 0: any free port
TEMPERATURE = number(0.0)       # 0: greedy
PROBABILITY = number(0.0, 1.0, lo_open=True)   # top-p
FRACTION = number(0.0, 1.0)     # acceptance rates
RATE = number(0.0)              # requests per second (0: all at once)
POSITIVE = number(0.0, lo_open=True)           # seconds, GiB


WEIGHT_KINDS = ("fp32", "bf16", "int8", "int4")   # quant.KINDS (tests/measure/test_costmodel.py keeps them equal)


def weight_kind(text: str) -> str:
  """An argparse type: one weight type."""
  if text not in WEIGHT_KINDS:
    raise argparse.ArgumentTypeError(f"unknown weight type {text!r}: use one of {', '.join(WEIGHT_KINDS)}")
  return text


def weight_kinds(text: str) -> list[str]:
  """An argparse type: weight types separated by commas, e.g. 'fp32,int8,int4'."""
  kinds = [weight_kind(t.strip()) for t in text.split(",") if t.strip()]
  if not kinds:
    raise argparse.ArgumentTypeError(f"no weight type in {text!r}: use e.g. fp32,int8,int4")
  return kinds


def verify_rules(text: str) -> list[str]:
  """An argparse type: verification rules separated by commas, e.g. 'tokenwise,block' (bench compares them)."""
  rules = [t.strip() for t in text.split(",") if t.strip()]
  bad = [r for r in rules if r not in VERIFY]
  if bad or not rules:
    raise argparse.ArgumentTypeError(f"unknown verification rule {(bad or [text])[0]!r}: use {' or '.join(VERIFY)}, "
                                     "or both separated by a comma")
  return rules
