"""The scalable loader (issue 14 item 5): a sharded checkpoint onto a 4-device mesh, shard by shard.

The checkpoint is made in tmp_path from the Llama fixture (KV heads raised to
4 so every attention and MLP weight splits four ways) and written as three
safetensors files plus `model.safetensors.index.json`. Loading it with a
4-device `"tp"` mesh must (a) never put a full copy of a split weight on any
device, nor read one into host memory, (b) give every device exactly its
shard, and (c) hold bitwise the values an unsharded load of the same files
holds. conftest.py forces four host devices before JAX starts.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P
from safetensors.numpy import load_file, save_file

from jaxkv.models import hf, param_spec
from jaxkv.models import safetensors_io

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
LOAD = dict(capacity=64, max_seqs=2, max_write=4)
N = 4


def _sharded_checkpoint(tmp_path):
  out = tmp_path / "ckpt"
  shutil.copytree(os.path.join(FIXTURES, "hf_llama"), out)
  os.remove(out / "logits.npz")
  cfg = json.loads((out / "config.json").read_text())
  assert cfg["num_attention_heads"] == N
  cfg["num_key_value_heads"] = N
  (out / "config.json").write_text(json.dumps(cfg))
  tensors = load_file(str(out / "model.safetensors"))
  os.remove(out / "model.safetensors")
  rng = np.random.default_rng(0)
  kv = N * cfg["head_dim"]
  for name in list(tensors):
    if name.endswith(("k_proj.weight", "v_proj.weight")):
      tensors[name] = (0.15 * rng.standard_normal((kv, cfg["hidden_size"]))).astype(np.float32)
  names = sorted(tensors)
  weight_map = {}
  for i, group in enumerate(np.array_split(np.array(names), 3)):
    file = f"model-{i + 1:05d}-of-00003.safetensors"
    save_file({str(n): tensors[str(n)] for n in group}, str(out / file))
    weight_map.update({str(n): file for n in group})
  (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  return str(out)


def test_sharded_checkpoint_loads_shard_by_shard(tmp_path, monkeypatch):
  if len(jax.devices()) < N:
    pytest.skip(f"needs {N} devices (conftest forces them on CPU)")
  ckpt = _sharded_checkpoint(tmp_path)
  mesh = jax.make_mesh((N,), ("tp",), devices=jax.devices()[:N], axis_types=(AxisType.Auto,))
  reference, _, _ = hf.load_model(ckpt, **LOAD)   # unsharded, before recording

  puts, reads = [], []
  device_put, read = jax.device_put, safetensors_io.Checkpoint.read

  def recording_put(x, *args, **kwargs):
    if isinstance(x, np.ndarray):
      puts.append(x.shape)
    return device_put(x, *args, **kwargs)

  def recording_read(self, name, *args, **kwargs):
    out = read(self, name, *args, **kwargs)
    reads.append((name, out.shape))
    return out

  monkeypatch.setattr(jax, "device_put", recording_put)
  monkeypatch.setattr(safetensors_io.Checkpoint, "read", recording_read)
  model, _, _ = hf.load_model(ckpt, mesh=mesh, **LOAD)
  monkeypatch.undo()

  leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
  ref_leaves = jax.tree.leaves(nnx.state(reference, nnx.Param))
  split_shapes, split_names, replicated_puts = set(), set(), 0
  for (path, leaf), ref in zip(leaves, ref_leaves):
    spec = param_spec(path)
    np.testing.assert_array_equal(np.asarray(leaf), np.asarray(ref))   # same bytes, same values
    if spec == P():
      replicated_puts += N
      continue
    axis = list(spec).index("tp")
    shard = list(leaf.shape)
    shard[axis] //= N
    assert {s.data.shape for s in leaf.addressable_shards} == {tuple(shard)}, path
    assert len({s.device for s in leaf.addressable_shards}) == N
    split_shapes.add(tuple(leaf.shape))
    split_names.add(hf.hf_name(path)[0])
  assert len(split_names) == 2 * 7   # q, k, v, o, gate, up, down in each of 2 layers
  # No device ever received, and the host never read, a full copy of a split weight.
  assert puts and not split_shapes & set(puts), puts
  assert len(puts) == replicated_puts + N * len(split_names)
  for name, shape in reads:
    if name in split_names:
      full = hf.expected_tensors(model.config)[name]
      assert int(np.prod(shape)) * N == int(np.prod(full)), (name, shape)


def test_index_listing_a_tensor_in_the_wrong_file_is_refused(tmp_path):
  ckpt = _sharded_checkpoint(tmp_path)
  index = os.path.join(ckpt, "model.safetensors.index.json")
  with open(index) as f:
    weight_map = json.load(f)["weight_map"]
  name = next(n for n, f in weight_map.items() if f.startswith("model-00003"))
  weight_map[name] = "model-00001-of-00003.safetensors"
  with open(index, "w") as f:
    json.dump({"weight_map": weight_map}, f)
  with pytest.raises(ValueError, match="does not hold that tensor") as info:
    hf.load_model(ckpt, **LOAD)
  assert index in str(info.value) and name in str(info.value)
