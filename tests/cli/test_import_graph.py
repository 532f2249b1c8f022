"""The import graph of specjax/ and experiments/, function-local imports included, against the layer table of
docs/ARCHITECTURE.md.

A circle hides which module is the lower one, so none is allowed.  Every package and loose module belongs to
exactly one row of the layer table, and imports only from its own row or the rows below.  The kernels, the
bottom, read stored choices and settings and never import the model, the measuring or anything above.  An
import of a submodule does not count as an import of its parent packages (Python runs them first anyway;
they are faces that hand names on).
"""
from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("specjax", "experiments")
MAX_LOOSE_MODULES = 10      # at specjax/'s root, besides __init__ and __main__

# What the bottom layer may import from specjax: the kernels (and the Pallas kernels) sit under the model.
BOTTOM = ("specjax.kernels",)
BOTTOM_MAY_IMPORT = {"specjax.settings", "specjax.cache_location", "specjax.machine",
                     "specjax.errors"}


def modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
  out = {}
  for pkg in packages:
    for path in sorted((root / pkg).rglob("*.py")):
      parts = path.relative_to(root).with_suffix("").parts
      out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def import_graph(root: Path, packages=PACKAGES) -> dict[str, dict[str, int]]:
  """{module: {imported module of the same packages: first line}} over every import statement."""
  mods = modules(root, packages)

  def resolve(name: str) -> str | None:
    while name and name not in mods:
      name = name.rpartition(".")[0]
    return name or None

  graph: dict[str, dict[str, int]] = {m: {} for m in mods}
  for mod, path in mods.items():
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          up = package.split(".")[:len(package.split(".")) - node.level + 1]
          base = ".".join(up + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
      else:
        continue
      for name in names:
        target = resolve(name)
        if target and target != mod and not mod.startswith(target + "."):
          graph[mod].setdefault(target, node.lineno)
  return graph


def circles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
  """The strongly connected components of more than one module (Tarjan, iteratively)."""
  index, low, on_stack, stack, out = {}, {}, set(), [], []
  counter = 0
  for start in graph:
    if start in index:
      continue
    work = [(start, iter(graph[start]))]
    index[start] = low[start] = counter
    counter += 1
    stack.append(start)
    on_stack.add(start)
    while work:
      v, children = work[-1]
      for w in children:
        if w not in index:
          index[w] = low[w] = counter
          counter += 1
          stack.append(w)
          on_stack.add(w)
          work.append((w, iter(graph[w])))
          break
        if w in on_stack:
          low[v] = min(low[v], index[w])
      else:
        work.pop()
        if work:
          low[work[-1][0]] = min(low[work[-1][0]], low[v])
        if low[v] == index[v]:
          comp = set()
          while True:
            w = stack.pop()
            on_stack.discard(w)
            comp.add(w)
            if w == v:
              break
          if len(comp) > 1:
            out.append(frozenset(comp))
  return out


def _describe(graph, circle) -> str:
  return "\n".join(f"  {a}:{line} -> {b}" for a in sorted(circle) for b, line in graph[a].items() if b in circle)


def test_there_is_no_import_circle():
  graph = import_graph(ROOT)
  found = circles(graph)
  assert not found, "import circles:\n" + "\n\n".join(_describe(graph, c) for c in found)


def test_the_kernels_import_nothing_above_them():
  graph = import_graph(ROOT)
  for mod, targets in graph.items():
    if mod.startswith(BOTTOM):
      upward = {t: line for t, line in targets.items() if not t.startswith(BOTTOM) and t not in BOTTOM_MAY_IMPORT}
      assert not upward, f"{mod} imports above the kernels: {upward}"
  leaves = ("specjax.settings", "specjax.errors", "specjax.machine")
  for leaf in leaves:
    assert not graph[leaf], f"{leaf} must import nothing of specjax: {graph[leaf]}"


def test_the_check_finds_a_circle_through_a_function_local_import(tmp_path):
  pkg = tmp_path / "specjax"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("from specjax import a\n")           # a face: not a tie to its children
  (pkg / "a.py").write_text("from specjax.sub import b\n")
  (pkg / "sub" / "__init__.py").write_text("")
  (pkg / "sub" / "b.py").write_text("def f():\n  from .. import c\n  return c\n")
  (pkg / "c.py").write_text("import specjax.a as a\n")
  (pkg / "d.py").write_text("from specjax import a, c\n")
  graph = import_graph(tmp_path, ("specjax",))
  assert graph["specjax.sub.b"] == {"specjax.c": 2}
  assert circles(graph) == [frozenset({"specjax.a", "specjax.sub.b", "specjax.c"})]
  (pkg / "c.py").write_text("X = 1\n")
  assert circles(import_graph(tmp_path, ("specjax",))) == []


def test_no_module_in_specjax_is_over_450_lines():
  """One job per module: past 450 lines a module is split (issue 29)."""
  long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "specjax").rglob("*.py"))
          if (n := len(p.read_text(encoding="utf-8").splitlines())) > 450}
  assert not long, long


