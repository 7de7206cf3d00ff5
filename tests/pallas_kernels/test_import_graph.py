"""The import graph of jaxkv and pallas_kernels is acyclic, and the kernels never import jaxkv.

Built from the source with `ast`, so function-level (lazy) imports count too: a
lazy import only hides a cycle until someone hoists it.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("jaxkv", "pallas_kernels")


def _modules() -> dict[str, pathlib.Path]:
  modules = {}
  for package in PACKAGES:
    for path in sorted((ROOT / package).glob("*.py")):
      name = package if path.stem == "__init__" else f"{package}.{path.stem}"
      modules[name] = path
  return modules


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
  """The project modules `name` imports anywhere in its source."""
  package = name if path.stem == "__init__" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{parent}.{base}" if base else parent
      # `from p import m` imports module `p.m` when there is one, else `p`.
      targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                 for alias in node.names]
    else:
      continue
    found.update(t for t in targets if t in known and t != name)
  return found


def _graph() -> dict[str, set[str]]:
  modules = _modules()
  return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  state: dict[str, int] = {}   # 1: on the stack, 2: done
  stack: list[str] = []

  def visit(node):
    state[node] = 1
    stack.append(node)
    for succ in sorted(graph[node]):
      if state.get(succ) == 1:
        return stack[stack.index(succ):] + [succ]
      if succ not in state and (cycle := visit(succ)):
        return cycle
    stack.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state and (cycle := visit(node)):
      return cycle
  return None


def test_graph_sees_the_known_edges():
  # Guards the parser itself: a graph without edges would be trivially acyclic.
  graph = _graph()
  assert "pallas_kernels.common" in graph["pallas_kernels.varlen_attention_sm90"]
  assert "pallas_kernels.indexing" in graph["pallas_kernels.common"]
  assert "pallas_kernels" in graph["jaxkv._attend"]
  # The dispatcher's lazy import of the kernel module counts.
  assert "pallas_kernels.varlen_attention_sm90" in graph["pallas_kernels.varlen_attention"]


def test_cycle_finder_finds_a_cycle():
  assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_import_graph_is_acyclic():
  assert _find_cycle(_graph()) is None


def test_kernels_never_import_jaxkv():
  graph = _graph()
  offenders = {name: sorted(t for t in targets if t.split(".")[0] == "jaxkv")
               for name, targets in graph.items() if name.startswith("pallas_kernels")}
  assert not {name: t for name, t in offenders.items() if t}


@pytest.mark.parametrize("name", sorted(_modules()))
def test_every_module_imports(name):
  importlib.import_module(name)


def test_the_library_never_imports_examples_or_tests():
  """`examples/` and `tests/` are scripts and tests, not installed: no library module may import them."""

  root = pathlib.Path(__file__).resolve().parents[2]
  offenders = []
  for package in ("jaxkv", "pallas_kernels"):
    for path in sorted((root / package).rglob("*.py")):
      for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                 else [])
        offenders += [f"{path.relative_to(root)}: {n}" for n in names
                      if n.split(".")[0] in ("examples", "tests", "conftest")]
  assert not offenders, offenders


def _all_modules() -> dict[str, pathlib.Path]:
  """Every module of the two packages, subpackages included (`jaxkv.serve.engine`, ...)."""
  modules = {}
  for package in PACKAGES:
    for path in sorted((ROOT / package).rglob("*.py")):
      parts = path.relative_to(ROOT).with_suffix("").parts
      modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return modules


def test_no_cycles_between_modules_anywhere():
  """No cycle among the modules of `jaxkv/` and its subpackages (the engine and its fronts, the
  models, the HTTP front). Package `__init__` files are left out: they re-export their
  submodules' names, so an edge into one is an edge into the package's public surface."""
  modules = _all_modules()
  inits = {name for name, path in modules.items() if path.stem == "__init__"}
  graph = {name: _imports(name, path, set(modules)) - inits
           for name, path in modules.items() if name not in inits}
  assert "jaxkv.serve.live" in graph["jaxkv.serve.engine"]   # the parser sees subpackages
  assert _find_cycle(graph) is None, _find_cycle(graph)


# The rooms of docs/DESIGN.md's map, top to bottom: a module imports only from its own room or
# the rooms below it. The first matching prefix names a module's room.
ROOMS = (
    ("HTTP front and CLI", ("jaxkv.http", "jaxkv.cli")),
    ("serving engine", ("jaxkv.serve", "jaxkv.llm", "jaxkv.demo")),
    ("structured output", ("jaxkv.structured",)),
    ("models", ("jaxkv.models", "jaxkv.tokenizer")),
    ("Flax adapter, public names, facade", ("jaxkv.nnx", "jaxkv.rope", "jaxkv._host")),
    ("core", ("jaxkv.pure", "jaxkv._", "jaxkv")),
    ("kernels", ("pallas_kernels",)),
)
# Edges that point up a room, each with its reason (DESIGN.md states them after the map).
UPWARD = {
    # The package's public names re-export the facade and the Flax adapter.
    ("jaxkv", "jaxkv._host"), ("jaxkv", "jaxkv.nnx"), ("jaxkv", "jaxkv.rope"),
}


def _room(name: str) -> int:
  for rank, (_, prefixes) in enumerate(ROOMS):
    if any(name == p or name.startswith(p if p.endswith("_") else p + ".") for p in prefixes):
      return rank
  raise AssertionError(f"{name} is in no room of ROOMS (add it, and to docs/DESIGN.md's map)")


def test_imports_point_down_the_rooms():
  """Every module imports from its own room or below (docs/DESIGN.md's map), but the listed edges."""
  modules = _all_modules()
  graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
  upward = sorted((name, target) for name, targets in graph.items() for target in targets
                  if _room(target) < _room(name) and (name, target) not in UPWARD)
  assert not upward, upward
  assert all(_room(a) > _room(b) for a, b in UPWARD), "an UPWARD entry that is not upward"


def test_design_map_lists_every_library_file():
  """docs/DESIGN.md's map names every file of the two packages, and no file that is gone."""
  text = (ROOT / "docs" / "DESIGN.md").read_text()
  block = text.split("## The map of rooms", 1)[1].split("```", 2)[1]
  listed = {line.split()[0] for line in block.splitlines()
            if line.startswith("  ") and line.split()[0].endswith(".py")}
  files = {str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
  assert not files - listed, f"not in DESIGN.md's map: {sorted(files - listed)}"
  assert not listed - files, f"in DESIGN.md's map but gone: {sorted(listed - files)}"
