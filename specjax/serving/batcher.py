"""Continuous batching over fixed KV buffers, with speculation chosen per iteration by a policy.

``ContinuousBatcher`` owns one ``SpecState`` of ``slots`` sequences (the KV buffers, allocated once) and one
compiled engine per k bucket (all sharing that state's shapes: ``Engine.stats_nodes``).  Each ``step``:
  1. admits queued requests into free slots: a B = 1 prefill written into the slot (``admit_slot``), while the
     other slots keep their caches;
  2. asks the policy for the bucket and each sequence's k (``policies``), from the slots' smoothed acceptance,
     and moves them to the bucket most rows want where requests pinned their own (``policies.apply_pins``);
  3. runs one speculative (or plain, k = 0) iteration for every slot: finished and empty slots compute no
     rows (the native kernels skip them), so an idle slot costs nothing;
  4. reads back the committed tokens, hands them to their requests, and frees the slots of requests that hit
     EOS, their max_tokens, or were cancelled.
A request that could never fit (prompt + max_tokens + speculative headroom > the buffers) is refused at
``submit`` with a clear error; a full queue refuses with ``QueueFull``.

With ``per_request=True`` (the server) every request brings its own sampling settings and seed: they are
per-slot data of the state (``sampling_rows.RowState``, written at admission), each slot draws from its own
key, and the engines run the sampling rule for every row (a greedy row's one-hot p makes it exactly greedy), so
a seeded request gets the same tokens alone or among others (at a fixed k: a policy that changes k with the
load changes which draws are made, not their distribution), and each token's log-probability is read back.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import sampling, sampling_rows
from specjax.parallel import sharding
from specjax import speculative as spec
from specjax.models.buffers import pad_batch, prompt_bucket
from specjax.errors import SpecjaxError
from specjax.models.kv_cache import init_cache
from specjax.runtime.builder import DecodeSpec, build
from specjax.serving import buckets as bk, policies as pol
from specjax.serving.latency import report
from specjax.serving.slots import SINGLE, mesh_jits, recorded_row
from specjax.speculative import registry as drafter_registry


class AdmissionError(SpecjaxError):
  """A request that cannot be served with these buffers (HTTP 400)."""


class QueueFull(SpecjaxError):
  """The waiting queue is at its limit (HTTP 429)."""


@dataclasses.dataclass(eq=False)        # requests are compared by identity
class Request:
  prompt_ids: list[int]
  max_new_tokens: int
  rid: Any = None
  arrival: float = 0.0                  # seconds (trace time; the batcher's clock)
  on_tokens: Callable | None = None     # called with (request, new token ids) as they are committed
  on_finish: Callable | None = None     # called with (request) once it is finished (any reason)
  sampling: sampling.SamplingParams | None = None   # per-request mode: its settings (None: the batcher's)
  seed: int | None = None               # per-request mode: its PRNG seed (None: drawn from the batcher's)
  pin: int | str | None = None          # its own bucket (``buckets.pin_key``; 0: off); None: the policy's
  error: str | None = None
  # filled in while serving
  slot: int | None = None
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)   # per-request mode: each token's
  admitted: float | None = None
  first_token: float | None = None
  token_times: list[float] = dataclasses.field(default_factory=list)
  finished: float | None = None
  finish_reason: str | None = None      # "stop" (EOS), "length", "cancelled"
  drafts_offered: int = 0               # draft tokens its steps offered it (its k each step)
  drafts_accepted: int = 0              # of which accepted
  cancelled: bool = False

  @property
  def done(self) -> bool:
    return self.finished is not None


@dataclasses.dataclass
class StepRecord:
  t: float
  k: int                        # the bucket's draft nodes per sequence (a chain's k; a tree's N)
  live: int
  rows: int
  committed: int
  seconds: float
  accepted: int = 0             # drafts accepted (offered: rows - live, each live sequence's k)
  bucket: str = ""              # the bucket: "k=4", or a tree's spec ("branch:2,2,1")


class ContinuousBatcher:
  """Serve requests over ``slots`` fixed KV buffers of ``max_len`` positions.

  ``drafter``/``drafter_kwargs`` as ``runtime.builder.DecodeSpec`` (one drafter for every bucket); ``buckets`` the compiled k values (0 = plain);
  ``trees`` token-tree specs compiled beside them (``serving/buckets.py``: every bucket one engine over one state);
  ``policy`` a ``policies`` object.  ``clock`` gives the current time in seconds.

  ``adapter_factory(drafter, draft_params)``: online adaptation (``training/online.OnlineAdapter.for_engine``):
  the engines record the target's features, each finished request goes into the adapter's replay buffer, and
  ``adapt`` (run while idle, and every ``every`` busy steps if the adapter asks) trains the head and swaps
  its weights in (same shapes: nothing recompiles)."""

  def __init__(self, m, *, slots: int = 8, max_len: int = 1024, drafter: str = "none", draft=None,
               buckets: Sequence[int] = (0, 1, 2, 4, 8), policy=None, sp: sampling.SamplingParams | None = None,
               eos_ids: Sequence[int] | None = None, max_queue: int = 1024, seed: int = 0,
               memory_budget: float | None = None, clock: Callable[[], float] = time.perf_counter,
               per_request: bool = False, adapter_factory: Callable | None = None, trees: Sequence[str] = (),
               **drafter_kwargs):
    self.m, self.slots, self.max_len, self.clock = m, int(slots), int(max_len), clock
    self.mesh = getattr(m, "mesh", None)    # a model on a mesh (``api.on_mesh``): every step runs sharded
    if self.mesh is not None and jax.process_count() > 1:
      raise SpecjaxError("serving over several processes is not supported (every process would have to step in "
                         "lockstep with the one receiving requests): use --mesh over one host's devices")
    self.sp = sp or sampling.SamplingParams()      # per-request mode: the default of a request without its own
    self.per_request = bool(per_request)
    self.eos_ids = tuple(m.tokenizer.eos_token_ids if eos_ids is None else eos_ids)
    kind = drafter_registry.get(drafter)
    self.bucket_info = bk.make_buckets(buckets if kind.speculates else [0], trees if kind.speculates else (),
                                       drafter, max_len)
    buckets = [k for k in self.bucket_info if isinstance(k, int)]
    self.k_top = max(buckets)
    self.buckets = buckets
    self.n_top = max(b.nodes for b in self.bucket_info.values())    # the most nodes one step verifies
    # One drafter for every bucket (its cache sized for the largest k); the memory bill of the slots' buffers
    # of max_len positions (a request must leave k_top + 1 of them free: ``headroom``).
    # Per-request mode bills the draft distributions a sampled row keeps (any request may sample).
    bill_sp = sampling.SamplingParams(temperature=1.0) if self.per_request else self.sp
    ds = DecodeSpec(drafter=drafter, k=max(self.n_top, 1), sampling=bill_sp, **drafter_kwargs)
    built = build(m, ds, eos_ids=self.eos_ids, max_len=max_len, draft=draft, batch_size=self.slots,
                  memory_budget=memory_budget)
    self.draft_params = built.draft_params
    self.learns, self.absorb_s = kind.learns, 0.0      # seconds spent indexing finished requests
    self.adapter = None if adapter_factory is None else adapter_factory(built.engine.drafter, built.draft_params)
    record = None
    if self.adapter is not None:            # a restored checkpoint's weights from the first step on
      self.draft_params, record = self.adapter.draft_params(), self.adapter.record
    nodes = self.n_top if kind.stateless else max(self.n_top, 1)      # every engine's counters: one state
    self.engines: dict[int | str, spec.Engine] = {
        k: (built.engine._replace(k_max=b.nodes, tree=b.shape, stats_nodes=nodes) if b.is_tree
            else built.engine_for(k, stats_nodes=nodes))._replace(sp=self.sp, per_row=self.per_request, record=record)
        for k, b in self.bucket_info.items()}
    self.adapt_log: list[dict] = []        # (time, step, seconds, metrics) of each adaptation step
    self.policy = policy or pol.FixedK(self.k_top)
    self.tracker = pol.AcceptanceTracker(self.slots, max(self.k_top, 1))
    self.tree_tracker = bk.TreeTracker(self.slots, [b for b in self.bucket_info.values() if b.is_tree])
    self.queue: collections.deque[Request] = collections.deque()
    self.max_queue = max_queue
    self.running: list[Request | None] = [None] * self.slots
    self.key = jax.random.PRNGKey(seed)
    self._seeds = np.random.default_rng(seed)      # per-request mode: seeds of requests that bring none
    self.history: list[StepRecord] = []
    self._prompt_len = np.zeros(self.slots, np.int64)
    self._num_new = np.zeros(self.slots, np.int64)
    self._waits = np.zeros(self.slots, np.int64)      # [B]: steps since each row got the bucket it wants
    self._accepted = np.zeros(self.slots, np.int64)
    self.state = self._empty_state()

  # ------------------------------------------------------------------ state
  def _empty_state(self) -> spec.SpecState:
    B, S = self.slots, self.max_len
    eng = self.engines[self.k_top]
    zeros = np.zeros((B, 1), np.int32)
    cache = init_cache(self.m.cfg, B, S, self.m.dtype)
    args = (zeros, np.ones(B, np.int32), np.zeros(B, np.int32))
    rows = self._rows([self.sp] * B, [0] * B) if self.per_request else None
    if self.mesh is None:
      self.jits = SINGLE
      args = jax.device_put(args)
    else:                                   # slots over "data", KV heads over "model"
      cache = sharding.shard_cache(cache, self.mesh)
      args = tuple(sharding.shard_batch(a, self.mesh) for a in args)
      if rows is not None:
        rows = jax.tree_util.tree_map(lambda a: sharding.shard_batch(a, self.mesh), rows)
      abstract = jax.eval_shape(functools.partial(spec.init, eng), self.m.prefill_params, self.draft_params,
                                cache, *args, jax.random.PRNGKey(0), rows)
      self.jits = mesh_jits(sharding.state_shardings(abstract, self.mesh, B))
    st = self.jits.init(eng, self.m.prefill_params, self.draft_params, cache, *args, jax.random.PRNGKey(0), rows)
    return st

  def _rows(self, settings, seeds) -> sampling_rows.RowState:
    return sampling_rows.RowState.create(settings, seeds, self.max_len)

  def _put(self, k_B):
    """Each slot's k, placed like the slots."""
    return jax.device_put(k_B) if self.mesh is None else sharding.shard_batch(k_B, self.mesh)

  def warmup(self, longest_prompt: int = 256) -> float:
    """Compile every bucket's step and the admission prefill of every prompt bucket up to ``longest_prompt``
    tokens, so that serving compiles nothing; returns seconds."""
    t0 = time.perf_counter()
    longest = min(longest_prompt, self.max_len - 1 - self.headroom())
    n = 1
    while True:                                          # one request per prompt bucket up to the longest
      r = Request([1] * n, 1, rid="warmup")
      self.submit(r)
      while not r.done:
        self.step()
      if prompt_bucket(n) >= longest:
        break
      n = min(prompt_bucket(n) + 1, longest)
    for k, eng in self.engines.items():   # a step of each bucket on an all-finished batch: compiles, no change
      self.state = self.jits.step(eng, self.m.exec_params, self.draft_params, self.state,
                                  self._put(np.zeros(self.slots, np.int32)))
    jax.block_until_ready(self.state.seq_BxS)
    if self.adapter is not None:            # the training step, a row's read-back and the weight swap
      self.adapter.warmup()
      jax.block_until_ready(recorded_row(self.state.record, jnp.int32(0)))
      self.draft_params = self.adapter.draft_params()
    self.history.clear()
    return time.perf_counter() - t0

  # ------------------------------------------------------------------ requests
  def headroom(self) -> int:
    return self.n_top + 2

  def check_request(self, r: Request) -> None:
    if not self.per_request and r.sampling is not None and r.sampling != self.sp:
      raise AdmissionError(f"this batcher decodes with {self.sp} for every request; build it with "
                           "per_request=True to serve each request's own settings")
    if r.max_new_tokens < 1:
      raise AdmissionError(f"max_tokens must be >= 1, got {r.max_new_tokens}")
    if not r.prompt_ids:
      raise AdmissionError("empty prompt")
    if r.pin is not None and r.pin not in self.bucket_info:
      raise AdmissionError(f"speculation {r.pin!r} is not compiled here: it offers {bk.offered(self.bucket_info)}")
    need = len(r.prompt_ids) + r.max_new_tokens + self.headroom()
    if need > self.max_len:
      raise AdmissionError(
          f"prompt of {len(r.prompt_ids)} tokens + max_tokens {r.max_new_tokens} + {self.headroom()} "
          f"speculative slots does not fit the {self.max_len}-slot KV buffers: shorten the prompt or lower "
          "max_tokens (or restart with a larger --max-len)")

  def submit(self, r: Request) -> None:
    self.check_request(r)
    if len(self.queue) >= self.max_queue:
      raise QueueFull(f"the queue holds {len(self.queue)} requests (limit {self.max_queue}): retry later")
    self.queue.append(r)

  def cancel(self, r: Request) -> None:
    """Stop a request (a client that went away): its slot is freed at the next step."""
    r.cancelled = True

  @property
  def num_running(self) -> int:
    return sum(r is not None for r in self.running)

  def _admit_waiting(self, now: float) -> None:
    for slot in range(self.slots):
      if not self.queue:
        return
      if self.running[slot] is not None:
        continue
      r = self.queue.popleft()
      if r.cancelled:
        self._finish(r, now, "cancelled")
        continue
      arr, lens = pad_batch([r.prompt_ids], 1,          # padded to a prompt bucket: few prefill shapes
                            pad_to=min(prompt_bucket(len(r.prompt_ids)), self.max_len))
      self.key, sub = jax.random.split(self.key)
      rows = None
      if self.per_request:
        if r.seed is None:
          r.seed = int(self._seeds.integers(0, 2 ** 31))
        rows = self._rows([r.sampling or self.sp], [r.seed])
      self.state = self.jits.admit(self.engines[self.k_top], self.m.prefill_params, self.draft_params,
                                   self.state, jnp.int32(slot),
                                   *jax.device_put((arr, lens, np.asarray([r.max_new_tokens], np.int32))), sub, rows)
      r.slot, r.admitted = slot, now
      self.running[slot] = r
      self._prompt_len[slot] = len(r.prompt_ids)
      self._num_new[slot] = self._waits[slot] = 0
      self.tracker.reset(slot)
      self.tree_tracker.reset(slot)

  def _finish(self, r: Request, now: float, reason: str) -> None:
    if r.done:
      return
    r.finished, r.finish_reason = now, reason
    if r.slot is not None and self.running[r.slot] is r:
      self.running[r.slot] = None
    if self.adapter is not None and r.tokens and r.rid != "warmup" and reason in ("stop", "length"):
      # the slot still holds this request's recorded features (nothing is admitted before the next step)
      t0 = time.perf_counter()
      n = len(r.prompt_ids) + len(r.tokens)
      row = np.asarray(jax.device_get(recorded_row(self.state.record, jnp.int32(r.slot))))
      self.adapter.observe(list(r.prompt_ids) + list(r.tokens), row[:n], len(r.prompt_ids))
      self.absorb_s += time.perf_counter() - t0
    if self.learns and r.tokens and r.rid != "warmup":   # a suffix index learns it between steps
      t0 = time.perf_counter()
      self.draft_params = drafter_registry.absorb(self.engines[self.k_top].drafter, self.draft_params,
                                                  [list(r.prompt_ids) + list(r.tokens)])
      self.absorb_s += time.perf_counter() - t0
    if r.on_finish is not None:
      r.on_finish(r)

  # ------------------------------------------------------------------ one iteration
  def step(self) -> int:
    """Admit what waits, run one iteration, hand out its tokens; returns tokens committed (0 when idle)."""
    now = self.clock()
    for slot, r in enumerate(self.running):
      if r is not None and r.cancelled:
        self.state = self.jits.finish(self.state, jnp.int32(slot))
        self._finish(r, now, "cancelled")
    self._admit_waiting(now)
    # The first token of each new request comes from its prefill.
    committed, _ = self._read_back(self.clock(), offered=None)
    live = np.array([r is not None and not r.done for r in self.running])
    if not live.any():
      return committed
    obs = pol.Observation(live, self._prompt_len + self._num_new, self.tracker.alpha,
                          {k: self.tree_tracker.alphas(k, self.tracker.alpha) for k in self.tree_tracker.trees})
    dec, self._waits = pol.apply_pins(self.policy.choose(obs), [getattr(r, "pin", None) for r in self.running],
                                      live, self._waits, self.bucket_info, self.k_top)
    bucket = self.bucket_info[dec.k]
    t0 = time.perf_counter()
    self.state = self.jits.step(self.engines[bucket.key], self.m.exec_params, self.draft_params, self.state,
                                self._put(dec.k_B.astype(np.int32)))
    got, accepted_B = self._read_back(self.clock(), offered=dec.k_B, live=live, tree=bucket.key if bucket.is_tree
                                      else None)
    self.history.append(StepRecord(self.clock(), bucket.nodes, int(live.sum()),
                                   int(np.sum(np.where(live, dec.k_B + 1, 0))), got, time.perf_counter() - t0,
                                   int(np.sum(np.where(live, accepted_B, 0))), bucket.label))
    if self.adapter is not None and self.adapter.busy_tick():
      self.adapt()
    return committed + got

  # ------------------------------------------------------------------ online adaptation
  def adapt(self) -> bool:
    """One adaptation step of the drafter's head on the replay buffer, the new weights swapped in (same
    shapes and dtypes: the compiled steps run them as they are); False when there is nothing to learn yet."""
    if self.adapter is None or not self.adapter.ready:
      return False
    t0 = time.perf_counter()
    metrics = self.adapter.step()
    self.draft_params = self.adapter.draft_params()
    self.adapt_log.append({"t": self.clock(), "step": self.adapter.steps, "seconds": time.perf_counter() - t0,
                           **metrics})
    return True

  def _read_back(self, now: float, offered, live=None, tree=None) -> tuple[int, np.ndarray]:
    """Hand the committed tokens to their requests; returns (tokens handed out, accepted drafts per slot in
    this step).  One transfer per step; the per-request mode's logprobs come with the tokens.  ``tree``: the
    step drafted that tree bucket (its acceptance is tracked per depth, apart from the chains')."""
    seq, num_new, done, accepted, logprob = jax.device_get((
        self.state.seq_BxS, self.state.num_new_B, self.state.done_B, self.state.stats.accepted_B,
        self.state.rows.logprob_BxS if self.per_request else None))
    accepted_B = accepted - self._accepted            # this step's accepted drafts per slot
    if offered is not None and tree is not None:
      self.tree_tracker.update(tree, live, offered, accepted_B, self.tracker.alpha)
    elif offered is not None:
      self.tracker.update(live, offered, accepted_B)
      for slot, r in enumerate(self.running):      # each request's own drafts offered and accepted
        if r is not None and live[slot]:
          r.drafts_offered += int(offered[slot])
          r.drafts_accepted += int(accepted_B[slot])
    self._accepted = accepted.astype(np.int64)
    total = 0
    for slot, r in enumerate(self.running):
      if r is None:
        continue
      n_old, n_new = int(self._num_new[slot]), int(num_new[slot])
      if n_new > n_old:
        p = int(self._prompt_len[slot])
        toks = seq[slot, p + n_old:p + n_new].tolist()
        r.tokens += toks
        if logprob is not None:
          r.logprobs += logprob[slot, p + n_old:p + n_new].tolist()
        r.token_times += [now] * len(toks)
        if r.first_token is None:
          r.first_token = now
        self._num_new[slot] = n_new
        total += len(toks)
        if r.on_tokens is not None:
          r.on_tokens(r, toks)
      if done[slot]:
        eos = bool(r.tokens) and r.tokens[-1] in self.eos_ids
        self._finish(r, now, "stop" if eos else "length")
    return total, accepted_B

  # ------------------------------------------------------------------ a whole trace
  def run(self, requests: Sequence[Request], log=None, time_limit: float | None = None) -> dict:
    """Replay requests at their arrival times (seconds after the start) in real time; returns the report."""
    pending = collections.deque(sorted(requests, key=lambda r: r.arrival))
    start = self.clock()
    refused = []
    last_log = start
    while pending or self.queue or self.num_running:
      now = self.clock() - start
      while pending and pending[0].arrival <= now:
        r = pending.popleft()
        r.arrival += start
        try:
          self.submit(r)
        except SpecjaxError as e:
          refused.append((r, str(e)))
      if not self.queue and not self.num_running:
        if pending and not self.adapt():          # idle: an adaptation step, else wait for the next arrival
          time.sleep(max(0.0, min(pending[0].arrival - (self.clock() - start), 0.05)))
        continue
      self.step()
      if log and self.clock() - last_log > 10:
        last_log = self.clock()
        done = sum(r.done for r in requests)
        log(f"[serve] {now:6.1f}s: {done}/{len(requests)} done, {self.num_running} running, "
            f"{len(self.queue)} queued, k={self.history[-1].k if self.history else 0}")
      if time_limit and self.clock() - start > time_limit:
        raise SpecjaxError(f"the trace did not finish in {time_limit:.0f}s")
    out = report(requests, self.history, start, self.clock(), refused)
    if self.learns:
      out["index"] = self.index_stats()
    if self.adapter is not None:
      out["adapt"] = {**self.adapter.stats(), "record_bytes": int(self.state.record.feats_BxSxF.nbytes),
                      "log": [{**a, "t": a["t"] - start} for a in self.adapt_log]}
    return out

  def index_stats(self) -> dict:
    """A learning drafter's index: slots in use of its capacity, and the host seconds spent indexing."""
    return {**self.engines[self.k_top].drafter.index_stats(self.draft_params), "absorb_s": self.absorb_s}
