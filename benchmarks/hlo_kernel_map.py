"""Which source lines built each traced kernel: a kernel list mapped through the compiled HLO.

`profile_step.py --dump-hlo` writes the serving loop's optimized HLO (`loop_W*.hlo.txt`)
and each traced kernel's launches and GPU time per step (`kernels_*.txt`). XLA names a
kernel after its fusion, and each HLO instruction carries a `stack_frame_id` into the
module's stack-frame tables; this prints, for the kernels launched between `--min` and
`--max` times per step (default: about once per step, the per-step bookkeeping rather than
the per-layer work), the fusion's result shape and the innermost jaxkv source frames that
built it (with `--ops`, the opcodes fused into it), so a per-step kernel can be traced back to the verb, plan or loop code it runs.

Usage: python benchmarks/hlo_kernel_map.py LOOP_HLO KERNELS_TXT [--min 0.4] [--max 3]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The HLO module parser (computations and their instructions) and the free opcodes.
from paged_step_ops import _FREE, _computations   # pylint: disable=g-import-not-at-top,wrong-import-position


def _section(hlo: str, name: str) -> list[str]:
  parts = hlo.split("\n" + name + "\n")
  return parts[1].split("\n\n")[0].split("\n") if len(parts) > 1 else []


def stack_frames(hlo: str):
  """`frame id -> [(file, function, line), ...]` innermost first."""
  files = {int(l.split()[0]): l.split('"')[1].split("/")[-1]
           for l in _section(hlo, "FileNames") if l.strip()}
  funcs = {int(l.split()[0]): l.split('"')[1].split(".")[-1]
           for l in _section(hlo, "FunctionNames") if l.strip()}
  locs, frames = {}, {}
  for l in _section(hlo, "FileLocations"):
    m = re.match(r"(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", l)
    if m:
      locs[int(m[1])] = (files[int(m[2])], funcs[int(m[3])], int(m[4]))
  for l in _section(hlo, "StackFrames"):
    m = re.match(r"(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", l)
    if m:
      frames[int(m[1])] = (int(m[2]), int(m[3]))

  def stack(frame):
    out, seen = [], set()
    while frame in frames and frame not in seen:
      seen.add(frame)
      loc, parent = frames[frame]
      out.append(locs[loc])
      if parent == frame:
        break
      frame = parent
    return out
  return stack


def fusions(hlo: str):
  """`trace name -> [(result shape, stack frame id or None, fused opcodes)]` of every fusion."""
  comps, _ = _computations(hlo)
  out = collections.defaultdict(list)
  for line in hlo.split("\n"):
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+) .*?kind=k\w+", line)
    if not m:
      continue
    frame = re.search(r"stack_frame_id=(\d+)", line)
    called = re.search(r"calls=%?([\w.\-]+)", line)
    body = comps.get(called[1], []) if called else []
    opcodes = ",".join(sorted({op for op, _, _ in body if op not in _FREE}))
    for key in [m[1]] + re.findall(r'deduplicated_name="([^"]+)"', line):
      out[key.replace(".", "_")].append((m[2][:40], int(frame[1]) if frame else None, opcodes))
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("hlo")
  p.add_argument("kernels")
  p.add_argument("--min", type=float, default=0.4, help="fewest launches per step listed")
  p.add_argument("--max", type=float, default=3.0, help="launches per step below which listed")
  p.add_argument("--frames", type=int, default=4, help="source frames shown per kernel")
  p.add_argument("--ops", action="store_true", help="also list each fusion's opcodes")
  args = p.parse_args(argv)
  hlo = open(args.hlo).read()
  stack, found = stack_frames(hlo), fusions(hlo)
  total_us = count = 0.0
  for line in open(args.kernels):
    parts = line.split()
    if len(parts) < 3:
      continue
    launches, ms, name = float(parts[0]), float(parts[1]), parts[2]
    if not args.min <= launches < args.max:
      continue
    total_us += ms * 1e3
    count += launches
    where = set()
    for shape, frame, opcodes in found.get(name, [])[:4]:
      frames = [f"{fn}:{line_no}({func})" for fn, func, line_no in (stack(frame) if frame else [])
                if fn not in ("profile_step.py",)][:args.frames]
      where.add(shape + " " + " < ".join(frames) + (f" [{opcodes}]" if args.ops else ""))
    print(f"{launches:5.2f} {ms * 1e3:6.1f}us {name:38s} | " + " || ".join(sorted(where))[:400])
  print(f"listed: {count:.1f} launches per step, {total_us:.1f} us per step")
  return 0


if __name__ == "__main__":
  sys.exit(main())
