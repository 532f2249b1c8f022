"""The forward against an independent numpy reference, and the cache against a full forward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import attention, config, kv_cache, decoder as model, sampling
from specjax import speculative
from tests.helpers.reference import random_hf_weights, reference_logits

TINY = config.TINY
VARIANTS = {
    "tiny": TINY,
    "untied_qkv_bias": TINY.replace(name="tiny-qwen", tie_embeddings=False, qkv_bias=True),
    "llama3_rope": TINY.replace(name="tiny-l3", rope_scaling=config.RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)),
    "mha": TINY.replace(name="tiny-mha", num_kv_heads=4),
}


def _params(cfg, seed=0):
  w = random_hf_weights(cfg, seed)
  return w, model.params_from_hf_layout(cfg, w["embed"], w["final_norm"], w["layers"], w["lm_head"])


def _full_logits(params, cfg, tokens_BxT, max_len=64):
  B, T = tokens_BxT.shape
  cache = kv_cache.init_cache(cfg, B, max_len)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  return model.forward(params, cfg, tokens_BxT, pos, cache).logits


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout", ["stacked", "unstacked"])
def test_forward_matches_numpy_reference(variant, layout):
  cfg = VARIANTS[variant]
  w, params = _params(cfg)
  if layout == "unstacked":
    params = model.unstack_layers(params)
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=20)
  got = np.asarray(_full_logits(params, cfg, jnp.asarray(tokens)[None]))[0]
  want = reference_logits(cfg, w, tokens)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_jit_and_no_jit_agree():
  cfg = TINY
  _, params = _params(cfg)
  tokens = jnp.arange(10)[None] % cfg.vocab_size
  eager = _full_logits(params, cfg, tokens)
  jitted = jax.jit(lambda p, t: _full_logits(p, cfg, t))(params, tokens)
  np.testing.assert_allclose(eager, jitted, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [None, 32])
def test_incremental_decoding_matches_full_forward(window):
  """Feeding a sequence one chunk at a time through the cache gives the full forward's logits."""
  cfg = TINY
  _, params = _params(cfg)
  T = 24
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, size=(2, T)))
  full = _full_logits(params, cfg, tokens)
  cache = kv_cache.init_cache(cfg, 2, 64)
  chunks, pieces, start = [5, 1, 3, 1, 1, 8, 5], [], 0
  for n in chunks:
    pos = jnp.broadcast_to(jnp.arange(start, start + n), (2, n))
    out = model.forward(params, cfg, tokens[:, start:start + n], pos, cache, kv_window=window)
    cache = out.cache
    pieces.append(out.logits)
    start += n
  inc = jnp.concatenate(pieces, axis=1)
  np.testing.assert_allclose(inc, full, rtol=1e-5, atol=1e-5 * float(jnp.abs(full).max()))
  assert cache.lengths.tolist() == [T, T]


def test_cache_never_attends_past_length():
  """Garbage written past a sequence's length must not change its logits."""
  cfg = TINY
  _, params = _params(cfg)
  tokens = jnp.arange(6)[None] + 3
  cache = kv_cache.init_cache(cfg, 1, 32)
  out = model.forward(params, cfg, tokens, jnp.arange(6)[None], cache)
  poisoned = out.cache.replace(k=out.cache.k.at[:, :, 6:].set(1e4), v=out.cache.v.at[:, :, 6:].set(-1e4))
  step = lambda c: model.forward(params, cfg, jnp.array([[7]]), jnp.array([[6]]), c).logits
  np.testing.assert_allclose(step(out.cache), step(poisoned), rtol=1e-6)


def test_extra_mask_restricts_new_tokens():
  """With an extra mask that hides the previous new token, logits equal a forward without that token."""
  cfg = TINY
  _, params = _params(cfg)
  cache = kv_cache.init_cache(cfg, 1, 32)
  prefix = model.forward(params, cfg, jnp.array([[3, 4, 5]]), jnp.arange(3)[None], cache).cache
  # Two sibling nodes at the same depth: each sees the prefix and itself only.
  mask = jnp.array([[[True, False], [False, True]]])
  out = model.forward(params, cfg, jnp.array([[9, 11]]), jnp.array([[3, 3]]), prefix, mask)
  alone = model.forward(params, cfg, jnp.array([[11]]), jnp.array([[3]]), prefix).logits
  np.testing.assert_allclose(out.logits[:, 1], alone[:, 0], rtol=1e-5, atol=1e-5)


