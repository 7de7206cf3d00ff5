"""The loop state as a few arrays at the jit boundary (`EngineCore` keeps it so between verbs).

A `LoopState` is about a hundred arrays, most of them a few hundred bytes (per-column
counters, the queue's scalars). Each array a jitted call takes or returns costs the
host per call, and on a GPU the runtime's per-buffer work also gives the interpreter
lock to other threads more often, so under a serving front a call with a hundred
donated arrays waits several times longer for the lock than one with ten
(`benchmarks/dispatch.py`). `Packing` keeps the large arrays (K/V pools, the queue's
prompts, the output tokens) as they are and concatenates the small ones of each dtype
into one vector; `pack` and `unpack` run inside the verbs' jitted programs (slices and
one concatenation per dtype, fused by XLA), so the host handles a few arrays per call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Arrays up to this size join their dtype's vector. Every verb that changes the state
# rewrites the vectors whole, so only arrays whose copy costs the device nothing count.
SMALL_BYTES = 1 << 16


@dataclasses.dataclass(frozen=True)
class Packing:
  """Where each leaf of a pytree lives in its packed form `(kept, vectors)`.

  Attributes:
    treedef: the pytree's structure.
    places: per leaf, `("kept", index)` or `("vector", group, offset, shape)`.
    dtypes: each vector's dtype (one vector per dtype).
    sizes: each vector's length.
  """
  treedef: Any
  places: tuple
  dtypes: tuple
  sizes: tuple

  @classmethod
  def of(cls, tree, *, enabled: bool = True, small_bytes: int = SMALL_BYTES) -> "Packing":
    """The packing of `tree` (arrays or shape-dtype structs); all kept if not `enabled`."""
    leaves, treedef = jax.tree.flatten(tree)
    places, dtypes, sizes, kept = [], [], [], 0
    for leaf in leaves:
      shape, size = tuple(np.shape(leaf)), int(np.prod(np.shape(leaf), dtype=np.int64))
      plain = not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
      dtype = np.dtype(leaf.dtype) if plain else None
      if not (enabled and plain and size * dtype.itemsize <= small_bytes):
        places.append(("kept", kept))
        kept += 1
        continue
      if dtype not in dtypes:
        dtypes.append(dtype)
        sizes.append(0)
      g = dtypes.index(dtype)
      places.append(("vector", g, sizes[g], shape))
      sizes[g] += size
    return cls(treedef, tuple(places), tuple(dtypes), tuple(sizes))

  @property
  def kept(self) -> int:
    return sum(1 for p in self.places if p[0] == "kept")

  def split(self, tree) -> tuple[tuple, list]:
    """`(kept arrays, small arrays)` of `tree`, in leaf order."""
    leaves = self.treedef.flatten_up_to(tree)
    kept = tuple(leaf for leaf, p in zip(leaves, self.places) if p[0] == "kept")
    return kept, [leaf for leaf, p in zip(leaves, self.places) if p[0] == "vector"]

  def join(self, kept, small):
    """The pytree of `split`'s two parts."""
    kept, small = iter(kept), iter(small)
    return self.treedef.unflatten([next(kept) if p[0] == "kept" else next(small)
                                   for p in self.places])

  def vectors(self, small) -> tuple:
    """The small arrays as one vector per dtype; traceable (call it inside jit)."""
    parts: list[list] = [[] for _ in self.dtypes]
    for leaf, p in zip(small, (p for p in self.places if p[0] == "vector")):
      parts[p[1]].append(jnp.ravel(jnp.asarray(leaf, self.dtypes[p[1]])))
    return tuple(jnp.concatenate(ps) if len(ps) > 1 else ps[0] for ps in parts)

  def smalls(self, vectors) -> list:
    """`vectors`' small arrays, in leaf order; traceable."""
    out = []
    for p in self.places:
      if p[0] == "vector":
        _, g, offset, shape = p
        size = int(np.prod(shape, dtype=np.int64))
        out.append(jax.lax.slice_in_dim(vectors[g], offset, offset + size).reshape(shape))
    return out

  def pack(self, tree) -> tuple:
    """`(kept arrays, one vector per dtype)`; traceable."""
    kept, small = self.split(tree)
    return kept, self.vectors(small)

  def unpack(self, packed):
    """The pytree of `packed` (`pack`'s output); traceable."""
    kept, vectors = packed
    return self.join(kept, self.smalls(vectors))
