"""Walking a compiled module's optimized HLO text: its computations, and what one reaches.

Shared by the tests that count the `while` loops a compiled serving loop runs (on a
GPU each loop predicate is a device-to-host read): `test_paged_cow.py`,
`test_paged_loop_syncs.py`.
"""

from __future__ import annotations

import re

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(r"(?:to_apply|calls)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
LOOP = re.compile(r"condition=%?([\w.\-]+), body=%?([\w.\-]+)")


def computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
  """`({computation name: its instruction lines}, the entry computation's name)`."""
  comps, current, entry = {}, None, None
  for line in hlo.splitlines():
    header = _HEADER.match(line)
    if header:
      current = comps.setdefault(header.group(1), [])
      entry = header.group(1) if line.startswith("ENTRY") else entry
    elif current is not None and " = " in line:
      current.append(line)
  return comps, entry


def reached(comps: dict, name: str, *, branches: bool = False,
            into_loops: bool = False) -> list[str]:
  """The instruction lines reached from computation `name` through calls and fusions.

  `branches`: also through conditionals' branch computations. A `while` line is listed;
  its condition and body are entered only with `into_loops`.
  """
  found, todo, seen = [], [name], set()
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    for line in comps[name]:
      found.append(line)
      if " while(" in line:
        if into_loops:
          todo += LOOP.search(line).groups()
        continue
      todo += _CALLED.findall(line)
      if branches:
        for group in _BRANCHES.findall(line):
          todo += [n.strip().lstrip("%") for n in group.split(",")]
  return found


def whiles(lines: list[str]) -> list[str]:
  """The `while` instructions among `lines`."""
  return [line for line in lines if " while(" in line]