def test_bf16_params_close_to_fp32():
  cfg = TINY
  _, params = _params(cfg)
  tokens = jnp.arange(12)[None] + 5
  f32 = _full_logits(params, cfg, tokens)
  bf16 = _full_logits(model.cast_params(params, jnp.bfloat16), cfg, tokens)
  assert bf16.dtype == jnp.float32
  np.testing.assert_allclose(bf16, f32, rtol=5e-2, atol=5e-2 * float(jnp.abs(f32).max()))


def _greedy_reference(params, cfg, prompt, n):
  """Teacher-forced argmax rollout with a full forward per token (no cache reuse)."""
  seq = list(prompt)
  pad = len(prompt) + n
  full = jax.jit(lambda p, t: _full_logits(p, cfg, t, max_len=pad))
  for _ in range(n):
    # Causal: right padding does not change the logits at the last real position.
    padded = jnp.asarray(seq + [0] * (pad - len(seq)))[None]
    seq.append(int(jnp.argmax(full(params, padded)[0, len(seq) - 1])))
  return seq[len(prompt):]


def _run_generate(params, cfg, prompts, max_new, max_len=64, sp=sampling.SamplingParams(), eos=(),
                  buckets=None, seed=0):
  B = len(prompts)
  P = max(len(p) for p in prompts)
  arr = np.zeros((B, P), np.int32)
  for i, p in enumerate(prompts):
    arr[i, :len(p)] = p
  cache = kv_cache.init_cache(cfg, B, max_len)
  res = _ar(params, cfg, cache, arr, [len(p) for p in prompts],
            jnp.asarray(max_new, jnp.int32) * jnp.ones((B,), jnp.int32), seed, sp, eos, buckets)
  seq = np.asarray(res.seq_BxS)
  return [seq[i, len(p):len(p) + int(res.num_new_B[i])].tolist() for i, p in enumerate(prompts)], res


def _ar(params, cfg, cache, prompt_BxP, lens_B, max_new_B, seed=0, sp=sampling.SamplingParams(), eos=(),
        buckets=None):
  B = len(lens_B)
  engine = speculative.engine.autoregressive(cfg, sp, eos, buckets)
  return speculative.generate(params, (), cache, jnp.asarray(prompt_BxP), jnp.asarray(lens_B),
                              jnp.asarray(max_new_B), jnp.zeros((B,), jnp.int32), jax.random.PRNGKey(seed),
                              engine=engine)


@pytest.mark.parametrize("buckets", [None, (16, 32, 64)])
def test_greedy_generate_matches_teacher_forced_rollout(buckets):
  cfg = TINY
  _, params = _params(cfg)
  prompt = [5, 9, 13, 2 + 20]
  out, res = _run_generate(params, cfg, [prompt], 12, buckets=buckets)
  assert out[0] == _greedy_reference(params, cfg, prompt, 12)
  assert int(res.stats.iterations) == 11   # the first token comes from the prefill


def test_batch_of_different_lengths_equals_each_alone():
  cfg = TINY
  _, params = _params(cfg)
  prompts = [[4, 5, 6], [7, 8, 9, 10, 11, 12, 13], [20]]
  batched, _ = _run_generate(params, cfg, prompts, 10, buckets=(16, 32, 64))
  for p, got in zip(prompts, batched):
    alone, _ = _run_generate(params, cfg, [p], 10)
    assert got == alone[0]


def test_stops_at_eos_and_per_sequence_max_new():
  cfg = TINY
  _, params = _params(cfg)
  prompt = [5, 9, 13]
  free, _ = _run_generate(params, cfg, [prompt], 12)
  eos = free[0][4]
  first = free[0].index(eos)
  stopped, res = _run_generate(params, cfg, [prompt], 12, eos=(eos,))
  assert stopped[0] == free[0][:first + 1]
  B = 2
  cache = kv_cache.init_cache(cfg, B, 64)
  res = _ar(params, cfg, cache, [prompt, prompt], [3, 3], [3, 7])
  assert res.num_new_B.tolist() == [3, 7]
  assert np.asarray(res.seq_BxS)[0, 3:6].tolist() == free[0][:3]
  assert np.asarray(res.seq_BxS)[1, 3:10].tolist() == free[0][:7]


