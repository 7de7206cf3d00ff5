"""The production configurations under the Mosaic GPU interpreter, on CPU.

The compiled variants of these shapes run only on a Hopper GPU (benchmarks/gpu_checks.sh);
here the same page sizes and head shapes go through the interpreter, so a change that breaks
them shows in CI: pages of 64 and 128 rows at head dim 128 (the paged serving default), and
the end-to-end benchmark model's attention (Llama 3.2 1B: 32 query heads, 8 K/V heads, head
dim 64) over columns. One or two short steps each: the interpreter's cost is mostly tracing.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from attention_checks import check_family
from kernel_cases import Family
from paged_checks import check_attention
from paged_checks import check_write

# (family, page size): the compiled paged tests' page sizes at head dim 128.
PAGED_CASES = [
    (Family("bf16-g1-d128", jnp.bfloat16, None, 4, 4, 128, width=4, max_seqs=2, capacity=128,
            num_steps=1), 64),
    (Family("bf16-g4-d128", jnp.bfloat16, None, 8, 2, 128, width=4, max_seqs=2, capacity=256,
            num_steps=1), 128),
]
LLAMA_1B = Family("bf16-llama1b-g4-d64", jnp.bfloat16, None, 32, 8, 64, width=4, max_seqs=2,
                  capacity=64, num_steps=2)


@pytest.mark.parametrize("family, page_size", PAGED_CASES, ids=lambda x: str(x))
def test_interpreted_paged_attention_at_production_page_sizes(family, page_size, rng):
  check_attention(family, page_size, rng, config=None, interpret=True)


@pytest.mark.parametrize("family, page_size", PAGED_CASES[:2], ids=lambda x: str(x))
def test_interpreted_paged_write_at_production_page_sizes(family, page_size, rng):
  check_write(dataclasses.replace(family, num_steps=1), page_size, rng, interpret=True)


def test_interpreted_attention_with_the_e2e_models_heads(rng):
  check_family(LLAMA_1B, rng, config=None, interpret=True)
