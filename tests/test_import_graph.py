"""The import graph of specjax/, pallas_kernels/ and experiments/, function-local imports included.

Issue 29 removes the one big import circle step by step; until it is gone this test is a ratchet: no new
circle may appear and the known one may only shrink (``KNOWN_CIRCLE``: shrink it with every step that breaks
a tie, and delete it when the circle is gone).  An import of a submodule does not count as an import of its
parent packages (Python runs them first anyway; they are faces that hand names on).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specjax", "pallas_kernels", "experiments")

# The modules of today's circle (issue 29, "The circle"); each step that cuts a tie removes names.
KNOWN_CIRCLE = frozenset({
    "specjax.api", "specjax.bench", "specjax.calibrate", "specjax.checkpoints", "specjax.checkpoints.drafter_io",
    "specjax.checkpoints.gguf_loader", "specjax.checkpoints.registry", "specjax.checkpoints.safetensors_loader",
    "specjax.compile_cache", "specjax.decode", "specjax.kernels.autotune", "specjax.kernels.cpu_attention",
    "specjax.kernels.cpu_matmul", "specjax.machine", "specjax.model", "specjax.sampling", "specjax.speculative",
    "specjax.speculative.acceptance", "specjax.speculative.drafters", "specjax.speculative.eagle",
    "specjax.speculative.engine", "specjax.speculative.hybrid", "specjax.speculative.tree",
})


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


def test_no_new_import_circle_and_the_known_one_only_shrinks():
  graph = import_graph(ROOT)
  found = circles(graph)
  for c in found:
    assert c <= KNOWN_CIRCLE, f"a new import circle (or one that grew):\n{_describe(graph, c)}"
  assert len(found) <= 1, [sorted(c) for c in found]
  in_circle = set().union(*found) if found else set()
  stale = KNOWN_CIRCLE - in_circle
  assert not stale, f"these modules left the circle: remove them from KNOWN_CIRCLE: {sorted(stale)}"


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
