"""The CPU kernel paths chosen by measurement (specjax/measure/kernel_paths.py, at load) and stored per machine
(specjax/kernels/choices.py): measured once and remembered, read back by later processes, forced by
SPECJAX_NATIVE, followed by the model, and never measured while a forward is traced."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels import choices, cpu_matmul, native
from specjax.measure import kernel_paths

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernels not built here")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  monkeypatch.setenv("SPECJAX_NATIVE", "auto")
  choices.forget()
  yield tmp_path
  choices.forget()


def _uses_native(N, D, M=1):
  f = lambda x, w: cpu_matmul.matmul_t(x, w)  # noqa: E731
  text = jax.jit(f).lower(jnp.ones((M, D)), jnp.ones((N, D))).as_text()
  return "specjax_matmul_t" in text


def test_tracing_measures_nothing(fresh, capfd):
  assert _uses_native(64, 32) == (native.isa() != "portable")   # nothing stored: the default path
  assert "measuring" not in capfd.readouterr().err
  assert not choices.choices_path().exists()


def test_load_measures_once_and_later_processes_read_it(fresh, capfd):
  kernel_paths.ensure()                                      # what api.load runs: every class at once
  err = capfd.readouterr().err
  assert "measuring the CPU kernel paths" in err
  data = json.loads(choices.choices_path().read_text())
  small = data["classes"]["small"]
  assert small["path"] in ("native", "xla") and data["threads"] >= 1
  for m in ("M1", "M5"):
    assert small[m]["native_ms"] > 0 and small[m]["xla_ms"] > 0
  assert str(choices.choices_path()).startswith(str(fresh))
  assert set(data["classes"]) == {"small", "large"} and "attention" in data   # all at once, one line
  assert err.count("measuring the CPU kernel paths") == 1
  choices.forget()                                          # a new process: reads, measures nothing
  kernel_paths.ensure()
  assert _uses_native(64, 32) == (small["path"] == "native")
  assert "measuring" not in capfd.readouterr().err
  assert choices.summary()["paths"] == {"small": small["path"], "large": data["classes"]["large"]["path"],
                                         "attention": data["attention"]["path"]}


def _store(path_by_class):
  data = choices._read()
  data["threads"] = 2
  data["classes"] = {c: {"path": p} for c, p in path_by_class.items()}
  data["attention"] = {"path": "native"}
  choices.save(data)
  choices.forget()


def test_the_model_follows_the_stored_choice_per_size_class(fresh):
  _store({"small": "xla", "large": "native"})
  assert not _uses_native(64, 32) and not _uses_native(64, 32, M=5)   # one path at every row count
  assert _uses_native(8192, 1024)                                      # 32 MB: the large class
  x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 32)), jnp.float32)
  w = jnp.asarray(np.random.default_rng(1).standard_normal((64, 32)), jnp.float32)
  np.testing.assert_allclose(cpu_matmul.matmul_t(x, w), x @ w.T, rtol=1e-5, atol=1e-5)


def test_specjax_native_forces_the_path(fresh, monkeypatch):
  _store({"small": "xla", "large": "xla"})
  monkeypatch.setenv("SPECJAX_NATIVE", "1")
  assert _uses_native(64, 32)
  monkeypatch.setenv("SPECJAX_NATIVE", "0")
  assert not _uses_native(64, 32)


def test_an_unreadable_table_is_measured_again(fresh, monkeypatch, capfd):
  choices.choices_path().parent.mkdir(parents=True)
  choices.choices_path().write_text("{not json")
  monkeypatch.setattr(kernel_paths, "measure_class", lambda N, D: {"path": "xla", "shape": [N, D]})
  monkeypatch.setattr(kernel_paths, "measure_threads", lambda: {"threads": 1})
  monkeypatch.setattr(kernel_paths, "measure_attention", lambda: {"path": "xla"})
  kernel_paths.ensure()
  assert not _uses_native(64, 32)
  assert "unreadable" in capfd.readouterr().err
  assert json.loads(choices.choices_path().read_text())["classes"]["small"]["path"] == "xla"


def test_fewer_threads_give_the_same_bits():
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((5, 200)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((3000, 200)), jnp.float32)
  f = jax.jit(cpu_matmul.matmul_t_native)
  all_threads = np.asarray(f(x, w))
  try:
    choices.set_threads(1)
    one = np.asarray(f(x, w))
  finally:
    choices.set_threads(None)
  np.testing.assert_array_equal(one, all_threads)


def _attention_uses_native(T=1):
  from specjax.kernels import cpu_attention as ca
  L, B, S, K, G, E = 2, 1, 64, 2, 2, 16
  q = jnp.ones((B, T, K * G, E), jnp.float32)
  kv = jnp.ones((L, B, S, K, E), jnp.float32)
  lengths = jnp.asarray([10], jnp.int32)
  f = lambda q, k, v: ca.attend_cache(q, k, v, 1, lengths, ca.causal_mask(B, T))  # noqa: E731
  return ca.TARGET in jax.jit(f).lower(q, kv, kv).as_text()


def test_attention_is_measured_at_load_and_followed(fresh, capfd):
  kernel_paths.ensure()
  assert "attention:" in capfd.readouterr().err
  native_wins = _attention_uses_native()
  data = json.loads(choices.choices_path().read_text())
  att = data["attention"]
  assert att["path"] == ("native" if native_wins else "xla")
  for key in ("T1_ctx250", "T1_ctx1000", "T5_ctx250", "T5_ctx1000"):
    assert att[key]["native_ms"] > 0 and att[key]["xla_ms"] > 0
  assert choices.summary()["paths"]["attention"] == att["path"]
  data["attention"]["path"] = "xla"                          # as measured on a machine where XLA wins
  choices.save(data)
  choices.forget()
  assert not _attention_uses_native(1) and not _attention_uses_native(5)   # one path at every row count
  data["attention"]["path"] = "native"
  choices.save(data)
  choices.forget()
  assert _attention_uses_native(1) and _attention_uses_native(5)


def _forward_text(cfg):
  from specjax.models import config, decoder as model
  from specjax.models.kv_cache import init_cache
  params = model.init_params(config.TINY, jax.random.PRNGKey(0))
  tokens = jnp.ones((1, 1), jnp.int32)
  f = lambda p, t, c: model.forward(p, cfg, t, t, c).logits  # noqa: E731
  return jax.jit(f).lower(params, tokens, init_cache(cfg, 1, 32)).as_text()


def test_the_choice_is_made_once_at_load_and_rides_in_the_config(fresh, monkeypatch):
  """What ``runtime.loaded.load`` does (``dispatch.resolve`` into ``cfg.backends``): the forward then follows
  the config, not the environment or the table at trace time; a mesh of several devices keeps the native
  kernels out, whatever the table says."""
  import types
  from specjax.models import config
  from specjax.kernels import cpu_attention, dispatch
  _store({"small": "native", "large": "native"})
  loaded = config.TINY.replace(backends=dispatch.resolve())
  assert loaded.backends == dispatch.Backends(attention="native", native_matmul=frozenset({"small", "large"}),
                                              native_quant=True,     # (quantized weights: no measured table)
                                              activations=dispatch.activations_choice())
  text = _forward_text(loaded)
  assert cpu_matmul.TARGET in text and cpu_attention.TARGET in text
  monkeypatch.setenv("SPECJAX_NATIVE", "0")              # after the load: the loaded model keeps its choice
  text = _forward_text(loaded)
  assert cpu_matmul.TARGET in text and cpu_attention.TARGET in text
  assert dispatch.resolve() == dispatch.Backends(attention="xla")   # a load now would choose XLA ...
  text = _forward_text(config.TINY.replace(backends=dispatch.resolve()))
  assert cpu_matmul.TARGET not in text and cpu_attention.TARGET not in text   # ... and its forward follows
  monkeypatch.setenv("SPECJAX_NATIVE", "1")
  two = types.SimpleNamespace(shape={"data": 2, "model": 1})
  assert dispatch.resolve(two) == dispatch.Backends(attention="xla", mesh=two)
  assert config.TINY.replace(backends=loaded.backends).to_dict() == config.TINY.to_dict()   # not saved
