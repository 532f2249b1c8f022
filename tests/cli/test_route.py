"""The route from `specjax generate --drafter ngram` to the jitted step, as docs/ARCHITECTURE.md lists it: at
most 8 files, each named function exists where the map says, and the CLI's part of it enters only the API."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILES = 8
CLI_ROUTE = {"specjax/cli/decoding.py": ("cmd_generate",),
             "specjax/cli/common.py": ("decode_spec", "load_model", "load_draft")}


def route(text: str) -> list[tuple[str, list[str]]]:
  """[(file, [function, ...])] from the numbered list under the route's heading."""
  section = text.split("## From `specjax generate --drafter ngram`", 1)[1].split("\n## ", 1)[0]
  out = []
  for line in section.splitlines():
    m = re.match(r"\d+\. `([^`]+\.py)` (.*)", line)
    if m:
      out.append((m.group(1), re.findall(r"`([\w.]+)`", m.group(2).split(":")[0])))
  return out


def _route():
  return route((ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8"))


def test_the_route_is_at_most_eight_files_and_each_named_function_exists():
  steps = _route()
  assert 0 < len(steps) <= MAX_FILES, steps
  for path, names in steps:
    assert (ROOT / path).is_file(), path
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    assert names, f"{path}: the map names no function"
    for name in names:
      obj = module
      for part in name.split("."):
        assert hasattr(obj, part), f"docs/ARCHITECTURE.md names {path} `{name}`, which does not exist"
        obj = getattr(obj, part)
      assert callable(obj), f"{path} `{name}` is not a function or class"


def test_the_route_starts_at_the_command_and_ends_at_the_step():
  steps = _route()
  assert steps[0] == ("specjax/cli/decoding.py", ["cmd_generate"])
  assert steps[-1][0] == "specjax/speculative/engine.py" and "spec_step" in steps[-1][1]


def _specjax_imports(fn: ast.FunctionDef) -> set[str]:
  out = set()
  for node in ast.walk(fn):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specjax"):
      out |= {node.module if node.module != "specjax" else f"specjax.{a.name}" for a in node.names}
    elif isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name.startswith("specjax")}
  return out


def cli_route_imports(root: Path = ROOT) -> dict[str, set[str]]:
  """What each CLI function on the route imports of specjax, besides the API and the CLI itself."""
  out = {}
  for path, names in CLI_ROUTE.items():
    tree = ast.parse((root / path).read_text(encoding="utf-8"))
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names):
      other = {m for m in _specjax_imports(fn) if m not in ("specjax.api", "specjax.cli")
               and not m.startswith("specjax.cli.")}
      if other:
        out[f"{path}:{fn.name}"] = other
  return out


def test_the_cli_enters_only_the_api():
  assert not cli_route_imports(), cli_route_imports()


def test_the_check_sees_a_cli_function_reaching_past_the_api(tmp_path):
  for path in CLI_ROUTE:
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text((ROOT / path).read_text(encoding="utf-8"))
  bad = tmp_path / "specjax/cli/common.py"
  bad.write_text(bad.read_text(encoding="utf-8").replace(
      "def load_model(args):\n", "def load_model(args):\n  from specjax.runtime import compile_cache\n", 1))
  assert cli_route_imports(tmp_path) == {"specjax/cli/common.py:load_model": {"specjax.runtime"}}
