"""What a decode must satisfy before anything is allocated: the memory bill fits, the prompts fit the
buffer, a draft shares the target's tokenizer (or, drafting across tokenizers, enough of its vocabulary)."""
from __future__ import annotations

import os
from typing import Sequence

import jax
import jax.numpy as jnp

from specjax.checkpoints import vocab_map
from specjax.measure import memory
from specjax.errors import SpecjaxError
from specjax.runtime.loaded import Model


def device_memory_bytes() -> float:
  """Memory the buffers may use: the accelerator's (bytes_limit), or the machine's RAM on the CPU."""
  dev = jax.devices()[0]
  try:
    stats = dev.memory_stats() or {}
  except Exception:  # noqa: BLE001 -- the CPU client has no memory stats
    stats = {}
  if stats.get("bytes_limit"):
    return float(stats["bytes_limit"])
  try:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
  except (ValueError, OSError, AttributeError):
    return float("inf")


def memory_bill(m: "Model", max_len: int, nodes: int, draft_cfg=None, sampling_: bool = False,
                drafter=None) -> memory.KVBill:
  """The bill of buffers of ``max_len`` slots verifying ``nodes`` drafts: target KV in the model's dtype, the
  drafter's state (``drafter``'s own account when given, else a draft model's cache from ``draft_cfg``),
  token ids, the logits workspace and the weights."""
  dtype = {jnp.dtype(jnp.bfloat16): "bfloat16", jnp.dtype(jnp.float16): "float16"}.get(
      m.dtype, "float32")
  state = None if drafter is None else drafter.state_bytes_per_seq(max_len)
  return memory.kv_bill(m.cfg, max_len, nodes, draft_cfg, dtype, sampling_, draft_state_per_seq=state)


def check_memory(m: "Model", max_len: int, nodes: int, batch_size: int, draft_cfg=None, sampling_: bool = False,
                 budget: float | None = None, drafter=None, batch_flag: str = "--batch-size") -> None:
  """Refuse buffers whose ``memory_bill`` would not fit the memory budget, before anything is allocated
  (``batch_flag``: the flag the refusal tells the user to lower)."""
  bill = memory_bill(m, max_len, nodes, draft_cfg, sampling_, drafter)
  memory.check_budget(budget if budget is not None else device_memory_bytes(), bill, batch_size,
                         what=f"KV buffers of {max_len} slots", batch_flag=batch_flag)


def check_fits(prompt_lens: Sequence[int], max_new_tokens: int, max_len: int, extra: int = 0) -> None:
  longest = max(prompt_lens)
  if longest + max_new_tokens + extra > max_len:
    raise SpecjaxError(
        f"prompt of {longest} tokens + {max_new_tokens} new tokens"
        + (f" + {extra} speculative slots" if extra else "")
        + f" does not fit the KV cache of {max_len} positions: raise --max-len or shorten the prompt "
        "or --max-new-tokens")


def same_tokenizer(target: Model, draft: Model) -> bool:
  """Whether the draft reads and writes the target's token ids: the same vocabulary sizes and the same ids for
  a few telling texts."""
  if target.cfg.vocab_size != draft.cfg.vocab_size or target.tokenizer.vocab_size != draft.tokenizer.vocab_size:
    return False
  sample = ["Hello world", " the", "<|im_end|>", "123 + 456 = 579", "naïve café"]
  return all(target.tokenizer.encode(t) == draft.tokenizer.encode(t) for t in sample)


def check_same_vocabulary(target: Model, draft: Model, advice: str = "") -> None:
  """Refuse a draft with another tokenizer (``advice``: what to do instead, appended)."""
  if same_tokenizer(target, draft):
    return
  if target.cfg.vocab_size != draft.cfg.vocab_size:
    why = (f"has a vocabulary of {draft.cfg.vocab_size} tokens but the target '{target.source}' has "
           f"{target.cfg.vocab_size}")
  else:
    why = f"tokenizes text differently from the target '{target.source}'"
  raise SpecjaxError(f"draft model '{draft.source}' {why}: a draft must share the target's tokenizer{advice}")


def check_vocab_map(vm: vocab_map.VocabMap, target: Model, draft: Model) -> None:
  """Refuse a cross-tokenizer pair whose vocabularies share too little to draft with (``vocab_map.MIN_SHARE``
  of the smaller one), naming both sides."""
  if vm.smaller_share >= vocab_map.MIN_SHARE:
    return
  raise SpecjaxError(
      f"draft model '{draft.source}' ({vm.draft_vocab:,} tokens) and the target '{target.source}' "
      f"({vm.target_vocab:,} tokens) have different tokenizers that share {vm.mapped:,} tokens by their bytes "
      f"({vm.smaller_share:.1%} of the smaller vocabulary; drafting across tokenizers needs "
      f"{vocab_map.MIN_SHARE:.0%}): choose a draft whose vocabulary overlaps the target's")
