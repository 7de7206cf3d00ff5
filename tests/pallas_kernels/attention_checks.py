"""The kernel-against-reference check shared by the attention kernel tests."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drivers import has_hopper_gpu
from oracle import out_rtol
from oracle import tol
from kernel_cases import queries
from kernel_cases import random_step
from kernel_cases import resident_storage
import pallas_kernels
from pallas_kernels import combine_sm90

requires_hopper = pytest.mark.skipif(
    not has_hopper_gpu(), reason="needs an NVIDIA Hopper GPU (compute capability >= 9.0) "
    "to compile and run the Mosaic GPU kernel")


@functools.partial(jax.jit, static_argnames=("window", "scale"))
def _reference(q, k, v, seq_info, n_segments, *, window, scale):
  return pallas_kernels.varlen_attention_reference(q, k, v, seq_info, n_segments,
                                                   window=window, scale=scale)


def check_family(family, rng, *, config, interpret):
  """`family.num_steps` random Steps: kernel (run twice, bitwise equal) against the reference.

  Steps alternate padded/unpadded and with/without owner blocks; real rows must
  be finite and within the storage dtype's tolerance plus one unit of the output's
  precision (`out_rtol`).
  """
  scale = 1.0 / np.sqrt(family.head_dim)
  for index in range(family.num_steps):
    step = random_step(rng, family, pad=index % 3 != 0, allow_blocks=index % 2 == 0)
    k, v = resident_storage(rng, family, step)
    q = queries(rng, family, step)
    args = (q, k, v, jnp.asarray(step.seq_info), jnp.int32(step.n_segments))
    kwargs = dict(window=family.window, scale=scale)
    out = pallas_kernels.varlen_attention(*args, **kwargs, config=config, interpret=interpret)
    again = pallas_kernels.varlen_attention(*args, **kwargs, config=config,
                                            interpret=interpret)
    expected = _reference(*args, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    # Each kernel runs twice and must match bitwise (padding rows included).
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(again, np.float32),
                                  err_msg=step.description)
    real = slice(0, step.n_tokens)
    got = np.asarray(out[real], np.float32)
    want = np.asarray(expected[real], np.float32)
    assert np.isfinite(got).all(), step.description
    np.testing.assert_allclose(got, want, atol=tol(family.dtype), rtol=out_rtol(out.dtype),
                               err_msg=step.description)
    # Padding tokens (NaN queries) get zero rows: `jaxkv.pure.attend` relies on it.
    np.testing.assert_array_equal(np.asarray(out[step.n_tokens:], np.float32), 0.0,
                                  err_msg=step.description)
    if index == 0:
      # No real segment (a refused attend passes n_segments = 0): every row is zero.
      none = pallas_kernels.varlen_attention(*args[:4], jnp.int32(0), **kwargs, config=config,
                                             interpret=interpret)
      np.testing.assert_array_equal(np.asarray(none, np.float32), 0.0,
                                    err_msg=step.description)



def attention_calls(group: int, head_dim: int, config=None) -> list[str]:
  """The custom calls one lowered attention makes: the kernel, then the epilogue kernel
  when the config asks for it (`fused_combine`, not the default) and `combine_sm90`
  serves the head layout (else the epilogue is XLA)."""
  fused = config is not None and config.fused_combine and combine_sm90.supported(
      group=group, head_dim=head_dim)
  return ["mosaic_gpu_v2"] * (2 if fused else 1)


def check_family_patched(module, name, replacement, family, rng, *, config, interpret):
  """`check_family` with `module.name` replaced by `replacement` (a test hook that forces a
  path the call would not take on its own; caches cleared before and after, since the
  hook is read when a call is traced)."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(module, name, replacement)
    jax.clear_caches()
    try:
      check_family(family, rng, config=config, interpret=interpret)
    finally:
      jax.clear_caches()
