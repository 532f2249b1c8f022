"""No recompilation: decoding more tokens, other prompts or a second call compiles nothing new."""
import jax
import jax.numpy as jnp
import numpy as np

from specjax import speculative
from specjax.models import config, kv_cache, decoder as model, sampling
from tests.helpers.compile_counter import count_compiles


def _generate(params, cfg, prompt_BxP, lens, max_new, seed=0, sp=sampling.SamplingParams()):
  cache = kv_cache.init_cache(cfg, prompt_BxP.shape[0], 64)
  B = prompt_BxP.shape[0]
  res = speculative.generate(params, (), cache, jnp.asarray(prompt_BxP), jnp.asarray(lens),
                             jnp.asarray(max_new, jnp.int32), jnp.zeros((B,), jnp.int32),
                             jax.random.PRNGKey(seed),
                             engine=speculative.engine.autoregressive(cfg, sp, (), (16, 32, 64)))
  return jax.block_until_ready(res)


def test_counter_sees_compiles():
  with count_compiles() as n:
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0)).block_until_ready()
  assert n() >= 1


def test_decoding_more_tokens_compiles_nothing_new():
  cfg = config.TINY
  params = model.unstack_layers(model.init_params(cfg, jax.random.PRNGKey(0)))
  prompt = np.array([[5, 6, 7, 8, 0, 0, 0, 0], [9, 10, 11, 12, 13, 14, 0, 0]], np.int32)
  _generate(params, cfg, prompt, [4, 6], [3, 3])         # warm-up: compiles once
  with count_compiles() as n:
    a = _generate(params, cfg, prompt, [4, 6], [3, 3])    # the same call again
    b = _generate(params, cfg, prompt, [4, 6], [40, 17])  # more tokens (crosses KV window buckets)
    other = np.random.default_rng(0).integers(3, cfg.vocab_size, size=prompt.shape).astype(np.int32)
    c = _generate(params, cfg, other, [8, 2], [25, 9], seed=5)  # other prompts, lengths and seed
  assert n() == 0, f"{n()} compilations after warm-up"
  assert b.num_new_B.tolist() == [40, 17] and a.num_new_B.tolist() == [3, 3]
  assert int(c.stats.iterations) > 0


def test_spec_step_compiles_once_for_any_k_active_and_content():
  """The step-at-a-time API: varying k_active, acceptance and prompt content compiles nothing new (k_active
  also sets how many verification rows are live: data, not shape)."""
  cfg = config.TINY
  params = model.unstack_layers(model.init_params(cfg, jax.random.PRNGKey(0)))
  drafter = speculative.ModelDrafter(cfg.replace(num_layers=1), buckets=(16, 32, 64))   # layer-skip draft
  engine = speculative.Engine(cfg=cfg, drafter=drafter, k_max=4, sp=sampling.SamplingParams(),
                              buckets=(16, 32, 64))
  draft = speculative.layer_subset(params, (0,))

  def run(prompt, k_actives):
    B = prompt.shape[0]
    state = speculative.init_jit(engine, params, draft, kv_cache.init_cache(cfg, B, 64), jnp.asarray(prompt),
                                 jnp.full((B,), prompt.shape[1]), jnp.full((B,), 40), jax.random.PRNGKey(0))
    for k in k_actives:
      state = speculative.step_jit(engine, params, draft, state, jnp.asarray(k, jnp.int32))
    return jax.block_until_ready(state)

  run(np.array([[3, 4, 5, 6]] * 2, np.int32), [[4, 4]])            # warm-up
  with count_compiles() as n:
    a = run(np.array([[3, 4, 5, 6]] * 2, np.int32), [[4, 4], [1, 3], [0, 2], [2, 2]])
    b = run(np.array([[9, 9, 1, 2], [7, 1, 7, 1]], np.int32), [[3, 0], [4, 4], [1, 1]])
  assert n() == 0, f"{n()} compilations after warm-up"
  assert int(a.stats.iterations) == 4 and int(b.stats.iterations) == 3
  assert np.asarray(a.stats.pos_reached_D)[3] <= 2   # k_active masked the later slots
  used = np.asarray(a.stats.verify_rows_N1) + np.asarray(b.stats.verify_rows_N1)
  assert used.sum() == 7 and np.count_nonzero(used) >= 3, used


def test_the_product_path_is_one_prefill_and_one_device_loop_without_transfers():
  """What ``api.generate`` and ``bench`` run (``runtime.compiled``): a model's executables for a batch are
  one prefill and one decode loop holding the whole while-loop, with no host callback in either; running them
  on device-resident inputs performs no host<->device transfer (transfer guard set to disallow)."""
  from specjax.runtime.compiled import device_inputs
  from specjax.runtime.loaded import Model
  cfg = config.TINY
  m = Model(cfg=cfg, params=model.init_params(cfg, jax.random.PRNGKey(0)), tokenizer=None, source="tiny")
  engine = speculative.Engine(cfg=cfg, drafter=speculative.NgramDrafter(2, match_caps=(1,)), k_max=3,
                              sp=sampling.SamplingParams(temperature=1.0), buckets=(16, 32, 64))
  B, P, S = 2, 4, 64
  init_fn, loop_fn, _ = m.executables.for_batch(m, engine, B, P, S, (), log=lambda _: None)
  assert len(m.executables) == 2 and m.executables.count("loop") == 1
  for fn in (init_fn, loop_fn):
    assert "callback" not in fn.as_text().lower()
  assert "while" in loop_fn.as_text()
  host = (np.array([[3, 4, 3, 4], [5, 6, 5, 6]], np.int32), np.array([4, 4], np.int32),
          np.array([30, 30], np.int32), np.array([3, 3], np.int32))
  cache, (tokens, lens, max_new, k_active) = device_inputs(m, B, S, *host)
  key = jax.device_put(jax.random.PRNGKey(0))
  jax.block_until_ready((cache, tokens, lens, max_new, k_active, key, m.prefill_params, m.exec_params))
  with jax.transfer_guard("disallow"):
    state = init_fn(m.prefill_params, (), cache, tokens, lens, max_new, key)
    out = loop_fn(m.exec_params, (), state, k_active)
    jax.block_until_ready(out)
  assert int(out.stats.iterations) > 0
  assert np.all(np.asarray(out.num_new_B) == 30)
