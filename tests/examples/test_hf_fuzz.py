"""A fuzz of the Hugging Face loader: corrupt, truncated and perturbed checkpoints.

Each case copies a committed fixture to a fresh folder, applies one seeded
random mutation (a config field set to an odd value or removed, an unknown
key added, config.json or a safetensors file truncated or with bytes flipped,
a sharded checkpoint's index damaged) and loads it. The only outcomes allowed
are a loaded model, or a `ValueError`/`TypeError` whose message names a file of
that checkpoint (by its full path). Anything else (KeyError, IndexError,
SafetensorError, OverflowError, a RuntimeWarning turned error, ...) fails.

`JAXKV_FUZZ_CASES` (default 40 per group) sets the case count for longer runs.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxkv.models import hf

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
CASES = int(os.environ.get("JAXKV_FUZZ_CASES", "40"))
LOAD = dict(capacity=32, max_seqs=2, max_write=4)
ODD_VALUES = [0, -1, 1, 2, 3, 7, 2**30, 2**31 - 1, 2**31, 2**63, 10**400, 1.5, -0.5, 1e-300,
              1e308, float("inf"), float("nan"), None, True, False, "", "12", "auto", [], [1],
              [None], {}, {"a": 1},
              {"rope_type": "linear"}, {"rope_type": "llama3", "factor": 2.0}]


def _copy(tmp_path, kind, case):
  out = tmp_path / f"{kind}_{case}"
  shutil.copytree(os.path.join(FIXTURES, f"hf_{kind}"), out)
  os.remove(out / "logits.npz")
  return str(out)


def _paths(node, prefix=()):
  """Every key path of a JSON tree (dict keys and list indices)."""
  if isinstance(node, dict):
    items = node.items()
  elif isinstance(node, list):
    items = enumerate(node)
  else:
    return
  for key, value in items:
    yield prefix + (key,)
    yield from _paths(value, prefix + (key,))


def _odd(rng):
  return copy.deepcopy(ODD_VALUES[rng.integers(len(ODD_VALUES))])   # never shared, never cyclic


def _perturb_config(cfg, rng):
  paths = list(_paths(cfg))
  path = paths[rng.integers(len(paths))]
  parent = cfg
  for key in path[:-1]:
    parent = parent[key]
  choice = rng.integers(10)
  if choice == 0 and isinstance(parent, dict):
    del parent[path[-1]]
  elif choice == 1:
    cfg[f"unknown_{rng.integers(100)}"] = _odd(rng)
  elif choice == 2 and isinstance(parent[path[-1]], (int, float)) and not isinstance(
      parent[path[-1]], bool):
    parent[path[-1]] = parent[path[-1]] + int(rng.integers(-2, 3))   # near-valid sizes
  else:
    parent[path[-1]] = _odd(rng)


def _corrupt_bytes(path, rng):
  with open(path, "rb") as f:
    data = bytearray(f.read())
  if rng.integers(2):
    data = data[:rng.integers(len(data))]   # truncated
  else:
    header = 8 + int.from_bytes(data[:8], "little") if path.endswith(".safetensors") else len(data)
    region = header if rng.integers(2) else len(data)   # the header, or anywhere
    for _ in range(int(rng.integers(1, 6))):
      data[rng.integers(min(region, len(data)))] = int(rng.integers(256))
  with open(path, "wb") as f:
    f.write(bytes(data))


def _shard(ckpt, rng):
  """Splits model.safetensors into 3 files with an index."""
  tensors = load_file(os.path.join(ckpt, "model.safetensors"))
  os.remove(os.path.join(ckpt, "model.safetensors"))
  names = sorted(tensors)
  groups = np.array_split(np.array(names), 3)
  weight_map = {}
  for i, group in enumerate(groups):
    file = f"model-{i + 1:05d}-of-00003.safetensors"
    save_file({n: tensors[n] for n in group}, os.path.join(ckpt, file))
    weight_map.update({n: file for n in group})
  with open(os.path.join(ckpt, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
  return weight_map


def _check(ckpt):
  """Loads `ckpt`: success, or a clean error naming one of its files."""
  try:
    hf.load_model(ckpt, **LOAD)
  except (ValueError, TypeError) as e:
    message = str(e)
    files = (re.escape(ckpt) +
             r"/(config\.json|[\w.-]+\.safetensors|model\.safetensors\.index\.json)")
    assert re.search(files, message) or f"checkpoint={ckpt!r}" in message, message
    return type(e).__name__
  return "loaded"


@pytest.mark.parametrize("kind", ["llama", "gemma3", "qwen2"])
def test_config_field_perturbations(tmp_path, kind):
  rng = np.random.default_rng(10 + ["llama", "gemma3", "qwen2"].index(kind))
  outcomes = {}
  for case in range(CASES):
    ckpt = _copy(tmp_path, kind, case)
    path = os.path.join(ckpt, "config.json")
    with open(path) as f:
      cfg = json.load(f)
    for _ in range(int(rng.integers(1, 3))):
      _perturb_config(cfg, rng)
    with open(path, "w") as f:
      f.write(json.dumps(cfg))   # NaN and Infinity too: Python's json writes and reads them
    outcome = _check(ckpt)
    outcomes[outcome] = outcomes.get(outcome, 0) + 1
    shutil.rmtree(ckpt)
  assert outcomes.get("ValueError", 0) > CASES // 4, outcomes   # the fuzz reaches the checks


def test_corrupt_files(tmp_path):
  rng = np.random.default_rng(1)
  outcomes = {}
  for case in range(CASES):
    ckpt = _copy(tmp_path, "llama", case)
    target = "config.json" if rng.integers(3) == 0 else "model.safetensors"
    _corrupt_bytes(os.path.join(ckpt, target), rng)
    outcome = _check(ckpt)
    outcomes[outcome] = outcomes.get(outcome, 0) + 1
    shutil.rmtree(ckpt)
  assert outcomes.get("ValueError", 0) > CASES // 2, outcomes


def test_sharded_index_damage(tmp_path):
  rng = np.random.default_rng(2)
  for case in range(CASES):
    ckpt = _copy(tmp_path, "llama", case)
    weight_map = _shard(ckpt, rng)
    index = os.path.join(ckpt, "model.safetensors.index.json")
    names = sorted(weight_map)
    damage = int(rng.integers(6))
    if damage == 0:   # a tensor listed in the wrong file
      weight_map[names[rng.integers(len(names))]] = "model-00001-of-00003.safetensors"
    elif damage == 1:   # a tensor missing from the index
      del weight_map[names[rng.integers(len(names))]]
    elif damage == 2:   # a file that does not exist, or one outside the folder
      weight_map[names[0]] = ["missing.safetensors", "../config.json", "", 3][rng.integers(4)]
    elif damage == 3:   # a shard file removed
      os.remove(os.path.join(ckpt, "model-00002-of-00003.safetensors"))
    elif damage == 4:
      _corrupt_bytes(os.path.join(ckpt, f"model-0000{rng.integers(1, 4)}-of-00003.safetensors"),
                     rng)
    if damage != 5:   # 5: the intact sharded checkpoint, which must load
      with open(index, "w") as f:
        json.dump({"weight_map": weight_map}, f)
    outcome = _check(ckpt)
    if damage in (1, 2, 3, 5):
      assert outcome == ("loaded" if damage == 5 else "ValueError"), (damage, outcome)
    shutil.rmtree(ckpt)
