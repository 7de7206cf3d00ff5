"""The attention epilogue kernel (`combine_sm90`, opt-in) against the XLA epilogue and the reference.

`VarlenAttentionConfig(fused_combine=True)` runs the epilogue as a Mosaic GPU
kernel where it serves the head layout. These tests pin down which layouts it
serves, that it matches the reference and the XLA epilogue on steps with
splits, padding and owner blocks, and that the compiled path lowers to the two
Mosaic GPU calls for the layouts it serves.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_checks import attention_calls
from attention_checks import check_family
from kernel_cases import Family
from kernel_cases import queries
from kernel_cases import random_step
from kernel_cases import resident_storage
import pallas_kernels
from pallas_kernels import combine_sm90
from pallas_kernels import config as config_lib

SPLITS = config_lib.VarlenAttentionConfig(
    block_q=8, block_k=8, num_stages=2, split_len=8, split_budget=3, max_splits=3,
    max_split_tokens=4, sort_items=False, use_wgmma=False, fused_combine=True)
# G = 4 and 1 (a program of 16 and 64 tokens: two barrier chunks), head dims 64 and 32. fp16:
# short histories give outputs near |2|, where one bf16 rounding of the output exceeds 1e-2.
FAMILIES = [
    Family("fp16-flat-gqa8x2-d64", jnp.float16, None, 8, 2, 64, width=12, max_seqs=4,
           capacity=48, num_steps=4),
    Family("fp16-ring6-mha-d32", jnp.float16, 6, 2, 2, 32, width=6, max_seqs=3, capacity=40,
           num_steps=4),
]


@pytest.mark.parametrize("group, head_dim, served", [
    (1, 64, True), (1, 32, True), (2, 64, True), (4, 64, True), (8, 128, True),
    (16, 80, True), (64, 64, True), (1, 96, True),
    (1, 16, False),   # 64 bytes per token: less than a 128-byte TMA unit
    (1, 80, False),   # 320 bytes
    (3, 64, False), (5, 64, False), (6, 96, False), (7, 128, False),   # G does not divide 64
])
def test_supported_layouts(group, head_dim, served):
  assert combine_sm90.supported(group=group, head_dim=head_dim) is served


@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_kernel_epilogue_matches_reference_with_splits(family, rng):
  check_family(family, rng, config=SPLITS, interpret=True)


def _steps(family, rng):
  """Three random steps (plain, padded, padded with owner blocks) of `family`, each as
  `(step, run)`: `run(config)` is the interpreted kernel's output on that step."""
  scale = 1.0 / np.sqrt(family.head_dim)
  for index in range(3):
    step = random_step(rng, family, pad=index != 0, allow_blocks=index == 2)
    k, v = resident_storage(rng, family, step)
    q = queries(rng, family, step).astype(jnp.float32)
    args = (q, k, v, jnp.asarray(step.seq_info), jnp.int32(step.n_segments))
    yield step, lambda config, args=args: np.asarray(pallas_kernels.varlen_attention(
        *args, window=family.window, scale=scale, config=config, interpret=True))


@pytest.mark.parametrize("family", FAMILIES[:1], ids=str)
def test_both_epilogues_agree(family, rng):
  """Same partials, two epilogues: outputs agree to float32 rounding (both merge in float32)."""
  unfused = dataclasses.replace(SPLITS, fused_combine=False)
  for step, run in _steps(family, rng):
    fused, xla = run(SPLITS), run(unfused)
    np.testing.assert_allclose(fused, xla, rtol=1e-5, atol=1e-6, err_msg=step.description)
    np.testing.assert_array_equal(fused[step.n_tokens:], 0.0)


def _shapes(num_tokens, group, num_kv_heads, head_dim, dtype=jnp.bfloat16):
  cache = jax.ShapeDtypeStruct((256, 5, num_kv_heads, head_dim), dtype)
  return (jax.ShapeDtypeStruct((num_tokens, group * num_kv_heads, head_dim), dtype), cache,
          cache, jax.ShapeDtypeStruct((num_tokens, 5), jnp.int32),
          jax.ShapeDtypeStruct((), jnp.int32))


# (tokens, G, KV heads, head dim): decode and prefill widths of the e2e model, MHA with a
# partial last token block, a wide group.
@pytest.mark.parametrize("tokens, group, num_kv_heads, head_dim", [
    (64, 4, 8, 64), (2048, 4, 8, 64), (40, 1, 8, 64), (8, 8, 8, 128), (16, 3, 2, 64)])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "xla"])
def test_compiled_path_lowers_to_kernel_and_epilogue(tokens, group, num_kv_heads, head_dim,
                                                     fused):
  # Mosaic GPU checks TMA shapes and register layouts while lowering, on any machine.
  config = config_lib.VarlenAttentionConfig(block_k=128 if head_dim == 64 else 64,
                                            fused_combine=fused)
  attend = jax.jit(functools.partial(pallas_kernels.varlen_attention, window=None, scale=0.1,
                                     config=config))
  text = attend.trace(*_shapes(tokens, group, num_kv_heads, head_dim)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert re.findall(r"custom_call @(\w+)", text) == attention_calls(group, head_dim, config)


@pytest.mark.parametrize("tokens", [64, 512, 2048])
def test_step_plan_has_no_loop_up_to_the_e2e_prefill_width(tokens):
  # A `while` in the call (searchsorted's default scan: ~12 iterations at 2,048 tokens)
  # is walked by the host on a GPU; the plan's searches are fused compares instead.
  attend = jax.jit(functools.partial(pallas_kernels.varlen_attention, window=None, scale=0.1))
  text = attend.trace(*_shapes(tokens, 4, 8, 64)).lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.while" not in text


@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_direct_merge_of_narrow_steps_matches_reference(family, rng):
  """Steps of at most `max_split_tokens` tokens merge every token over its splits (no
  scatter); with splits, padding and owner blocks they match the reference."""
  direct = dataclasses.replace(SPLITS, fused_combine=False, max_split_tokens=64)
  assert family.width <= direct.max_split_tokens
  check_family(family, rng, config=direct, interpret=True)