def long_functions(root: Path, limit: int) -> dict[str, int]:
  """{'file:function': lines} of every function (methods and nested ones included) over ``limit`` lines."""
  out = {}
  for p in sorted(root.rglob("*.py")):
    for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit:
        out[f"{p.relative_to(root)}:{n.name}"] = n.end_lineno - n.lineno + 1
  return out


def test_no_function_in_specjax_is_over_80_lines_and_the_step_stages_fit_in_40():
  """One job per function (issue 57): none of specjax/ past 80 lines, and each stage of the speculative step
  (``engine.spec_step`` and the stages it composes) readable alone, at most 40."""
  assert not long_functions(ROOT / "specjax", 80), long_functions(ROOT / "specjax", 80)
  tree = ast.parse((ROOT / "specjax/speculative/engine.py").read_text(encoding="utf-8"))
  stages = {"step_keys", "draft", "verify", "accept", "commit", "advance", "commit_target_cache",
            "commit_drafter", "count", "spec_step"}
  sizes = {n.name: n.end_lineno - n.lineno + 1 for n in tree.body if isinstance(n, ast.FunctionDef)
           and n.name in stages}
  assert set(sizes) == stages and max(sizes.values()) <= 40, sizes


def test_the_function_length_check_sees_a_long_function(tmp_path):
  (tmp_path / "m.py").write_text("def f():\n" + "  x = 1\n" * 85)
  assert long_functions(tmp_path, 80) == {"m.py:f": 86}


# ----------------------------------------------------------------------------------------------------------
# The layer table


def layer_table(text: str) -> dict[str, int]:
  """{module prefix: layer} from the table under '## Layers' in ARCHITECTURE.md: each row's first cell starts
  with its number, its second cell names packages (`models/`) and modules (`api.py`) of specjax/ (or
  `experiments/`, the package beside it)."""
  section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
  out = {}
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) < 3 or not re.match(r"\d+ ", cells[0]):
      continue
    layer = int(cells[0].split()[0])
    for name in re.findall(r"`([^`]+)`", cells[1]):
      pkg = "experiments" if name == "experiments/" else "specjax." + name.rstrip("/").removesuffix(".py")
      pkg = pkg.removesuffix(".__init__")
      assert pkg not in out, f"{name} is in two rows of the layer table"
      out[pkg] = layer
  return out


def layer_of(mod: str, table: dict[str, int]) -> int | None:
  best = max((p for p in table if mod == p or mod.startswith(p + ".")), key=len, default=None)
  return table[best] if best else None


def layer_violations(graph, table) -> list[str]:
  """Each import of a module from a higher layer, as 'module:line (layer a) -> target (layer b)'."""
  out = []
  for mod, targets in sorted(graph.items()):
    for target, line in targets.items():
      a, b = layer_of(mod, table), layer_of(target, table)
      if a is not None and b is not None and b > a:
        out.append(f"{mod}:{line} (layer {a}) -> {target} (layer {b})")
  return out


def _table():
  return layer_table((ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8"))


def test_every_module_is_in_exactly_one_row_of_the_layer_table():
  table = _table()
  unplaced = [m for m in modules(ROOT) if m != "specjax" and layer_of(m, table) is None]
  assert not unplaced, f"modules in no row of ARCHITECTURE.md's layer table: {unplaced}"
  missing = [p for p in table if p not in modules(ROOT)]
  assert not missing, f"the layer table names what does not exist: {missing}"


def test_each_layer_imports_only_from_its_own_layer_or_below():
  bad = layer_violations(import_graph(ROOT), _table())
  assert not bad, "imports from a higher layer:\n  " + "\n  ".join(bad)


def test_the_layer_check_fails_on_an_injected_upward_import(tmp_path):
  """The same check over a copy of the tree in which the KV cache (layer 2) imports the API (layer 5)."""
  for pkg in PACKAGES:
    shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.cc", "*.h"))
  victim = tmp_path / "specjax" / "models" / "kv_cache.py"
  victim.write_text(victim.read_text(encoding="utf-8") + "\n\ndef _f():\n  from specjax import api\n  return api\n")
  bad = layer_violations(import_graph(tmp_path), _table())
  assert any(v.startswith("specjax.models.kv_cache:") and "-> specjax.api (layer 5)" in v for v in bad), bad


def test_the_package_root_holds_at_most_ten_loose_modules():
  loose = sorted(p.name for p in (ROOT / "specjax").glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
  assert len(loose) <= MAX_LOOSE_MODULES, loose
