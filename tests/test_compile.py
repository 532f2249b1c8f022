"""No recompilation: decoding more tokens, other prompts or a second call compiles nothing new."""
import jax
import jax.numpy as jnp
import numpy as np

from specjax import config, kv_cache, model, sampling, speculative
from tests.compile_counter import count_compiles


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
