"""One owner of the loop state: `jaxkv.serve.core.EngineCore`, and every front its client.

Static checks read the library's source (no compile): only `core.py` builds a loop
state, runs the loop or the helpers that change the state between entries, and
assigns an engine's state; no class of the engine or its fronts inherits from a
jaxkv class (composition, not mixins). The runtime check counts the core's loop
entries under `Engine.run`, `Engine.step` and `AsyncEngine`.
"""

from __future__ import annotations

import ast
import dataclasses
import asyncio
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from jaxkv import serve
from jaxkv.models import Decoder, ModelConfig
from jaxkv.serve import AsyncEngine

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIBRARY = sorted((ROOT / "jaxkv").rglob("*.py"))
CORE = ROOT / "jaxkv" / "serve" / "core.py"
# The verbs that create or change a loop state, and the modules that define them.
STATE_VERBS = {"init_loop_state": "state.py", "serve_loop": "loop.py", "enqueue": "live_ops.py",
               "abort_rows": "live_ops.py", "snapshot": "live_ops.py"}


def _tree(path: pathlib.Path) -> ast.AST:
  return ast.parse(path.read_text(), filename=str(path))


def _verbs_used(tree: ast.AST) -> set[str]:
  """The state verbs `tree` imports from their modules or reads as `module.verb`."""
  modules = {stem[:-3] for stem in STATE_VERBS.values()}
  used = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] in modules:
      used |= {a.name for a in node.names
               if STATE_VERBS.get(a.name) == node.module.split(".")[-1] + ".py"}
    elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and STATE_VERBS.get(node.attr) == node.value.id + ".py"):
      used.add(node.attr)
  return used


def test_only_the_core_uses_the_verbs_that_change_a_loop_state():
  offenders = [f"{path.relative_to(ROOT)}: {sorted(_verbs_used(_tree(path)))}" for path in LIBRARY
               if path != CORE and _verbs_used(_tree(path))]
  assert not offenders, offenders
  assert _verbs_used(_tree(CORE)) == set(STATE_VERBS)   # the check sees how the core uses them


def _fronts():
  """The engine and its fronts: `jaxkv/serve/`, `jaxkv/http/`, `llm.py`, `cli.py`."""
  return [p for p in LIBRARY if p.parent.name in ("serve", "http") or p.name in ("llm.py", "cli.py")]


def test_nothing_outside_the_core_assigns_a_loop_state():
  offenders = []
  for path in _fronts():
    if path == CORE:
      continue
    for node in ast.walk(_tree(path)):
      targets = (node.targets if isinstance(node, ast.Assign)
                 else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
      for target in targets:
        # The assigned attribute itself: `app.state.x = ...` sets FastAPI's namespace's `x`.
        for t in target.elts if isinstance(target, ast.Tuple) else [target]:
          if isinstance(t, ast.Attribute) and t.attr in ("state", "_state"):
            offenders.append(f"{path.relative_to(ROOT)}:{t.lineno}")
  assert not offenders, offenders


def test_fronts_compose_and_never_inherit_jaxkv_classes():
  """No mixins in the engine and its fronts: each class's bases come from outside jaxkv, except
  exceptions (an `EngineError` family) and pydantic request schemas sharing fields."""
  defined = {node.name for path in LIBRARY for node in ast.walk(_tree(path))
             if isinstance(node, ast.ClassDef)}
  offenders = []
  for path in _fronts():
    if path.name == "schema.py":
      continue
    for node in ast.walk(_tree(path)):
      if isinstance(node, ast.ClassDef):
        bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
        offenders += [f"{path.relative_to(ROOT)}: {node.name}({b})" for b in bases
                      if b in defined and not b.endswith(("Error", "Warning"))]
  assert not offenders, offenders
  assert "Engine" in defined and "LiveQueue" in defined


def test_run_step_and_async_engine_are_clients_of_one_core(monkeypatch):
  config = ModelConfig.llama(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                             num_heads=2, num_kv_heads=1, head_dim=8)
  model = Decoder(config, config.cache_config(capacity=64, max_seqs=2, max_write=4),
                  rngs=nnx.Rngs(0))
  engine = serve.Engine(model, max_len=16)
  core, entries = engine.core, []
  real = core.enter

  def counted(*args, **kwargs):
    entries.append(args[0])
    return real(*args, **kwargs)

  monkeypatch.setattr(core, "enter", counted)
  request = serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=4, temperature=0.0))
  [want] = engine.run([request])
  # The engine's state is the core's (unpacked afresh on each read: compare the leaves).
  same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a),
                                                               jax.tree.leaves(b)))
  assert entries and core.started and same(engine.state, core.state)
  entries.clear()
  engine.add_request(request.replace(request_id="live"))
  got = [t for d in engine.stream(2) for t in d.tokens]
  assert got == list(want.tokens) and entries and set(entries) == {2}
  entries.clear()

  async def main():
    aio = AsyncEngine(engine, interval=3)
    try:
      return [t async for d in aio.generate(request.replace(request_id="aio")) for t in d.tokens]
    finally:
      aio.close()

  assert asyncio.run(main()) == list(want.tokens) and entries
  assert engine.core is core and same(engine.state, core.state)
  with pytest.raises(AttributeError):
    engine.state = None   # read only: the core's


