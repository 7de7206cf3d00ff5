"""A loop entry does not hash the model's GraphDef (issue 14's streaming pays one entry per `step()`).

Before: `Engine` jitted `serve_loop` with the GraphDef, config and widths as static
arguments, so every entry hashed the GraphDef (~12 ms for a 16-layer model on CPU,
a 2x slower entry). They are bound once now.
"""

from __future__ import annotations

from flax import nnx

from jaxkv import serve
from jaxkv.models import Decoder, ModelConfig


def test_loop_entries_never_hash_the_graphdef(monkeypatch):
  config = ModelConfig.llama(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                             num_heads=2, num_kv_heads=1, head_dim=8)
  cache = config.cache_config(capacity=64, max_seqs=2, max_write=4)
  engine = serve.Engine(Decoder(config, cache, rngs=nnx.Rngs(0)), max_len=16)
  request = serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=4))
  want = engine.run([request])          # compiles
  hashes = []
  graphdef_type = type(engine.core.graphdef)
  original = graphdef_type.__hash__
  monkeypatch.setattr(graphdef_type, "__hash__", lambda self: hashes.append(1) or original(self))
  assert engine.run([request]) == want  # a warm entry
  engine.add_request(serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=4)))
  while engine.has_unfinished():
    engine.step(max_steps=1)            # one entry per step
  assert not hashes, f"the GraphDef was hashed {len(hashes)} times"
