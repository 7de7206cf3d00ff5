"""Frozen tuning Configs for the Mosaic GPU kernels, with heuristic defaults.

Configs hold tuning knobs only, never semantics: any valid Config gives the same
result up to floating-point rounding. They are frozen and hashable, so they can
be static `jit` arguments, and `__post_init__` validates every field.
"""

from __future__ import annotations

import dataclasses


def _require(condition: bool, message: str) -> None:
  if not condition:
    raise ValueError(message)


@dataclasses.dataclass(frozen=True, slots=True)
class VarlenAttentionConfig:
  """Tuning knobs of `varlen_attention_sm90`.

  Attributes:
    block_q: query rows per program, a row being one (token, query head of the
      GQA group) pair; the wgmma M dimension, so a multiple of 64 when
      `use_wgmma`. A q tile holds `floor(block_q / G)` whole tokens, so any
      GQA group G up to `block_q` is served.
    block_k: keys per streamed K/V tile (a multiple of 64 when `use_wgmma`).
    num_stages: K/V tiles in flight (TMA double/triple buffering), >= 1.
    split_len: fewest keys one split of a single-q-tile segment reads
      (flash-decoding split-K); splits are chosen on device from the lengths.
    split_budget: static number of extra programs available to splits; the
      per-split length grows on device so the splits always fit in it.
    max_splits: most splits of one segment (the combine gathers this many).
    max_split_tokens: most tokens whose segments may split in one call (the
      longest single-q-tile segments first); the combine merges splits for this
      many tokens only.
    sort_items: hand out the items with the most K/V tiles first.
    max_programs: programs launched (over all KV heads); each loops over its
      share of the active items. A few waves of the SMs' program slots.
    fused_combine: True runs the epilogue (each token's partial, or the merge of
      its splits) as one Mosaic GPU kernel where it serves the head layout
      (`combine_sm90.supported`); False (the default: on H200 the kernel did not
      shorten the e2e decode step, docs/PERFORMANCE.md), or a layout it does not
      serve, runs it as XLA operations. Same results up to rounding.
    full_tile_loop: how an item loops over its K/V tiles. True: the tiles of its
      first run that need no mask (interior tiles) in a loop of their own, with
      the unmasked softmax, between two loops that choose per tile; False: one
      loop choosing per tile (a `lax.cond`); None (the default): True for the
      head dims where that measured faster
      (`varlen_kernel_sm90.FULL_TILE_LOOP_HEAD_DIMS`: 128). Same results bitwise.
    use_wgmma: True runs the production kernel (wgmma tensor-core matmuls on
      swizzled shared-memory tiles). False runs an otherwise identical variant
      whose matmuls are float32 `dot_general`s on plain tiles, which the Mosaic
      GPU interpreter can execute and which also serves float32 storage.
  """

  block_q: int = 64
  block_k: int = 64
  num_stages: int = 3
  split_len: int = 1024
  split_budget: int = 512
  max_splits: int = 16
  max_split_tokens: int = 256
  sort_items: bool = True
  max_programs: int = 1056
  use_wgmma: bool = True
  fused_combine: bool = False
  full_tile_loop: bool | None = None

  def __post_init__(self):
    for name in ("block_q", "block_k", "num_stages", "split_len", "max_splits",
                 "max_split_tokens", "max_programs"):
      value = getattr(self, name)
      _require(isinstance(value, int) and value >= 1, f"{name}={value!r} must be an int >= 1")
    for name in ("sort_items", "use_wgmma", "fused_combine"):
      _require(isinstance(getattr(self, name), bool),
               f"{name}={getattr(self, name)!r} must be a bool")
    _require(self.full_tile_loop is None or isinstance(self.full_tile_loop, bool),
             f"full_tile_loop={self.full_tile_loop!r} must be a bool or None")
    _require(isinstance(self.split_budget, int) and self.split_budget >= 0,
             f"split_budget={self.split_budget!r} must be an int >= 0")
    if self.use_wgmma:
      _require(self.block_q % 64 == 0, f"block_q={self.block_q} must be a multiple of 64 "
               "for wgmma")
      _require(self.block_k % 64 == 0 and self.block_k <= 256,
               f"block_k={self.block_k} must be a multiple of 64 and <= 256 for wgmma")


@dataclasses.dataclass(frozen=True, slots=True)
class KvWriteConfig:
  """Tuning knobs of `kv_write_sm90`.

  Attributes:
    block_heads: KV heads one program copies (divides the cache's head count).
  """

  block_heads: int = 0   # 0: all heads of a token in one program

  def __post_init__(self):
    _require(isinstance(self.block_heads, int) and self.block_heads >= 0,
             f"block_heads={self.block_heads!r} must be an int >= 0")


def default_varlen_attention_config(*, group: int, head_dim: int,
                                    interpret: bool) -> VarlenAttentionConfig:
  """Heuristic default for one call.

  The interpreter runs every program through host callbacks, so interpreted
  calls get small tiles and a small split budget (still exercising splits);
  compiled calls get 64-row q tiles, K/V tiles of 64 (128 for head dim 64),
  two stages and about four programs per SM of split budget on an H100/H200
  (132 SMs). `group` is the GQA group size (query heads per KV head); the
  interpreter's q tiles hold at least two whole tokens (`8 * ceil(G / 4)` rows),
  so CPU tests exercise tiles of several tokens and, for G not dividing the
  tile (3, 5, 6, 7, ...), the idle rows the compiled kernel's 64-row tiles have.
  """
  if interpret:
    return VarlenAttentionConfig(block_q=8 * -(-group // 4), block_k=8, num_stages=2,
                                 split_len=16, split_budget=4, max_splits=4, max_programs=4,
                                 use_wgmma=False)
  # block_k != head_dim: square K/V tiles are served (q reloaded per tile, see
  # varlen_kernel_sm90._stream_tiles) but were not faster where measured (docs/PERFORMANCE.md).
  # Stages and split lengths: the best of a small sweep on H200 (docs/PERFORMANCE.md).
  # Two stages keep a program at ~80 KB of shared memory, so two fit on one SM.
  block_k = 128 if head_dim == 64 else 64
  return VarlenAttentionConfig(block_q=64, block_k=block_k, num_stages=2, split_len=2048,
                               split_budget=512, max_splits=16)
