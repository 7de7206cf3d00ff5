"""XLA work of one paged step against one column step, counted on CPU (a proxy for GPU launches).

The paged engine's step costs more than the column step on the GPU (docs/performance-history.md,
"Paged engine on the GPU"); the difference is XLA work only the paged step does: page
bookkeeping in `prepare_step` and the pool-row lookup of the paged K/V write. This script
counts that work without a GPU:

- `prepare_step`, `commit_step`, `seq_rm`, `seq_clone` and `rewind` are jitted with the
  state donated and compiled for the CPU, at an e2e-like shape (the realistic mix of
  `benchmarks/e2e.py --workload mixed --max-write 2048 --paged 128`: 16 flat layers of 8 KV
  heads of 64, 64 sequences, `W` 2048, capacity 131,072, pages of 128 rows). Only shapes are
  used: nothing is allocated. Each compiled module's *kernels* are counted: the instructions
  of the entry computation and of every while-loop body and condition, less the free ones
  (parameters, constants, tuples, bitcasts); a fusion counts once. Kernels inside loops (run
  once per trip; the page-copy loops of older versions made no trip unless a page was
  copied, but cost a host round trip on a GPU) are counted apart. `[num_pages]` and
  `table-shaped` count the kernels whose result is the pool's page count or the page table
  (`[S + 1, M]` or `[S, M]`: `S` sequences, `M` table slots per sequence).
- The paged and the column K/V write are lowered for CUDA (Mosaic GPU checks the kernel
  while lowering, on any machine) and the StableHLO ops outside the kernel call are
  listed: what XLA runs around the write kernel.

- `--loops`: the serving loop's `while` loops that every outer iteration checks (on a GPU
  each check is a device-to-host read of the predicate), for both storages: counted in the
  compiled HLO and listed from the jaxpr with the source line that built each, plus the
  loops nested in them (checked only when their parent makes a trip). See
  `loop_predicates` for how they add up per outer iteration.

- `--serving`: the serving loop's step-loop body and condition (a tiny model, both storages):
  the widest step loop of the general loop, and every width's of the greedy loop (the
  narrowest width's is the decode step; docs/performance-history.md, "Per-step bookkeeping kernels").
- `--plan`: the Mosaic GPU attention's XLA plan (segment plan, item table, the epilogue's
  token lookup), which runs once per step on the GPU only (`plan_kernels`).

A CPU proxy: XLA:GPU fuses differently and the GPU time was measured separately (see
docs/PERFORMANCE.md). Usage: PYTHONPATH=. python benchmarks/paged_step_ops.py [--small]
[--page-sizes 128,32] [--serving] [--plan] [--loops]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
import pallas_kernels

pure = jaxkv.pure

_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "opt-barrier"}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s+(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.*?)\s(?P<op>[a-z][\w\-]*)\(")
_CALLS = re.compile(r"(condition|body|to_apply)=%?([\w.\-]+)")


def _computations(text: str) -> tuple[dict, str]:
  """`({name: [(op, shape, line)]}, entry name)` of an HLO module's text."""
  comps, entry, current = {}, None, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = header.group(1)
      comps[current] = []
      if line.startswith("ENTRY"):
        entry = current
      continue
    match = _INSTRUCTION.match(line)
    if match and current is not None:
      comps[current].append((match["op"], match["shape"], line))
  return comps, entry


def _dims(shape: str) -> tuple[int, ...]:
  """The dimensions of an HLO result shape's first array (`()` for a scalar or a tuple)."""
  match = re.match(r"\w+\[([\d,]*)\]", shape.strip())
  return tuple(int(d) for d in match.group(1).split(",") if d) if match else ()


