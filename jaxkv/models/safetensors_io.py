"""Lazy, validated access to the tensors of a Hugging Face checkpoint directory.

`Checkpoint` opens every `*.safetensors` file (or those a
`model.safetensors.index.json` names) with `safetensors.safe_open`, which
reads only the headers; `read(name, index)` then copies one slice of one
tensor from its memory-mapped file. So a loader can place each device's shard
without ever holding a whole checkpoint, or even a whole tensor, in host memory.
Every error is a `ValueError` naming the file (and the tensor).
"""

from __future__ import annotations

import glob
import os

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy, which safe_open needs)
import numpy as np

from jaxkv.models.hf_config import load_json

INDEX = "model.safetensors.index.json"
# Multimodal checkpoints nest the text model under one of these.
_TEXT_PREFIXES = ("language_model.", "model.language_model.", "model.text_model.")
FLOAT_DTYPES = {"F64": "float32", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _normalise(name: str) -> str:
  for prefix in _TEXT_PREFIXES:
    if name.startswith(prefix):
      return "model." + name[len(prefix):].removeprefix("model.")
  return name


class Checkpoint:
  """The tensors of a checkpoint directory, by (normalised) Hugging Face name.

  Attributes:
    shapes: name -> shape tuple.
    dtypes: name -> safetensors dtype string ("F32", "BF16", ...).
    files: name -> the file holding it.

  Use as a context manager (closes the files) or call `close()`.

  Raises:
    ValueError: no safetensors file, an unreadable file or index (named), a
      tensor in two files, or an index that disagrees with its files.
  """

  def __init__(self, checkpoint: str):
    from safetensors import safe_open   # pylint: disable=g-import-not-at-top
    directory = os.fspath(checkpoint)
    index_path = os.path.join(directory, INDEX)
    listed = self._read_index(index_path, directory) if os.path.isfile(index_path) else None
    if listed is None:
      files = sorted(glob.glob(os.path.join(glob.escape(directory), "*.safetensors")))
      if not files:
        raise ValueError(f"checkpoint={directory!r} holds no *.safetensors file")
    else:
      files = sorted(set(listed.values()))
    self.shapes, self.dtypes, self.files, self._raw = {}, {}, {}, {}
    self._handles = {}
    try:
      for file in files:
        try:
          handle = safe_open(file, framework="numpy")
          self._handles[file] = handle
          names = list(handle.keys())
          for raw in names:
            view = handle.get_slice(raw)
            self._add(file, raw, tuple(int(d) for d in view.get_shape()), view.get_dtype())
        except ValueError:
          raise
        except Exception as e:   # SafetensorError, OSError, ...: the file is not usable
          raise ValueError(f"{file}: not a readable safetensors file "
                           f"({type(e).__name__}: {e})") from None
      if listed is not None:
        self._check_index(index_path, listed)
    except BaseException:
      self.close()
      raise

  def _add(self, file, raw, shape, dtype):
    name = _normalise(raw)
    if name in self.files:
      raise ValueError(f"{file}: tensor {raw!r} is also in {self.files[name]} "
                       "(which copy applies is ambiguous)")
    self.shapes[name], self.dtypes[name], self.files[name], self._raw[name] = (
        shape, dtype, file, raw)

  @staticmethod
  def _read_index(path: str, directory: str) -> dict[str, str]:
    """`{raw tensor name: file path}` of a sharded checkpoint's index."""
    weight_map = load_json(path, "index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise ValueError(f"{path}: weight_map must be a non-empty object")
    listed = {}
    for name, file in weight_map.items():
      if not isinstance(file, str) or os.path.basename(file) != file or file in ("", ".", ".."):
        raise ValueError(f"{path}: weight_map[{name!r}]={file!r} must be a file name in the "
                         "checkpoint directory")
      full = os.path.join(directory, file)
      if not os.path.isfile(full):
        raise ValueError(f"{path}: weight_map[{name!r}] names {file!r}, which does not exist")
      listed[name] = full
    return listed

  def _check_index(self, path: str, listed: dict[str, str]) -> None:
    for raw, file in listed.items():
      name = _normalise(raw)
      if self.files.get(name) != file or self._raw[name] != raw:
        raise ValueError(f"{path}: weight_map[{raw!r}] names {os.path.basename(file)}, which "
                         "does not hold that tensor")
    for name, raw in self._raw.items():
      if raw not in listed:
        raise ValueError(f"{self.files[name]}: tensor {raw!r} is not in {path}'s weight_map")

  def where(self, name: str) -> str:
    return f"{self.files[name]}: tensor {self._raw[name]!r}"

  def read(self, name: str, index: tuple = (), dtype=None) -> np.ndarray:
    """The slice `index` (a tuple of slices) of tensor `name`, cast to `dtype` on the host.

    Raises:
      ValueError: not a float tensor, unreadable bytes, or a non-finite value (named).
    """
    if self.dtypes[name] not in FLOAT_DTYPES:
      raise ValueError(f"{self.where(name)} has dtype {self.dtypes[name]}; the loader reads "
                       f"float tensors ({', '.join(FLOAT_DTYPES)})")
    try:
      view = self._handles[self.files[name]].get_slice(self._raw[name])
      array = view[index] if index else view[...]
    except Exception as e:   # pylint: disable=broad-except  (truncated or corrupt data)
      raise ValueError(f"{self.where(name)} cannot be read ({type(e).__name__}: {e})") from None
    array = np.asarray(array, dtype=dtype or np.float32)
    # A NaN or infinite weight would turn every logit it touches into NaN: refuse at load.
    if not np.isfinite(array.astype(np.float32, copy=False)).all():
      raise ValueError(f"{self.where(name)} holds NaN or infinite values")
    return array

  def close(self) -> None:
    self._handles.clear()   # safe_open handles unmap when dropped

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
