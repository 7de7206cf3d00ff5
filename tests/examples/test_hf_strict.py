"""Loader strictness (issue 9 item 4): a checkpoint that would load wrong is refused, naming the file.

Each test copies a committed fixture to `tmp_path`, breaks one thing, and
expects a `ValueError`/`TypeError` whose message names the file and the key or
tensor. The findings of the issue (lm_head silently replaced by the
embedding, truncated models, unknown layer types, Mistral's window dropped,
NaN-producing rope_theta/eps, raw SafetensorError/JSONDecodeError/
ZeroDivisionError) each have a test here.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxkv.models import hf

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
LOAD = dict(capacity=64, max_seqs=2, max_write=4)


def copy(tmp_path, kind="llama", config=None, tensors=None):
  """The fixture `kind` in tmp_path, its config dict and tensors passed through the editors."""
  out = tmp_path / kind
  shutil.copytree(os.path.join(FIXTURES, f"hf_{kind}"), out)
  os.remove(out / "logits.npz")
  if config is not None:
    cfg = json.loads((out / "config.json").read_text())
    cfg = config(cfg) or cfg
    (out / "config.json").write_text(json.dumps(cfg))
  if tensors is not None:
    arrays = load_file(str(out / "model.safetensors"))
    arrays = tensors(arrays) or arrays
    save_file(arrays, str(out / "model.safetensors"))
  return str(out)


def refused(checkpoint, *patterns, error=ValueError):
  """Asserts load_model raises `error` whose message contains every pattern; returns it."""
  with pytest.raises(error) as info:
    hf.load_model(checkpoint, **LOAD)
  for p in patterns:
    assert p in str(info.value), (p, str(info.value))
  return str(info.value)


def set_key(**kv):
  return lambda cfg: {**cfg, **kv}


# ----------------------------------------------------------------- the findings


def test_untied_head_without_lm_head_is_refused(tmp_path):
  def edit(t):
    del t["lm_head.weight"]
  ckpt = copy(tmp_path, tensors=edit)
  refused(ckpt, "config.json", "lm_head.weight", "tie_word_embeddings")


def test_fewer_layers_than_the_checkpoint_is_refused(tmp_path):
  ckpt = copy(tmp_path, config=set_key(num_hidden_layers=1))
  refused(ckpt, "config.json", "num_hidden_layers=1", "holds 2 layers")


def test_more_layers_than_the_checkpoint_is_refused(tmp_path):
  ckpt = copy(tmp_path, config=set_key(num_hidden_layers=3))
  refused(ckpt, "config.json", "num_hidden_layers=3", "holds 2 layers")


def test_absurd_layer_count_is_refused_at_once(tmp_path):
  import time   # pylint: disable=g-import-not-at-top
  ckpt = copy(tmp_path, config=set_key(num_hidden_layers=1_000_000))
  start = time.perf_counter()
  refused(ckpt, "config.json", "num_hidden_layers=1000000")
  assert time.perf_counter() - start < 20   # it used to build for more than 10 minutes


def test_unknown_layer_type_is_refused(tmp_path):
  def edit(cfg):
    cfg["layer_types"][1] = "chunked_attention"
  refused(copy(tmp_path, "gemma3", config=edit), "config.json", "layer_types[1]",
          "'chunked_attention'")


def test_mistral_sliding_window_is_every_layers_ring():
  config = hf.read_config(os.path.join(FIXTURES, "hf_mistral"))
  assert config.sliding_window == 4 and config.layer_types == ("sliding", "sliding")
  assert [l.policy.window for l in config.cache_layers()] == [4, 4]


def test_mistral_without_window_is_full_attention(tmp_path):
  config = hf.read_config(copy(tmp_path, "mistral", config=set_key(sliding_window=None)))
  assert config.sliding_window is None and config.layer_types == ("full", "full")


@pytest.mark.parametrize("edit, key", [
    (lambda c: c["rope_parameters"].update(rope_theta=0), "rope_parameters.rope_theta"),
    (lambda c: c["rope_parameters"].update(rope_theta=-1.0), "rope_parameters.rope_theta"),
    (set_key(rms_norm_eps=-1e-6), "rms_norm_eps"),
    (set_key(rms_norm_eps=0), "rms_norm_eps"),
], ids=["theta-0", "theta-negative", "eps-negative", "eps-0"])
def test_nan_producing_values_are_refused(tmp_path, edit, key):
  refused(copy(tmp_path, config=edit), "config.json", key)


def test_legacy_rope_theta_zero_is_refused(tmp_path):
  def edit(cfg):
    del cfg["rope_parameters"]
    cfg["rope_theta"] = 0.0
  refused(copy(tmp_path, config=edit), "config.json", "rope_theta")


def test_corrupt_safetensors_names_the_file(tmp_path):
  ckpt = copy(tmp_path)
  path = os.path.join(ckpt, "model.safetensors")
  with open(path, "r+b") as f:
    f.write(b"\xff" * 16)   # header length and the start of the header garbled
  refused(ckpt, path)


def test_truncated_safetensors_names_the_file(tmp_path):
  ckpt = copy(tmp_path)
  path = os.path.join(ckpt, "model.safetensors")
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    f.truncate(size - 100)
  refused(ckpt, path)


def test_corrupt_config_json_names_the_file(tmp_path):
  ckpt = copy(tmp_path)
  with open(os.path.join(ckpt, "config.json"), "a") as f:
    f.write("}{")
  refused(ckpt, os.path.join(ckpt, "config.json"), "JSON")


def test_zero_heads_is_refused_naming_the_key(tmp_path):
  refused(copy(tmp_path, config=set_key(num_attention_heads=0)), "config.json",
          "num_attention_heads")


# ----------------------------------------------------------------- keys that change the math


@pytest.mark.parametrize("kind, edit, key", [
    ("gemma3", set_key(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    ("llama", set_key(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    ("llama", set_key(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ("llama", set_key(attention_bias=True), "attention_bias"),
    ("llama", set_key(mlp_bias=True), "mlp_bias"),
    ("llama", set_key(hidden_act="gelu"), "hidden_act"),
    ("qwen3", set_key(attention_bias=True), "attention_bias"),
    ("gemma3", set_key(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("llama", lambda c: c["rope_parameters"].update(rope_type="yarn"), "rope_type"),
    ("llama", lambda c: c["rope_parameters"].update(mrope_section=[1, 1]), "mrope_section"),
    ("mistral", set_key(layer_types=["full_attention"] * 2), "layer_types"),
    ("llama", set_key(some_new_option=1), "some_new_option"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_keys_that_change_the_math_are_refused(tmp_path, kind, edit, key):
  refused(copy(tmp_path, kind, config=edit), "config.json", key)


def test_harmless_keys_are_accepted(tmp_path):
  ckpt = copy(tmp_path, config=set_key(torch_dtype="float32", use_cache=False,
                                       _name_or_path="x", max_length=20, pretraining_tp=1))
  # They change nothing: the config read is the unedited fixture's.
  assert hf.read_config(ckpt) == hf.read_config(os.path.join(FIXTURES, "hf_llama"))


@pytest.mark.parametrize("kind, edit, key, error", [
    ("llama", set_key(vocab_size="128"), "vocab_size", TypeError),
    ("llama", set_key(hidden_size=32.0), "hidden_size", TypeError),
    ("llama", set_key(num_hidden_layers=True), "num_hidden_layers", TypeError),
    ("llama", set_key(num_hidden_layers=2**31 - 1), "num_hidden_layers", ValueError),
    ("llama", set_key(tie_word_embeddings="no"), "tie_word_embeddings", TypeError),
    ("llama", set_key(num_key_value_heads=3), "num_attention_heads", ValueError),
    ("llama", set_key(head_dim=7), "head_dim", ValueError),
    ("llama", set_key(head_dim=2**31 - 2), "head_dim", ValueError),
    ("qwen2", set_key(hidden_size=2**31 - 4), "head_dim", ValueError),
    ("llama", set_key(eos_token_id=128), "eos_token_id", ValueError),
    ("llama", set_key(eos_token_id=[2, -1]), "eos_token_id", ValueError),
    ("llama", set_key(bos_token_id=10**12), "bos_token_id", ValueError),
    ("llama", set_key(dtype="int8"), "dtype", ValueError),
    ("llama", set_key(rms_norm_eps=float("nan")), "rms_norm_eps", ValueError),
    ("llama", lambda c: {k: v for k, v in c.items() if k != "vocab_size"}, "vocab_size",
     ValueError),
    ("llama", set_key(model_type="bert"), "model_type", ValueError),
    ("gemma3", set_key(sliding_window=None), "sliding_window", ValueError),
    ("mistral", set_key(sliding_window=2**31 - 1), "sliding_window", ValueError),
    ("gemma3", set_key(query_pre_attn_scalar=0), "query_pre_attn_scalar", ValueError),
    ("gemma3", set_key(final_logit_softcapping=-1.0), "final_logit_softcapping", ValueError),
    ("qwen2", set_key(use_sliding_window=False), "layer_types", ValueError),
    ("qwen2", set_key(layer_types=["full_attention"]), "layer_types", ValueError),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_values_are_refused_naming_file_and_key(tmp_path, kind, edit, key, error):
  refused(copy(tmp_path, kind, config=edit), "config.json", key, error=error)


def test_llama3_rope_needs_every_setting(tmp_path):
  def edit(cfg):
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0}
  refused(copy(tmp_path, config=edit), "config.json", "original_max_position_embeddings")


# ----------------------------------------------------------------- tensors


def test_wrong_shape_names_tensor_file_and_config(tmp_path):
  def edit(t):
    t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]
  refused(copy(tmp_path, tensors=edit), "model.safetensors", "model.layers.0.mlp.up_proj.weight",
          "config.json", "[63, 32]")


def test_leftover_tensor_is_refused(tmp_path):
  def edit(t):
    t["model.extra_norm.weight"] = np.ones(32, np.float32)
  refused(copy(tmp_path, tensors=edit), "model.safetensors", "model.extra_norm.weight")


def test_tied_head_with_an_lm_head_tensor_is_refused(tmp_path):
  def edit(t):
    t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1
  refused(copy(tmp_path, "gemma3", tensors=edit), "model.safetensors", "lm_head.weight",
          "tie_word_embeddings")


def test_non_finite_weight_is_refused(tmp_path):
  def edit(t):
    t["model.norm.weight"][3] = np.nan
  refused(copy(tmp_path, tensors=edit), "model.safetensors", "model.norm.weight", "NaN")


def test_integer_tensor_is_refused(tmp_path):
  def edit(t):
    t["model.norm.weight"] = t["model.norm.weight"].astype(np.int32)
  refused(copy(tmp_path, tensors=edit), "model.safetensors", "model.norm.weight", "I32")


def test_derived_rotary_buffers_are_ignored(tmp_path):
  def edit(t):
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
  model, config, _ = hf.load_model(copy(tmp_path, tensors=edit), **LOAD)
  plain, plain_config, _ = hf.load_model(os.path.join(FIXTURES, "hf_llama"), **LOAD)
  # Ignored, not applied: the model's weights and config are the unedited checkpoint's.
  assert config == plain_config
  got, want = jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(plain))
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_multimodal_gemma3_wrapper_loads_the_text_model(tmp_path):
  plain = os.path.join(FIXTURES, "hf_gemma3")
  def wrap(cfg):
    return {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
            "text_config": cfg, "vision_config": {"hidden_size": 8}, "image_token_index": 5}
  def rename(t):
    out = {"language_model." + k: v for k, v in t.items()}
    out["vision_tower.patch.weight"] = np.ones((2, 2), np.float32)
    return out
  ckpt = copy(tmp_path, "gemma3", config=wrap, tensors=rename)
  model, config, _ = hf.load_model(ckpt, **LOAD)
  assert config == hf.read_config(plain)
  want = hf.read_tensors(plain)["model.embed_tokens.weight"]
  np.testing.assert_array_equal(np.asarray(model.embed.embedding[...]), want)
  # Keys inside text_config are named with their prefix.
  bad = copy(tmp_path / "bad", "gemma3", config=lambda c: wrap({**c, "rope_theta": 0}),
             tensors=rename)
  refused(bad, "config.json", "text_config.rope_theta")


# ----------------------------------------------------------------- dtype="auto"


def _as_bf16(tmp_path, with_config_dtype):
  import ml_dtypes   # pylint: disable=g-import-not-at-top
  def config(cfg):
    cfg.pop("dtype")
    if with_config_dtype:
      cfg["torch_dtype"] = "bfloat16"
  return copy(tmp_path, config=config,
              tensors=lambda t: {k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()})


@pytest.mark.parametrize("with_config_dtype", [True, False], ids=["config", "tensors"])
def test_auto_dtype_follows_the_checkpoint(tmp_path, with_config_dtype):
  import jax   # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp   # pylint: disable=g-import-not-at-top
  ckpt = _as_bf16(tmp_path, with_config_dtype)
  model, _, cache_config = hf.load_model(ckpt, dtype="auto", kv_dtype="auto", **LOAD)
  dtypes = {x.dtype for x in jax.tree.leaves(hf_state(model))}
  assert dtypes == {jnp.dtype(jnp.bfloat16)} and cache_config.kv_dtype == jnp.bfloat16
  # An explicit dtype upcasts on the host: the bfloat16 values, exactly, in float32.
  model32, _, _ = hf.load_model(ckpt, dtype=jnp.float32, **LOAD)
  got = np.asarray(model32.layers[0].attn.q_proj.kernel[...])
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got, np.asarray(model.layers[0].attn.q_proj.kernel[...],
                                                np.float32))


def hf_state(model):
  from flax import nnx   # pylint: disable=g-import-not-at-top
  return nnx.state(model, nnx.Param)


def test_bad_dtype_argument_is_refused(tmp_path):
  with pytest.raises(ValueError, match="dtype='int8'"):
    hf.load_model(os.path.join(FIXTURES, "hf_llama"), dtype="int8", **LOAD)
  with pytest.raises(TypeError, match="param_dtype"):
    hf.load_model(os.path.join(FIXTURES, "hf_llama"), param_dtype="nonsense", **LOAD)


def test_rope_that_overflows_float32_is_refused(tmp_path):
  def edit(cfg):
    cfg["rope_parameters"] = {"rope_type": "linear", "rope_theta": 1e-30, "factor": 1e-30}
  refused(copy(tmp_path, config=edit), "config.json", "rope_parameters", "non-finite")


def test_huge_integer_float_field_is_refused(tmp_path):
  refused(copy(tmp_path, config=set_key(rms_norm_eps=10**400)), "config.json", "rms_norm_eps")
