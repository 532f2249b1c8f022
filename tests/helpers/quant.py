"""Quantized weights for the kernel tests (test_quant.py, test_qdot.py): a weight whose rows and groups differ
in magnitude and offset, the relative error, and the tiny model's logits and greedy decoding on each weight type.
(The ``restore_isa`` fixture: tests/kernels/conftest.py.)"""
import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import config, kv_cache, decoder as model, quant, sampling
from specjax.speculative import Engine, generate

def _weight(kind, N, D, group=32, seed=0):
  r = np.random.default_rng(seed)
  # rows and groups of very different magnitudes: a scale taken from the wrong row or group shows
  w = r.standard_normal((N, D)) * np.exp(r.uniform(-2, 2, (N, 1))) * np.exp(r.uniform(-1, 1, (1, D)))
  w = w + r.uniform(-1, 1, (N, 1)) * np.abs(w).mean()     # groups not centred on 0: offsets matter
  return quant.quantize(kind, w.astype(np.float32), group)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


CFG = config.TINY.replace(num_layers=2)
DRAFT_CFG = config.TINY.replace(name="tiny-draft", num_layers=1)
BUCKETS = (16, 32, 64)


def _logits(params, backends=None):
  cfg = CFG if backends is None else CFG.replace(backends=backends)
  toks = jnp.asarray(np.random.default_rng(6).integers(0, CFG.vocab_size, (2, 5)), jnp.int32)
  cache = kv_cache.init_cache(CFG, 2, 16)
  return model.forward(params, cfg, toks, jnp.broadcast_to(jnp.arange(5), (2, 5)), cache).logits


def _run(target, drafter, dparams, K, prompts, lens, max_new, sp=sampling.SamplingParams(), cfg=None):
  B = prompts.shape[0]
  eng = Engine(cfg=cfg or CFG, drafter=drafter, k_max=K, sp=sp, buckets=BUCKETS)
  cache = kv_cache.init_cache(CFG, B, 64)
  st = generate(target, dparams, cache, jnp.asarray(prompts), jnp.asarray(lens), jnp.asarray(max_new),
                jnp.full((B,), K, jnp.int32), jax.random.PRNGKey(0), engine=eng)
  seq = np.asarray(st.seq_BxS)
  return [seq[i, lens[i]:lens[i] + int(st.num_new_B[i])].tolist() for i in range(B)]
