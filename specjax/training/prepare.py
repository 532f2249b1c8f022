"""The data a drafter is trained on, made once per data directory: the prompts (synthesized questions, chat
requests, code tasks, files, requests the target writes itself), the target's replies and, recorded while it
wrote them, its features and top-k (``data.py`` stores them)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from specjax.errors import SpecjaxError


def _log(msg: str) -> None:
  import sys
  sys.stderr.write(f"[train] {msg}\n")
  sys.stderr.flush()


def default_data_dir(model: str, num_prompts: int, max_new_tokens: int, chat_prompts: int = 0,
                     passage_prompts: int = 0, self_prompts: int = 0, code_prompts: int = 0,
                     data_tokens: int = 0) -> Path:
  from specjax.cache_location import cache_dir
  safe = model.replace("/", "_")
  mix = (f"-c{chat_prompts}-t{passage_prompts}-s{self_prompts}" if chat_prompts or passage_prompts or self_prompts
         else "")
  mix += f"-k{code_prompts}" if code_prompts else ""
  mix += f"-b{data_tokens}" if data_tokens else ""
  return cache_dir() / "distill" / f"{safe}-p{num_prompts}{mix}-n{max_new_tokens}"


def prepare_data(m, data_dir: Path, *, num_prompts: int, max_new_tokens: int, extra_prompts: Sequence[str],
                 gen_batch_size: int, seed: int, fused_layers=None, max_len: int = 512, chat_prompts: int = 0,
                 passage_prompts: int = 0, self_prompts: int = 0, code_prompts: int = 0,
                 record_features: bool = True, data_tokens: int = 0) -> Path:
  """Stages 1-2 of the data, skipped when already complete.

  The prompts: ``num_prompts`` short synthesized questions (``synth_prompts``), ``chat_prompts`` chat-style
  requests (``chat_prompts.chat_requests``), ``code_prompts`` code tasks (``code_prompts.code_requests``), the
  records of each ``extra_prompts`` file and ``self_prompts`` requests asking the target to write a user's
  question; then, in a second round, ``passage_prompts`` tasks (summarize, translate, extract...) over the
  target's replies, and the questions the target wrote.

  ``record_features``: keep the target's features and top-k while it writes the replies (``Engine.record``),
  so the feature stage only assembles them; else a second, teacher-forced target pass computes them.
  ``data_tokens`` > 0: the first round stops once its replies hold that many tokens (a fair sample of its
  prompts: they are answered in random order), so the data fits a time budget."""
  from specjax import api
  from specjax.prompts import load_prompts
  from specjax.speculative import Record
  from specjax.training import chat_prompts as chat_lib, code_prompts as code_lib, data, synth_prompts
  feats = data_dir / data.FEATURES / "meta.json"
  if feats.exists():
    return data_dir
  fused = tuple(fused_layers) if fused_layers is not None else data.default_fused_layers(m.cfg.num_layers)
  prompts = (synth_prompts.synthesize(num_prompts, seed=seed) + chat_lib.chat_requests(chat_prompts, seed=seed)
             + code_lib.code_requests(code_prompts, seed=seed)
             + (synth_prompts.self_written_seed_prompts(self_prompts, seed=seed + 1) if self_prompts else []))
  for path in extra_prompts:
    for p in load_prompts(path):
      prompts.append({"id": f"{Path(path).name}:{p.question_id}", "category": p.category, "prompt": p.text})
  if not prompts:
    raise SpecjaxError("no training prompts: set num_prompts, chat_prompts, code_prompts, self_prompts or "
                       "extra_prompts")
  _log(f"data: {len(prompts)} prompts -> {data_dir}")
  gen = dict(max_new_tokens=max_new_tokens, batch_size=gen_batch_size, seed=seed, max_len=max_len,
             capture=Record(taps=fused, top_k=8) if record_features else None)
  data.generate_responses(m, prompts, data_dir, token_budget=data_tokens or None, **gen)
  if passage_prompts or self_prompts:
    first = {p["id"] for p in prompts}
    # The first round's replies, in id order (the file's order depends on where a killed run resumed).
    replies = sorted((r for r in data.read_responses(data_dir / data.RESPONSES) if r["id"] in first),
                     key=lambda r: r["id"])
    text = {r["id"]: m.tokenizer.decode(r["response_ids"]) for r in replies}
    tasks = []
    if passage_prompts:
      tasks += chat_lib.passage_requests([t for i, t in text.items() if not i.startswith("self-")],
                                         passage_prompts, seed=seed, max_chars=4 * (max_len - max_new_tokens - 48))
    if self_prompts:
      written = synth_prompts.questions_from_replies([t for i, t in text.items() if i.startswith("self-")])
      tasks += [{"id": f"selfq-{i}", "category": "self-written", "prompt": q} for i, q in enumerate(written)]
    fits = [len(e) + max_new_tokens <= max_len for e in api.encode_prompts(m, [t["prompt"] for t in tasks])]
    tasks = [t for t, ok in zip(tasks, fits) if ok]
    _log(f"data: {len(tasks)} second-round prompts (tasks over the target's replies, its own questions) -> "
         f"{data_dir}")
    data.generate_responses(m, tasks, data_dir, **gen)
  data.compute_features(m, data_dir, fused_layers=fused)
  return data_dir