def kernels(compiled_text: str) -> list[tuple[str, tuple, bool]]:
  """`(op, result dims, in_loop)` of every non-free instruction run outside fusions.

  `in_loop`: inside a while loop's body or condition (run once per trip).
  """
  comps, entry = _computations(compiled_text)
  out, todo, seen = [], [(entry, False)], set()
  while todo:
    name, in_loop = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    for op, shape, line in comps[name]:
      if op in ("while", "call"):   # loop bodies and conditions, called computations
        todo.extend((n, in_loop or op == "while") for _, n in _CALLS.findall(line))
      if op not in _FREE and op != "call":
        out.append((op, _dims(shape), in_loop))
  return out


def summary(found, config) -> dict:
  """Kernels run once per call, how many have a `[num_pages]` or table-shaped result, and
  how many sit inside loops (run once per trip)."""
  once = [(op, dims) for op, dims, in_loop in found if not in_loop]
  out = {"kernels": len(once)}
  if config.is_paged:
    table = {(config.max_seqs + 1, config.max_pages_per_seq),
             (config.max_seqs, config.max_pages_per_seq)}
    out["[num_pages]"] = sum(dims == (config.num_pages,) for _, dims in once)
    out["table-shaped"] = sum(dims in table for _, dims in once)
  out["ops"] = dict(sorted(collections.Counter(op for op, _ in once).items()))
  out["in_loops"] = sum(in_loop for _, _, in_loop in found)
  return out


def cache_config(*, page_size, small: bool):
  layer = jaxkv.LayerConfig(jaxkv.LayerPolicy.flat(), 8, 64)
  if small:
    return jaxkv.CacheConfig([layer] * 2, capacity=4096, max_seqs=8, max_write=256,
                             kv_dtype=jnp.bfloat16, initial_capacity=512, page_size=page_size)
  return jaxkv.CacheConfig([layer] * 16, capacity=131_072, max_seqs=64, max_write=2048,
                           kv_dtype=jnp.bfloat16, initial_capacity=2816, page_size=page_size)


def verb_kernels(config, verb, *args) -> dict:
  state = jax.eval_shape(lambda: jaxkv.init_state(config))
  jitted = jax.jit(verb, static_argnums=0, donate_argnums=1)
  return summary(kernels(jitted.lower(config, state, *args).compile().as_text()), config)


def write_ops(config) -> dict:
  """StableHLO ops around the Mosaic GPU write kernel, lowered for CUDA."""
  layer = config.layers[0]
  width = config.step_width
  new = jax.ShapeDtypeStruct((width, layer.n_kv_heads, layer.head_dim), jnp.bfloat16)
  ints = jax.ShapeDtypeStruct((width,), jnp.int32)
  n = jax.ShapeDtypeStruct((), jnp.int32)
  state = jax.eval_shape(lambda: jaxkv.init_state(config))
  k = state.k[0]
  if config.is_paged:
    fn, extra = pallas_kernels.paged_kv_write, (state.page_table,)
  else:
    fn, extra = pallas_kernels.kv_write, ()
  text = jax.jit(fn, donate_argnums=(0, 1)).trace(k, k, new, new, ints, ints, n, *extra).lower(
      lowering_platforms=("cuda",)).as_text()
  ops = re.findall(r"=\s*\"?(stablehlo\.[\w.]+|tpu\.\w+)", text)
  calls = re.findall(r"custom_call @(\w+)", text)
  return {"ops_outside_kernel": dict(collections.Counter(
      op for op in ops if op not in ("stablehlo.custom_call",))), "kernel_calls": calls}


def _while_loops(compiled_text: str) -> list[tuple[int, int]]:
  """`(body kernels, condition kernels)` of every while loop, nested loops not included."""
  comps, _ = _computations(compiled_text)
  count = lambda name: sum(op not in _FREE and op != "call" for op, _, _ in comps.get(name, []))
  loops = []
  for instructions in comps.values():
    for op, _, line in instructions:
      if op == "while":
        called = dict(_CALLS.findall(line))
        loops.append((count(called["body"]), count(called["condition"])))
  return loops