def test_engines_of_one_kind_share_their_programs_not_their_weights(monkeypatch):
  """A second engine over an equal model structure and config compiles nothing, and serves
  its own weights; the shared programs go with the last engine holding them (and the few
  kinds kept after their engines, none here)."""
  import gc   # pylint: disable=g-import-not-at-top
  import weakref   # pylint: disable=g-import-not-at-top
  from jaxkv.serve.core import _Programs   # pylint: disable=g-import-not-at-top
  from jaxkv.serve.timing import compile_seconds   # pylint: disable=g-import-not-at-top
  config = ModelConfig.llama(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                             num_heads=2, num_kv_heads=1, head_dim=8)
  cache = config.cache_config(capacity=64, max_seqs=2, max_write=4)
  requests = [serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=6, temperature=0.0),
                            request_id="a"),
              serve.Request((4, 5), serve.SamplingParams(max_tokens=5, temperature=0.9, seed=3,
                                                         n=2), request_id="b")]
  tokens = lambda engine: [c.tokens for c in engine.run(requests)]
  monkeypatch.setattr(_Programs, "KEEP", 0)   # none kept past its engines

  def alone(seed):
    """The oracle for one weight set: an engine of another kind (a compiler option sets it
    apart), alone in the process (its programs go with it)."""
    engine = serve.Engine(Decoder(config, cache, rngs=nnx.Rngs(seed)), max_len=16,
                          compiler_options={"xla_cpu_enable_fast_math": False})
    out = tokens(engine)
    del engine
    gc.collect()
    return out

  want_a, want_b = alone(0), alone(1)
  assert want_a != want_b   # the weights differ where it shows
  first = serve.Engine(Decoder(config, cache, rngs=nnx.Rngs(0)), max_len=16)
  assert tokens(first) == want_a
  second = serve.Engine(Decoder(config, cache, rngs=nnx.Rngs(1)), max_len=16)
  assert second.core._programs is first.core._programs   # pylint: disable=protected-access
  before = compile_seconds()   # (building an engine traces the model's step shape once)
  assert tokens(second) == want_b and tokens(first) == want_a
  assert compile_seconds() == before   # nothing traced, lowered or compiled again
  # Any part of the kind apart, programs apart (built, never run: no compile).
  model = Decoder(config, cache, rngs=nnx.Rngs(0))
  others = [serve.Engine(model, max_len=16, widths=(4, 2)),
            serve.Engine(model, max_len=16, compiler_options={"xla_cpu_enable_fast_math": False}),
            serve.Engine(Decoder(config, dataclasses.replace(cache, max_seqs=3), rngs=nnx.Rngs(0)),
                         max_len=16)]
  assert all(o.core._programs is not first.core._programs for o in others)   # pylint: disable=protected-access
  del others, model
  programs = weakref.ref(first.core._programs)   # pylint: disable=protected-access
  del first, second
  gc.collect()
  assert programs() is None
