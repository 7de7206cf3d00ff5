"""The decode GEMM choice (`gemm=`, CONTRACT §10.8): resolution, refusals, routing, results.

A model built with `gemm="interpret"` runs its output and down projections at decode widths
through `pallas_kernels.skinny_gemm` under the Mosaic GPU interpreter; everything else, and
every projection of a `gemm="xla"` model, is XLA's. The two must compute the same logits up
to bf16 rounding, and the kernel must really run where it should (and only there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import _gemm
from jaxkv import serve
from jaxkv.models import ModelConfig, decoder
from jaxkv.nnx import CachedAttention

from drivers import has_hopper_gpu

# o_proj [128 -> 128] and down_proj [256 -> 128] fit whole 64-column tiles.
CONFIG = ModelConfig.llama(vocab_size=96, hidden_size=128, intermediate_size=256, num_layers=2,
                           num_heads=2, num_kv_heads=1, head_dim=64)


def _model(gemm, *, max_write=16, max_seqs=4, bucket=None):
  cache = CONFIG.cache_config(capacity=64, max_seqs=max_seqs, max_write=max_write,
                              kv_dtype=jnp.bfloat16)
  return decoder.build(CONFIG, cache, seed=3, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                       implementation="reference", gemm=gemm, bucket=bucket)


def test_none_resolves_to_xla_off_hopper_and_a_bad_choice_is_named():
  assert _gemm.resolve_gemm(None) == ("mosaic_gpu" if has_hopper_gpu() else "xla")
  assert _gemm.resolve_gemm("xla") == "xla" and _gemm.resolve_gemm("interpret") == "interpret"
  with pytest.raises(ValueError, match="gemm='cublas'"):
    _gemm.resolve_gemm("cublas")
  with pytest.raises(ValueError, match="gemm='interpret' serves unsharded"):
    _gemm.resolve_gemm("interpret", mesh=object())
  assert _gemm.resolve_gemm(None, mesh=object()) == "xla"


@pytest.mark.skipif(has_hopper_gpu(), reason="the refusal is for machines without Hopper")
def test_explicit_mosaic_gpu_without_hopper_is_refused_before_building():
  with pytest.raises(ValueError, match="gemm='mosaic_gpu' needs a Hopper"):
    _model("mosaic_gpu")


def test_constructors_name_a_bad_gemm():
  cache = CONFIG.cache_config(capacity=64, max_seqs=4, max_write=16)
  with pytest.raises(ValueError, match="gemm='fast'"):
    decoder.Decoder(CONFIG, cache, gemm="fast", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="gemm=1"):
    CachedAttention(cache, 0, features=128, num_heads=2, gemm=1, rngs=nnx.Rngs(0))


def _count_kernel_calls(monkeypatch):
  shapes = []
  real = _gemm.skinny_matmul

  def counting(x, w, **kwargs):
    shapes.append((x.shape, w.shape))
    return real(x, w, **kwargs)

  monkeypatch.setattr(_gemm, "skinny_matmul", counting)
  return shapes


def test_only_output_and_down_projections_at_decode_widths_take_the_kernel(monkeypatch):
  model = _model("interpret")
  assert model.gemm == "interpret"
  shapes = _count_kernel_calls(monkeypatch)
  mlp, attn = model.layers[0].mlp, model.layers[0].attn
  x = jax.random.normal(jax.random.key(0), (16, 128), jnp.bfloat16)
  mlp(x)
  assert shapes == [((16, 256), (256, 128))]          # down only: gate and up stay XLA's
  shapes.clear()
  attn.o_proj(x)
  attn.q_proj(x)
  assert shapes == [((16, 128), (128, 128))]          # o only: q/k/v stay XLA's
  shapes.clear()
  mlp(jnp.zeros((100, 128), jnp.bfloat16))            # 65..128 rows: the 128-row blocks
  assert shapes == [((100, 256), (256, 128))]
  shapes.clear()
  mlp(jnp.zeros((129, 128), jnp.bfloat16))            # wider than 128 rows: XLA's
  assert shapes == []
  dims = (((1,), (0,)), ((), ()))
  f32 = jnp.zeros((16, 256), jnp.float32), jnp.zeros((256, 128), jnp.float32)
  assert not _gemm.serves(*f32, dims)                  # not 16-bit: XLA's
  bf16 = [a.astype(jnp.bfloat16) for a in f32]
  assert _gemm.serves(*bf16, dims)
  assert not _gemm.serves(*bf16, dims, preferred_element_type=jnp.float32)
  assert not _gemm.serves(*bf16, dims, out_sharding="sharded")
  xla = _model("xla")
  shapes.clear()
  xla.layers[0].mlp(x)
  xla.layers[0].attn.o_proj(x)
  assert shapes == []


def test_interpreted_gemm_matches_xla_and_float64_in_the_layers():
  model, xla = _model("interpret"), _model("xla")
  x = jax.random.normal(jax.random.key(1), (16, 256), jnp.bfloat16)
  down_w = np.asarray(model.layers[1].mlp.down_proj.kernel[...], np.float64)
  np.testing.assert_array_equal(down_w, np.asarray(xla.layers[1].mlp.down_proj.kernel[...],
                                                   np.float64))
  got = np.asarray(model.layers[1].mlp.down_proj(x), np.float64)
  want = np.asarray(x, np.float64) @ down_w
  ref_xla = np.asarray(xla.layers[1].mlp.down_proj(x), np.float64)
  # Both one bf16 rounding (2^-8 relative) away from the float64 product.
  np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=1e-3)
  np.testing.assert_allclose(ref_xla, want, rtol=2 ** -8, atol=1e-3)


def test_decoding_with_the_kernel_gives_xlas_logits(monkeypatch):
  """Prefill (16-token steps) and decode through a ModelRunner: logits agree within bf16
  tolerance between the two GEMM choices, and the kernel ran for every layer's o and down."""
  shapes = _count_kernel_calls(monkeypatch)
  runs = {}
  for gemm in ("interpret", "xla"):
    runner = serve.ModelRunner(_model(gemm))
    a, b = runner.seq_new(), runner.seq_new()
    rng = np.random.default_rng(0)
    steps = [([a] * 9 + [b] * 5, rng.integers(0, 96, 14))]
    steps += [([a, b], rng.integers(0, 96, 2)) for _ in range(4)]
    runs[gemm] = [np.asarray(runner.step(ids, list(map(int, toks)))) for ids, toks in steps]
    if gemm == "interpret":
      assert len(shapes) >= 2 * CONFIG.num_layers
      assert {w for _, w in shapes} == {(128, 128), (256, 128)}
      shapes.clear()
  assert shapes == []
  for got, want in zip(runs["interpret"], runs["xla"]):
    assert np.isfinite(got).all()
    # Not bitwise (checked): about a quarter of the bf16 logits differ, by at most 2^-6, one
    # ulp at |logit| in [2, 4) (jax 0.12.1, CPU). Two ulps; 0.05 + 5% allowed 14x that.
    np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=2 ** -5)