def test_sampling_is_reproducible_and_seed_dependent():
  cfg = TINY
  _, params = _params(cfg)
  sp = sampling.SamplingParams(temperature=3.0, top_k=40, top_p=0.95)
  a, _ = _run_generate(params, cfg, [[1, 2, 3]], 16, sp=sp, seed=3)
  b, _ = _run_generate(params, cfg, [[1, 2, 3]], 16, sp=sp, seed=3)
  c, _ = _run_generate(params, cfg, [[1, 2, 3]], 16, sp=sp, seed=4)
  assert a == b and a != c


@pytest.mark.parametrize("T,H,K", [(1, 9, 3), (5, 4, 2), (3, 4, 4)])
def test_attend_equals_reference(T, H, K):
  rng = np.random.default_rng(T)
  B, S, E = 2, 40, 8
  q = jnp.asarray(rng.standard_normal((B, T, H, E)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((B, S, K, E)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, S, K, E)), jnp.float32)
  mask = attention.attention_mask(jnp.array([7, 30]), T, S, None)
  np.testing.assert_allclose(attention.attend(q, k, v, mask), attention.attend_reference(q, k, v, mask),
                             rtol=1e-5, atol=1e-5)


def test_kv_buckets_do_not_change_results():
  cfg = TINY
  _, params = _params(cfg)
  cache = kv_cache.init_cache(cfg, 2, 64)
  toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 20)))
  pos = jnp.broadcast_to(jnp.arange(20), (2, 20))
  full = model.forward(params, cfg, toks, pos, cache)
  for buckets in [(8, 16, 32), (32,), (16, 64)]:
    b = model.forward(params, cfg, toks, pos, cache, kv_buckets=buckets)
    np.testing.assert_allclose(b.logits, full.logits, rtol=1e-5, atol=1e-5)
    step = model.forward(params, cfg, toks[:, :1], jnp.full((2, 1), 20), b.cache, kv_buckets=buckets)
    ref = model.forward(params, cfg, toks[:, :1], jnp.full((2, 1), 20), full.cache)
    np.testing.assert_allclose(step.logits, ref.logits, rtol=1e-5, atol=1e-5)


def test_xla_attention_gives_a_query_row_the_same_bits_whatever_the_row_count():
  """A plain step attends with 1 query row, a verification with k + 1: the XLA attention pads the queries to
  ATTEND_MIN_ROWS rows so both take the same product (unpadded, XLA:CPU summed row 0 differently for 1 and 5
  queries: 1,299 of 5 × 576 fp32 outputs on a Zen 4)."""
  r = np.random.default_rng(0)
  B, H, K, E, S = 1, 9, 3, 64, 256
  k = jnp.asarray(r.standard_normal((B, S, K, E)), jnp.float32)
  v = jnp.asarray(r.standard_normal((B, S, K, E)), jnp.float32)
  q = jnp.asarray(r.standard_normal((B, 8, H, E)), jnp.float32)
  mask = jnp.arange(S)[None, None, :] < S - 30 + jnp.arange(8)[None, :, None]
  f = jax.jit(attention.attend)
  one = np.asarray(f(q[:, :1], k, v, mask[:, :1]))[:, 0]
  for T in (2, 5, 8):
    np.testing.assert_array_equal(np.asarray(f(q[:, :T], k, v, mask[:, :T]))[:, 0], one, err_msg=f"T={T}")
  np.testing.assert_allclose(f(q, k, v, mask), attention.attend_reference(q, k, v, mask), atol=2e-6)


def test_rms_norm_gives_a_row_the_same_bits_whatever_the_row_count():
  """RMSNorm sums a row in a fixed pairwise order of elementwise adds (decoder.row_sum): with ``jnp.mean``
  XLA:CPU summed a row in another order once 8 or more rows were reduced at once (5e-7 apart on a Zen 3),
  which integer activations turn into different tokens between plain decoding and a verification."""
  r = np.random.default_rng(0)
  for D in (576, 1536, 100):
    x = jnp.asarray(r.standard_normal((16, 9, D)) * 3, jnp.float32)
    w = jnp.asarray(r.standard_normal(D), jnp.float32)
    f = jax.jit(lambda x, w: model.rms_norm(x, w, 1e-5))
    one = np.asarray(f(x[:1, :1], w))[0, 0]
    for B, T in [(1, 5), (2, 5), (4, 5), (16, 9)]:
      np.testing.assert_array_equal(np.asarray(f(x[:B, :T], w))[0, 0], one, err_msg=f"D={D} B={B} T={T}")
    want = np.asarray(x, np.float64) / np.sqrt(np.mean(np.asarray(x, np.float64) ** 2, -1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(f(x, w), want * np.asarray(w), rtol=2e-6, atol=2e-6)
