"""The facade at kernel-sized heads (issue 3): every verb with the Mosaic GPU kernels.

CONTRACT §11's defaults use head_dim 8, which the compiled kernel refuses (wgmma
needs multiples of 16), so on a GPU host those scenarios skip their
`mosaic_gpu` variant. This scenario uses head_dim 64 with GQA 4 (and issue 12's
layouts: 80/96 with GQA 3/6, 128/256 with GQA 1/2, 128/64 with GQA 7/14; float16
and bfloat16 storage),
an unaligned ring of 12 rows that wraps, growth of the flat layer, a fork, a
rewind, an owner block and a padded `T = W` step, and checks every real row
against the float64 oracle — with the reference, the interpreter and, on a
Hopper GPU, the compiled kernels.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import jaxkv
from scenario_utils import Harness

# (query heads, (KV heads, head dim) of the flat and the ring layer, storage): GQA 4
# at head dim 64, and issue 12's layouts: GQA 3 at head dim 80 and GQA 6 at 96;
# multi-head at 128 and GQA 2 at 256 (Gemma's head dim) in bfloat16; GQA 7 at 128
# (Qwen2.5-7B) and 14 at 64 in bfloat16.
LAYOUTS = [(8, (2, 64), (2, 64), jnp.float16), (6, (2, 80), (1, 96), jnp.float16),
           (4, (4, 128), (2, 256), jnp.bfloat16), (14, (2, 128), (1, 64), jnp.bfloat16)]


@pytest.mark.parametrize("n_q_heads, flat, ring, kv_dtype", LAYOUTS,
                         ids=["g4-d64", "g3-d80-g6-d96", "g1-d128-g2-d256-bf16",
                              "g7-d128-g14-d64-bf16"])
def test_kernel_sized_session_matches_the_oracle(implementation, n_q_heads, flat, ring,
                                                 kv_dtype):
  layers = [jaxkv.LayerConfig(jaxkv.LayerPolicy.flat(), *flat),
            jaxkv.LayerConfig(jaxkv.LayerPolicy.ring(5), *ring)]
  config = jaxkv.CacheConfig(layers, capacity=128, max_seqs=4, max_write=8,
                             kv_dtype=kv_dtype, initial_capacity=8)
  h = Harness(config, implementation=implementation, n_q_heads=n_q_heads)
  a, b = h.new(), h.new()
  h.step([a] * 5 + [b] * 3)                         # mixed prefill
  h.step([a, b, a, b], T=config.step_width)         # a twice, NaN padding
  for _ in range(3):                                 # a passes 12 rows: the ring wraps
    h.step([a] * 2 + [b])
  fork = h.clone(a, h.pos(a) - 1)
  assert fork is not None and h.pos(fork) == h.pos(a) - 1
  assert h.rewind(b, h.pos(b) - 1)
  h.step([fork, a, b, b])
  h.step([a, a, b, b, b], owner_blocks=[(2, 3)])    # b drafts a block after its context
  h.step([fork] * 4 + [a] * 4)                       # grows the flat rows again
  assert h.cache.state.k[0].shape[0] >= h.pos(a)