def serving_step_kernels(page_size, *, small: bool) -> tuple[int, int]:
  """`(body, condition)` kernels of the serving loop's widest step loop, for a tiny model.

  The step loop is the while loop with the largest body (it holds the model); the
  model (2 Llama layers of width 32) is the same for both storages, so the difference
  is the storage's per-step work: its verbs, its K/V writes and its loop checks.
  """
  fn, args = _serving_loop(page_size, small=small)
  return max(_while_loops(fn.lower(*args).compile().as_text()))


def _direct_whiles(comps: dict, name: str) -> list[str]:
  """The `while` instructions reached from computation `name` without entering a while."""
  found, todo, seen = [], [name], set()
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    for op, _, line in comps[name]:
      if op == "while":
        found.append(line)
      else:
        todo.extend(_CALLEES.findall(line))
        for group in _BRANCHES.findall(line):
          todo.extend(n.strip().lstrip("%") for n in group.split(","))
  return found


_CALLEES = re.compile(r"(?:to_apply|calls)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _jaxpr_whiles(jaxpr) -> list[tuple[str, list, list]]:
  """`(label, body loops, condition loops)` of the while loops of a jaxpr, nested loops
  inside. The label is the innermost `jaxkv/serve` frame that built the loop."""
  out = []
  for eqn in jaxpr.eqns:
    subs = []
    for value in eqn.params.values():
      for v in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(v, "jaxpr", v)
        if hasattr(inner, "eqns"):
          subs.append(inner)
    if eqn.primitive.name == "while":
      label = "?"
      frames = getattr(getattr(eqn.source_info, "traceback", None), "frames", ())
      for frame in frames:
        if "jaxkv/serve/" in frame.file_name:
          label = f"{frame.file_name.rsplit('/', 1)[-1]}:{frame.line_num} {frame.function_name}"
          break
      out.append((label, _jaxpr_whiles(eqn.params["body_jaxpr"].jaxpr),
                  _jaxpr_whiles(eqn.params["cond_jaxpr"].jaxpr)))
    else:
      for sub in subs:
        out.extend(_jaxpr_whiles(sub))
  return out


def serving_width_kernels(page_size, *, small: bool, greedy: bool) -> list[tuple[int, int, int]]:
  """`(width, body, condition)` kernels of each width's step loop, widest first.

  The step loops are the last `len(widths)` loops of the outer loop's body (one
  phase per width, each fed by the one before); each is checked to carry the
  tiny model's `[width, hidden]` activations. The narrowest is the decode step.
  """
  fn, args = _serving_loop(page_size, small=small, greedy=greedy)
  comps, entry = _computations(fn.lower(*args).compile().as_text())
  (outer,) = [line for op, _, line in comps[entry] if op == "while"]
  outer_body = dict(_CALLS.findall(outer))["body"]
  widths = args[2]
  phases = [dict(_CALLS.findall(line)) for op, _, line in comps[outer_body]
            if op == "while"][-len(widths):]
  count = lambda name: sum(op not in _FREE and op != "call" for op, _, _ in comps[name])
  out = []
  for width, called in zip(widths, phases):
    assert any(f"f32[{width},{_HIDDEN}]" in shape for _, shape, _ in comps[called["body"]]), width
    out.append((width, count(called["body"]), count(called["condition"])))
  return out


def plan_kernels(num_tokens: int, *, num_rows: int, group: int = 4, head_dim: int = 64) -> int:
  """Kernels of the Mosaic GPU attention's XLA plan for one call, compiled for the CPU.

  The plan (`varlen_plan`: segment plan, item table; `combine_sm90.token_items`,
  the epilogue's token lookup) runs once per step on the GPU (the layers share
  it), and only there: on the CPU the model attends with the reference, so the
  serving-loop counts above do not hold it. A flat layer of `num_rows` rows and
  the compiled kernels' default config (Llama 3.2 1B heads: G 4, head dim 64);
  `num_rows` decides the split bound (one split per segment up to ~2,040 rows).
  """
  from pallas_kernels import combine_sm90, varlen_plan   # pylint: disable=g-import-not-at-top
  from pallas_kernels import varlen_attention_sm90 as sm90   # pylint: disable=g-import-not-at-top
  config = pallas_kernels.config.default_varlen_attention_config(
      group=group, head_dim=head_dim, interpret=False)
  tile_rows = sm90.q_tile_rows(config.block_q, group)
  block_k, _ = sm90.tile_geometry(num_rows, head_dim, config=config)
  config = varlen_plan.bounded_config(config, num_rows, block_k=block_k, window=None)
  max_items = varlen_plan.item_capacity(num_tokens, group=group, tile_rows=tile_rows,
                                        config=config)

  def plan(seq_info, n_segments):
    seg = varlen_plan._segment_plan(   # pylint: disable=protected-access
        seq_info, n_segments, num_rows=num_rows, window=None, group=group, tile_rows=tile_rows,
        block_k=block_k, align=sm90.ROW_ALIGN, config=config)
    items = varlen_plan._item_table(   # pylint: disable=protected-access
        seg, max_items=max_items, group=group, tile_rows=tile_rows, block_k=block_k,
        window=None, sort_items=config.sort_items)
    return items, combine_sm90.token_items(seg, num_tokens=num_tokens, group=group,
                                           block_q=config.block_q, num_items=max_items)

  seq_info = jax.ShapeDtypeStruct((num_tokens, 5), jnp.int32)
  n = jax.ShapeDtypeStruct((), jnp.int32)
  return len(kernels(jax.jit(plan).lower(seq_info, n).compile().as_text()))


_HIDDEN = 32   # the tiny serving model's hidden size


def _serving_loop(page_size, *, small: bool, num_widths: int = 2, greedy: bool = False):
  """`(jitted serve_loop, its args)` for a tiny model (the same model for both storages)."""
  from flax import nnx   # pylint: disable=g-import-not-at-top
  from jaxkv import serve   # pylint: disable=g-import-not-at-top
  from jaxkv.models import Decoder, ModelConfig   # pylint: disable=g-import-not-at-top
  from jaxkv.serve.loop import serve_loop   # pylint: disable=g-import-not-at-top
  from jaxkv.serve.state import init_loop_state, pack_queue   # pylint: disable=g-import-not-at-top
  model_config = ModelConfig.llama(vocab_size=64, hidden_size=_HIDDEN, intermediate_size=64,
                                   num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
  s, w, capacity = (8, 64, 1024) if small else (64, 2048, 131_072)
  cache = model_config.cache_config(capacity=capacity, max_seqs=s, max_write=w,
                                    initial_capacity=2816 if not small else 256)
  model = Decoder(model_config, dataclasses.replace(cache, page_size=page_size),
                  rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  widths = (w, min(w, 64), 16)[:num_widths]
  queue = pack_queue([(1, 2, 3)], [serve.SamplingParams(max_tokens=4)], max_len=64,
                     max_stop=4)
  ls = init_loop_state(model.cache_config, queue, num_widths=len(widths))
  fn = jax.jit(functools.partial(serve_loop, greedy=greedy), static_argnums=(0, 1, 2),
               donate_argnums=4)
  return fn, (graphdef, model.cache_config, widths, params, ls, jnp.int32(8))


def loop_predicates(page_size, *, small: bool) -> dict:
  """The serving loop's `while` predicates per outer iteration on the common path.

  Common path: nothing is evicted, parked or forked. Every loop reached from the
  outer loop's body without entering another loop evaluates its predicate at least
  once per outer iteration (one more per trip); the loops nested in those run only
  when their parent trips. So an outer iteration that retires `r` columns, admits
  `k` requests and runs `t` steps evaluates `direct + 1 + r + k + t` predicates (the
  `+ 1`: the outer loop's own), when no loop nested in the retire and admit loops
  runs (none does on this path). `direct` is counted twice: in the compiled HLO
  (what runs) and in the jaxpr, whose loops carry the source line that built them.
  """
  fn, args = _serving_loop(page_size, small=small)
  traced = fn.trace(*args)
  text = traced.lower().compile().as_text()
  comps, entry = _computations(text)
  outer = _direct_whiles(comps, entry)
  assert len(outer) == 1, outer
  called = dict(_CALLS.findall(outer[0]))
  direct_hlo = (len(_direct_whiles(comps, called["body"]))
                + len(_direct_whiles(comps, called["condition"])))
  (top,) = _jaxpr_whiles(traced.jaxpr.jaxpr)
  _, body, cond = top
  return {"direct (HLO)": direct_hlo, "direct (jaxpr)": len(body) + len(cond),
          "loops": [label for label, _, _ in body + cond],
          "nested in them": {label: len(b) + len(c) for label, b, c in body + cond if b or c}}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true", help="a small shape (fast compile)")
  parser.add_argument("--serving", action="store_true",
                      help="also compile the serving loop with a tiny model (slow)")
  parser.add_argument("--page-sizes", default="128",
                      help="comma-separated page sizes to count the verbs at (e.g. 128,32)")
  parser.add_argument("--plan", action="store_true",
                      help="count the Mosaic GPU attention's XLA plan (item table, splits), "
                      "which the CPU serving loop does not run")
  parser.add_argument("--loops", action="store_true",
                      help="count the serving loop's while predicates per outer iteration "
                      "(a tiny model, both storages)")
  args = parser.parse_args()
  counts = {}
  page_sizes = [int(p) for p in args.page_sizes.split(",")]
  for page_size in [None] + page_sizes:
    config = cache_config(page_size=page_size, small=args.small)
    name = "columns" if page_size is None else f"pages of {page_size}"
    print(f"== {name}: S={config.max_seqs} W={config.step_width} capacity={config.capacity}"
          + (f" M={config.max_pages_per_seq} num_pages={config.num_pages}"
             if config.is_paged else ""))
    for verb, args_ in (("prepare_step", ()), ("commit_step", ()), ("seq_rm", (jnp.int32(0),)),
                        ("seq_clone", (jnp.int32(0), jnp.int32(5))),
                        ("rewind", (jnp.int32(0), jnp.int32(5)))):
      result = verb_kernels(config, getattr(pure, verb), *args_)
      counts[page_size, verb] = result["kernels"]
      print(f"  {verb + ':':14}", result)
    print(f"  {'K/V write:':14}", write_ops(config))
  if args.serving:
    for page_size in (None, 128):
      body, cond = serving_step_kernels(page_size, small=args.small)
      name = "columns" if page_size is None else f"pages of {page_size}"
      print(f"== serving loop, {name}: widest step loop body {body} kernels, condition {cond}")
      per_width = serving_width_kernels(page_size, small=args.small, greedy=True)
      print(f"== serving loop, {name}, greedy: step-loop body / condition kernels per width: "
            + ", ".join(f"{w}: {b} / {c}" for w, b, c in per_width))
  if args.plan:
    for num_rows in (1024, 8192):
      print(f"== attention plan (GPU only, once per step), {num_rows} rows: kernels per call "
            f"at 64 / 2048 tokens: {plan_kernels(64, num_rows=num_rows)} / "
            f"{plan_kernels(2048, num_rows=num_rows)}")
  if args.loops:
    for page_size in (None, 128):
      name = "columns" if page_size is None else f"pages of {page_size}"
      found = loop_predicates(page_size, small=args.small)
      print(f"== serving loop, {name}: loops evaluated once per outer iteration (beside the "
            f"outer loop's own check): {found['direct (HLO)']} in the compiled HLO, "
            f"{found['direct (jaxpr)']} in the jaxpr")
      for label in found["loops"]:
        print(f"     {label}")
      print(f"   loops nested in them (run only when their parent trips): "
            f"{found['nested in them']}")
  for page_size in page_sizes:
    print(f"== pages of {page_size} - columns, kernels per call (outside loops):",
          {verb: counts[page_size, verb] - counts[None, verb]
           for verb in ("prepare_step", "commit_step", "seq_rm", "seq_clone", "rewind")})


if __name__ == "__main__":
  main()
