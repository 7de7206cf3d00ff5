"""`jaxkv.models.hf` defaults: the checkpoint's dtype, paged storage from load_model, hub ids
resolved offline from a fake Hugging Face cache, and jaxkv.serve.loading.load_for_serving's model the engine takes."""

from __future__ import annotations

import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from jaxkv import serve
from jaxkv.models import hf
from jaxkv.serve import loading

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")
LLAMA = os.path.join(FIXTURES, "hf_llama")
LOAD = dict(capacity=128, max_seqs=2, max_write=8)


def _bf16_copy(path) -> str:
  """The Llama fixture saved as transformers saves a bfloat16 model: bf16 tensors, dtype key."""
  os.makedirs(path)
  for name in os.listdir(LLAMA):
    if name != "model.safetensors":
      shutil.copy(os.path.join(LLAMA, name), os.path.join(path, name))
  tensors = safetensors.numpy.load_file(os.path.join(LLAMA, "model.safetensors"))
  safetensors.numpy.save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()},
                              os.path.join(path, "model.safetensors"))
  with open(os.path.join(LLAMA, "config.json"), encoding="utf-8") as f:
    config = json.load(f)
  config["dtype"] = "bfloat16"
  with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f)
  return str(path)


def _dtypes(model) -> set:
  from flax import nnx   # pylint: disable=g-import-not-at-top
  return {leaf.dtype for leaf in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))}


def test_a_bf16_checkpoint_loads_as_bf16_by_default(tmp_path):
  ckpt = _bf16_copy(tmp_path / "bf16")
  model, _, cache_config = hf.load_model(ckpt, **LOAD)
  assert _dtypes(model) == {jnp.dtype(jnp.bfloat16)} and model.dtype == jnp.bfloat16
  assert cache_config.kv_dtype == jnp.bfloat16
  model32, _, cache32 = hf.load_model(ckpt, dtype=jnp.float32, **LOAD)   # asked for: float32
  assert _dtypes(model32) == {jnp.dtype(jnp.float32)} and cache32.kv_dtype == jnp.float32
  # The float32 fixture stays float32.
  assert hf.load_model(LLAMA, **LOAD)[2].kv_dtype == jnp.float32


def test_load_model_reaches_paged_storage_and_a_kv_budget():
  _, _, paged = hf.load_model(LLAMA, page_size=16, max_seq_len=64, **LOAD)
  assert (paged.page_size, paged.capacity, paged.max_seq_len) == (16, 128, 64)
  # 2 flat layers x 2 (K, V) x 2 heads x 8 x 4 bytes = 256 bytes a position; pages of 64.
  budget = 20 * 64 * 256
  _, _, sized = hf.load_model(LLAMA, kv_budget_bytes=budget, max_seqs=2, max_write=8)
  assert sized.page_size == 64 and sized.capacity == (20 - 2 - 1) * 64
  with pytest.raises(ValueError, match="exactly one of capacity=128 and kv_budget_bytes=1000"):
    hf.load_model(LLAMA, kv_budget_bytes=1000, **LOAD)


def test_read_config_needs_no_sizes():
  config = hf.read_config(LLAMA)
  assert (config.num_layers, config.max_position_embeddings, config.eos_token_ids) == (2, 128, (2,))


def _fake_hub(root, repo: str, source: str, commit: str = "0123456789abcdef" * 2 + "01234567"):
  """A Hugging Face cache holding one snapshot of `repo`: `source`'s files, as huggingface_hub
  lays them out (`models--org--name/refs/main` naming `snapshots/<commit>/`)."""
  base = os.path.join(root, "models--" + repo.replace("/", "--"))
  os.makedirs(os.path.join(base, "refs"))
  with open(os.path.join(base, "refs", "main"), "w", encoding="ascii") as f:
    f.write(commit)
  shutil.copytree(source, os.path.join(base, "snapshots", commit))
  return os.path.join(base, "snapshots", commit)


def test_a_model_id_resolves_offline_from_the_hub_cache(tmp_path, monkeypatch):
  pytest.importorskip("huggingface_hub", reason="hub ids need huggingface_hub (the serve extra)")
  snapshot = _fake_hub(tmp_path / "hub", "jaxkv-test/tiny-llama", LLAMA)
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  assert os.path.samefile(hf.resolve_checkpoint("jaxkv-test/tiny-llama"), snapshot)
  assert hf.read_config("jaxkv-test/tiny-llama") == hf.read_config(LLAMA)
  model, _, _ = hf.load_model("jaxkv-test/tiny-llama", **LOAD)
  want = safetensors.numpy.load_file(os.path.join(LLAMA, "model.safetensors"))
  np.testing.assert_array_equal(np.asarray(model.embed.embedding[...]),
                                want["model.embed_tokens.weight"])
  with pytest.raises(ValueError, match=r"'jaxkv-test/absent'.*HF_HUB_OFFLINE is set"):
    hf.resolve_checkpoint("jaxkv-test/absent")
  # HF_HOME/hub is the cache when HF_HUB_CACHE is unset.
  monkeypatch.delenv("HF_HUB_CACHE")
  monkeypatch.setenv("HF_HOME", str(tmp_path))
  assert os.path.samefile(hf.resolve_checkpoint("jaxkv-test/tiny-llama"), snapshot)


def test_paths_that_are_not_directories_are_named(tmp_path):
  with pytest.raises(ValueError, match="no such directory"):
    hf.resolve_checkpoint(str(tmp_path / "missing" / "dir"))
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match="is a file"):
    hf.resolve_checkpoint(str(tmp_path / "file"))


def test_a_missing_optional_package_names_the_extra(monkeypatch):
  pytest.importorskip("tokenizers", reason="the tokenizer is read before jinja2 goes missing")
  from jaxkv.tokenizer import Tokenizer   # pylint: disable=g-import-not-at-top
  tok = Tokenizer.from_checkpoint(LLAMA)
  # A None entry in sys.modules makes the import raise ImportError, as a missing package does.
  monkeypatch.setitem(sys.modules, "jinja2", None)
  with pytest.raises(ImportError, match=r"chat template needs .*jinja2.*jaxkv\[serve\]"):
    tok.render_chat([{"role": "user", "content": "x"}])
  monkeypatch.setitem(sys.modules, "huggingface_hub", None)
  monkeypatch.setitem(sys.modules, "tokenizers", None)
  with pytest.raises(ImportError, match=r"huggingface_hub.*pip install \"jaxkv\[serve\]\""):
    hf.resolve_checkpoint("org/model")
  with pytest.raises(ImportError, match=r"tokenizers.*pip install \"jaxkv\[serve\]\""):
    hf.load_tokenizer(LLAMA)


def test_load_for_serving_gives_what_the_engine_takes():
  model, tokenizer, plan = loading.load_for_serving(LLAMA, kv_cache_memory=1 << 20, max_write=16)
  assert plan.storage == "paged" and plan.max_len == 128 and plan.model == LLAMA
  assert model.cache_config == plan.cache_config and tokenizer.eos_ids == (2, 7)
  engine = serve.Engine(model, max_len=plan.max_len, prefix_cache=plan.prefix_caching)
  assert engine.max_len == 128 and engine.config.page_size == 64
  with pytest.raises(ValueError, match="max_len=128 .max_len argument. does not fit"):
    loading.load_for_serving(LLAMA, kv_cache_memory=1 << 12, max_len=128)
  with pytest.raises(ValueError, match="max_len=4096 is past the checkpoint's "
                                       "max_position_embeddings=128"):
    loading.load_for_serving(LLAMA, kv_cache_memory=1 << 20, max_len=4096)
