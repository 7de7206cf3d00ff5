"""Step planning: positions, write rows, `seq_cols` and the segment table (CONTRACT §6.3, §7).

Everything here is jittable and static-shaped: a declaration is `int32[W]` ids
(`max_seqs` where unused), `int32[W]` block flags and an `int32[]` count.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv._config import CacheConfig
from jaxkv._state import Step
from pallas_kernels import indexing
from pallas_kernels.common import prefix_sum


def token_mask(config: CacheConfig, n_tokens):
  """`bool[W]`: True for the first `n_tokens` step tokens."""
  return jnp.arange(config.step_width, dtype=jnp.int32) < n_tokens


def derive_positions(config: CacheConfig, decl_ids, decl_n, pos):
  """Positions of the declared tokens; padding gets 0.

  The first token of sequence `s` gets `pos[s]`, and each later token of `s` the
  next integer, in step order across all its runs (owner blocks included).

  Args:
    decl_ids: `int32[W]` declared ids; only the first `decl_n` are read.
    decl_n: `int32[]`.
    pos: `int32[max_seqs]` committed lengths.
  """
  width = config.step_width
  tokens = jnp.arange(width, dtype=jnp.int32)
  is_real = token_mask(config, decl_n)
  earlier_same = ((decl_ids[:, None] == decl_ids[None, :])
                  & (tokens[None, :] < tokens[:, None]) & is_real[None, :])
  cols = jnp.clip(decl_ids, 0, config.max_seqs - 1)
  positions = pos[cols] + earlier_same.sum(axis=1, dtype=jnp.int32)
  return jnp.where(is_real, positions, 0)


def rows_needed(config: CacheConfig, decl_n, positions):
  """Flat rows the declaration needs: `max(position) + 1` over real tokens, or 0."""
  is_real = token_mask(config, decl_n)
  return jnp.max(jnp.where(is_real, positions + 1, 0))


def write_rows(config: CacheConfig, positions, is_real):
  """`int32[L, W]`: each token's row per layer (ring: position mod rows); padding 0."""
  per_layer = []
  for layer in range(config.num_layers):
    window = config.window(layer)
    num_rows = config.ring_rows(layer) if window is not None else 0
    rows = indexing.row_of(positions, num_rows=num_rows, window=window)
    per_layer.append(jnp.where(is_real, rows, 0))
  return jnp.stack(per_layer)


def build_step(config: CacheConfig, decl_ids, decl_block, decl_n, positions) -> Step:
  """Encodes one declared step (CONTRACT §7.1).

  A segment is a maximal run of consecutive real tokens with one id and one
  block flag, so a sequence spanned twice gives two segments and an owner's
  causal run and its block are separate.
  """
  width = config.step_width
  tokens = jnp.arange(width, dtype=jnp.int32)
  is_real = token_mask(config, decl_n)
  prev_ids = jnp.roll(decl_ids, 1)
  prev_block = jnp.roll(decl_block, 1)
  is_start = is_real & ((tokens == 0) | (decl_ids != prev_ids) | (decl_block != prev_block))
  seg_index = prefix_sum(is_start) - 1   # a compare-and-sum: no reduce-window chain
  n_segments = is_start.sum(dtype=jnp.int32)
  seq_cols = jnp.where(is_real, decl_ids, config.scratch_col)
  fields = jnp.stack([tokens, jnp.zeros_like(tokens), seq_cols, positions, decl_block], axis=1)
  pad_row = indexing.pad_segment_row(decl_n, config.scratch_col)
  seq_info = jnp.tile(pad_row[None, :], (width, 1))
  # Out-of-range targets (`width`) are dropped.
  seq_info = seq_info.at[jnp.where(is_start, seg_index, width)].set(fields, mode="drop")
  # Segments tile the real tokens in order and the padded rows start at `n`, so each
  # row's length is the next row's start minus its own (0 on padded rows): no
  # per-token count (a scatter-add) is needed.
  q_start = seq_info[:, indexing.SEG_Q_START]
  next_start = jnp.concatenate([q_start[1:], pad_row[indexing.SEG_Q_START][None]])
  seq_info = seq_info.at[:, indexing.SEG_Q_LEN].set(next_start - q_start)
  return Step(
      n_tokens=jnp.asarray(decl_n, jnp.int32),
      n_segments=n_segments,
      seq_cols=seq_cols,
      positions=positions,
      write_rows=write_rows(config, positions, is_real),
      seq_info=seq_info,
  )


def committed_ends(config: CacheConfig, step: Step):
  """Per causal segment, `(col, pos0 + q_len)`; other rows get col `max_seqs + 1`.

  Owner-block segments advance nothing (their K/V are draft scratch), so they
  are sent out of range with the padded rows.
  """
  info = step.seq_info
  is_real = jnp.arange(config.step_width, dtype=jnp.int32) < step.n_segments
  is_causal = is_real & (info[:, indexing.SEG_KIND] == indexing.KIND_CAUSAL)
  cols = jnp.where(is_causal, info[:, indexing.SEG_COL], config.max_seqs + 1)
  return cols, info[:, indexing.SEG_POS0] + info[:, indexing.SEG_Q_LEN]


def narrow(step: Step, width: int) -> Step:
  """The first `width` token slots of a step whose real tokens all lie there.

  A step's arrays are `W` wide; a step that carries at most `width` tokens (a
  decode step of a few sequences) can run its layers on `width` rows instead.
  Real segments come first in `seq_info` and there are at most `n_tokens` of
  them, so the first `width` rows hold all of them; padded rows stay padded.
  The caller guarantees `n_tokens <= width` (`narrow_step` checks it).
  """
  return Step(n_tokens=step.n_tokens, n_segments=step.n_segments,
              seq_cols=step.seq_cols[:width], positions=step.positions[:width],
              write_rows=step.write_rows[:, :width], seq_info=step.seq_info[:width])
