"""The MLP's wide-step path (gate and up kept apart for XLA, `decoder._MERGE_ROWS`) computes the same function."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.models import ModelConfig
from jaxkv.models import decoder


def test_wide_rows_equal_narrow_rows():
  config = ModelConfig.llama(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                             num_heads=2, num_kv_heads=1, head_dim=8)
  mlp = decoder.MLP(config, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  rows = decoder._MERGE_ROWS + 8   # pylint: disable=protected-access
  x = jax.random.normal(jax.random.key(0), (rows, config.hidden_size), jnp.float32)
  wide = mlp(x)                              # above the threshold: the dots kept apart
  half = rows // 2
  narrow = jnp.concatenate([mlp(x[:half]), mlp(x[half:])])   # below it: merged by XLA
  # Independent oracle: the gated MLP in NumPy float64.
  w = {n: np.asarray(getattr(mlp, n).kernel[...], np.float64)
       for n in ("gate_proj", "up_proj", "down_proj")}
  xs = np.asarray(x, np.float64)
  g = xs @ w["gate_proj"]
  want = ((g / (1 + np.exp(-g))) * (xs @ w["up_proj"])) @ w["down_proj"]
  np.testing.assert_allclose(np.asarray(wide), want, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(narrow), want, rtol=1e-4, atol=1e-5)
  assert "optimization_barrier" in str(jax.make_jaxpr(mlp)(x))
  assert "optimization_barrier" not in str(jax.make_jaxpr(mlp)(x[:half]))
