"""`Engine(compiler_options=...)`: the XLA options the serving loop is compiled with (issue 11).

By default none (XLA's own; on H200 cuBLAS-only matmuls made the e2e model's step slower,
docs/PERFORMANCE.md). Given options must reach the compilation of both loops (the
general and the greedy one), leave the tokens as they are, and be checked at the
boundary.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxkv import serve
from jaxkv.models import Decoder, ModelConfig


@pytest.fixture(scope="module")
def model():
  config = ModelConfig.llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                             num_heads=4, num_kv_heads=2, head_dim=8)
  return Decoder(config, config.cache_config(capacity=64, max_seqs=4, max_write=8),
                 rngs=nnx.Rngs(0))


def _requests(**params):
  rng = np.random.default_rng(3)
  return [serve.Request(tuple(int(t) for t in rng.integers(0, 64, int(rng.integers(2, 9)))),
                        serve.SamplingParams(max_tokens=int(rng.integers(2, 7)), **params))
          for _ in range(6)]


def test_the_default_is_xla_s_own_options(model):
  assert serve.Engine(model, max_len=16).compiler_options == {}
  assert serve.Engine(model, max_len=16, compiler_options=None).compiler_options == {}


@pytest.mark.parametrize("params", [{}, {"temperature": 0.8, "seed": 5}],
                         ids=["greedy loop", "general loop"])
def test_the_options_reach_the_loop_and_keep_the_tokens(model, params):
  requests = _requests(**params)
  plain = [c.tokens for c in serve.Engine(model, max_len=16, compiler_options={}).run(requests)]
  # A GPU option is a valid XLA option on every platform (a no-op on CPU).
  gpu = serve.Engine(model, max_len=16, compiler_options={"xla_gpu_enable_triton_gemm": False})
  assert gpu.compiler_options == {"xla_gpu_enable_triton_gemm": False}
  assert [c.tokens for c in gpu.run(requests)] == plain
  # An option XLA does not know fails the compilation: the options are passed to it.
  bad = serve.Engine(model, max_len=16, compiler_options={"not_an_xla_option": 1})
  with pytest.raises(Exception, match="not_an_xla_option"):
    bad.run(requests)


@pytest.mark.parametrize("options", [["xla_gpu_enable_triton_gemm"], {1: True}, "fast"])
def test_bad_options_are_refused_at_construction(model, options):
  with pytest.raises(TypeError, match="compiler_options="):
    serve.Engine(model, max_len=16, compiler_options=options)