@pytest.mark.skipif(not has_hopper_gpu(), reason="needs an NVIDIA Hopper GPU to compile the "
                    "Mosaic GPU GEMM")
def test_compiled_gemm_decodes_with_xlas_logits(monkeypatch):
  """On Hopper, `gemm=None` picks the compiled kernel, which runs and matches XLA's logits."""
  shapes = _count_kernel_calls(monkeypatch)
  runs = {}
  for gemm in (None, "xla"):
    model = _model(gemm)
    assert model.gemm == ("mosaic_gpu" if gemm is None else "xla")
    runner = serve.ModelRunner(model)
    seqs = [runner.seq_new() for _ in range(3)]
    rng = np.random.default_rng(1)
    steps = [([seqs[0]] * 8 + [seqs[1]] * 8, rng.integers(0, 96, 16))]
    steps += [(seqs, rng.integers(0, 96, 3)) for _ in range(4)]
    runs[gemm] = [np.asarray(runner.step(ids, list(map(int, toks)))) for ids, toks in steps]
    assert (len(shapes) >= 2 * CONFIG.num_layers) == (gemm is None)
    shapes.clear()
  for got, want in zip(runs[None], runs["xla"]):
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05)


def test_engine_reports_the_models_gemm():
  from jaxkv.serve.report import gemm_line   # pylint: disable=g-import-not-at-top
  engine = serve.Engine(_model("interpret"), max_len=32)
  assert engine.gemm == "interpret"
  assert gemm_line(engine.gemm).startswith("decode GEMM: gemm='interpret': the Mosaic GPU")
  assert serve.Engine(_model("xla"), max_len=32).gemm == "xla"
  assert gemm_line(None).startswith("decode GEMM: the model's own")


def test_load_model_names_a_bad_gemm_before_reading_the_checkpoint(tmp_path):
  from jaxkv.models import hf   # pylint: disable=g-import-not-at-top
  missing = tmp_path / "no-such-checkpoint"   # a read would raise OSError, not this
  with pytest.raises(ValueError, match="gemm='fastest'"):
    hf.load_model(str(missing), capacity=64, max_seqs=2, max_write=8, gemm="fastest")
