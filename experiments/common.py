"""Shared setup for experiments: load the model, pick prompts, build the batches every method runs on."""
from __future__ import annotations

from specjax import api
from specjax.eval import bench
from specjax.prompts import Prompt, load_prompts


def pick_prompts(prompts: str, categories=None, per_category: int | None = None,
                 limit: int | None = None) -> list[Prompt]:
  """Prompts from a file (or the built-in set), at most ``per_category`` of each category, then ``limit``."""
  return load_prompts(prompts, categories, limit=limit, per_category=per_category)


def setup(model: str, prompts: list[Prompt], batch_size: int, max_new_tokens: int, max_len: int,
          dtype: str = "auto", draft: str | None = None, mesh: str | None = None, weights: str = "auto",
          activations: str = "auto", log=print):
  """The target (and draft) loaded in ``dtype`` ("auto": bfloat16 on accelerators, float32 on the CPU) with
  ``weights`` (auto, fp32, bf16, int8, int4: as ``--weights``) and ``activations`` (as ``--activations``) and,
  with ``mesh`` ('DATAxMODEL'), sharded over that many devices; the prompts in batches."""
  m = api.load(model, dtype=dtype, weights=weights, activations=activations)
  d = api.load(draft, dtype=dtype, weights=weights, activations=activations) if draft else None
  if mesh is not None:
    m = api.on_mesh(m, mesh)
    d = api.on_mesh(d, m.mesh) if d is not None else None
    log(f"[experiment] sharded over a {mesh} (data x model) mesh")
  batches = bench.make_batches(m, prompts, batch_size, max_new_tokens, max_len)
  log(f"[experiment] {model}: {len(prompts)} prompts, batch {batch_size}, {max_new_tokens} new tokens")
  return m, d, batches


def encode_trace(m, items: list[dict], max_new_tokens: int, k: int, max_len: int, name: str):
  """(each request's chat-encoded prompt, the longest's length) for a served trace; refuses a prompt that
  does not fit buffers of ``max_len`` with ``max_new_tokens`` and the batcher's headroom (k + 2)."""
  from specjax.errors import SpecjaxError
  encoded = [m.tokenizer.encode_chat(r["prompt"]) for r in items]
  longest = max(map(len, encoded))
  if longest + max_new_tokens + k + 2 > max_len:
    raise SpecjaxError(f"{name}: a prompt of {longest} tokens + {max_new_tokens} new does not fit max_len "
                       f"{max_len}: raise max_len")
  return encoded, longest


def prompt_set_batches(ps: dict, m, model: str, max_new_tokens: int, max_len: int, weights: str = "auto",
                       log=print):
  """(the target, the batches of one prompt set ``ps``: {"prompts", and optionally "categories",
  "per_category", "limit"}): the target loaded with the first set (``m`` None), reused after."""
  chosen = pick_prompts(ps["prompts"], ps.get("categories"), ps.get("per_category"), ps.get("limit"))
  if m is None:
    m, _, batches = setup(model, chosen, 1, max_new_tokens, max_len, weights=weights, log=log)
    return m, batches, chosen
  return m, bench.make_batches(m, chosen, 1, max_new_tokens, max_len), chosen
