"""DFlash-style block drafting on jaxkv: owner blocks, target verification, `rewind`.

A block drafter proposes `B - 1` tokens per sequence in a single forward. Each
sequence's drafter tokens in a step are its newly confirmed context (causal,
committed) followed by an owner block `[last, MASK, ..., MASK]` of `B` tokens,
declared with `owner_blocks=[(start, B)]`: block queries see the whole block
(CONTRACT §9) and the block advances nothing at commit, so the drafter never needs a
rewind. The target then verifies `[last, d1..d_{B-1}]` causally, keeps the
matching prefix plus its own next token, and rolls back the rejected tail with
`rewind`. The output equals plain greedy decoding of the target.

Here the drafter is any `jaxkv.models.Decoder` (random weights in the demo:
the point is the cache protocol, not the acceptance rate).

  python -m examples.dflash
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Sequence

import numpy as np

from jaxkv.serve.decoding import accept_greedy, feed, greedy_generate
from jaxkv.serve import ModelRunner


@dataclasses.dataclass
class DFlashStats:
  """Drafter steps, verify rounds, drafts proposed and accepted."""

  drafter_steps: int = 0
  rounds: int = 0
  proposed: int = 0
  accepted: int = 0


def draft_blocks(drafter: ModelRunner, work: dict[int, tuple[list[int], int]], block: int,
                 mask_token: int, stats: DFlashStats) -> dict[int, list[int]]:
  """One or more batched drafter steps: context run + owner block per sequence.

  Args:
    work: drafter sequence id -> (context tokens to commit, last confirmed token).
    block: block length `B`.

  Returns:
    drafter sequence id -> `B - 1` proposed tokens.
  """
  width = drafter.config.step_width
  proposals = {}
  items = list(work.items())
  while items:
    seq_ids, tokens, blocks, spans = [], [], [], []
    while items and len(seq_ids) + len(items[0][1][0]) + block <= width:
      s, (context, last) = items.pop(0)
      seq_ids += [s] * len(context)
      tokens += context
      blocks.append((len(seq_ids), block))
      spans.append((s, len(seq_ids)))
      seq_ids += [s] * block
      tokens += [last] + [mask_token] * (block - 1)
    if not spans:
      raise ValueError(f"one sequence's drafter step ({len(items[0][1][0]) + block} tokens) "
                       f"exceeds the drafter's step width {width}")
    logits = drafter.step(seq_ids, tokens, owner_blocks=blocks)
    stats.drafter_steps += 1
    for s, start in spans:
      proposals[s] = [int(t) for t in np.argmax(logits[start:start + block - 1], axis=-1)]
  return proposals


def dflash_generate(target: ModelRunner, drafter: ModelRunner,
                    prompts: Sequence[Sequence[int]], max_new: int, block: int = 4,
                    mask_token: int = 0) -> tuple[list[list[int]], DFlashStats]:
  """Greedy decoding with block drafts verified by the target.

  Args:
    target: the target's runner; `W >= len(prompts) * block`.
    drafter: the drafter's runner; `W >= 2 * block` (up to `block` context
      tokens plus the block).
    prompts: token ids, each non-empty.
    max_new: new tokens per prompt.
    block: block length `B` (`B - 1` drafts per round).
    mask_token: token id of the block's masked slots.

  Returns:
    `(outputs, stats)`, outputs equal to greedy decoding of `target`.

  Raises:
    ValueError: `block < 2`, `max_new < 1`, or a step width too small.
  """
  if block < 2 or max_new < 1:
    raise ValueError(f"block={block} must be >= 2 and max_new={max_new} >= 1")
  if target.config.step_width < len(prompts) * block:
    raise ValueError(f"target step width {target.config.step_width} must be >= "
                     f"len(prompts) * block = {len(prompts) * block}")
  stats = DFlashStats()
  t_ids = [target.seq_new() for _ in prompts]
  d_ids = [drafter.seq_new() for _ in prompts]
  confirmed = [list(p) for p in prompts]
  feed(target, {t: c[:-1] for t, c in zip(t_ids, confirmed)})
  feed(drafter, {d: c[:-1] for d, c in zip(d_ids, confirmed)})
  live = list(range(len(prompts)))
  while live:
    stats.rounds += 1
    work = {d_ids[i]: (confirmed[i][drafter.pos(d_ids[i]):-1], confirmed[i][-1]) for i in live}
    proposals = draft_blocks(drafter, work, block, mask_token, stats)
    logits = feed(target, {t_ids[i]: [confirmed[i][-1]] + proposals[d_ids[i]] for i in live})
    for i in live:
      before = len(confirmed[i])
      accepted, new = accept_greedy(proposals[d_ids[i]], logits[t_ids[i]])
      stats.proposed += block - 1
      stats.accepted += accepted
      confirmed[i] += new
      if not target.rewind(t_ids[i], before + accepted):
        raise AssertionError("target rewind refused")
    live = [i for i in live if len(confirmed[i]) - len(prompts[i]) < max_new]
  for s in t_ids:
    target.seq_rm(s)
  for s in d_ids:
    drafter.seq_rm(s)
  return [c[len(p):len(p) + max_new] for c, p in zip(confirmed, prompts)], stats


def main(argv=None) -> int:
  from flax import nnx   # pylint: disable=g-import-not-at-top
  from jaxkv.models import Decoder, ModelConfig   # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(prog="python -m examples.dflash", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--block", type=int, default=4, help="block length B (default 4)")
  parser.add_argument("--max-new", type=int, default=24, help="new tokens (default 24)")
  args = parser.parse_args(argv)
  prompts = [[1, 5, 9, 2, 7], [3, 3, 8], [4, 1, 6, 6, 2, 9, 11]]
  target_cfg = ModelConfig.gemma3(vocab_size=256, hidden_size=64, head_dim=16,
                                  num_heads=4, num_kv_heads=2, sliding_window=4)
  width = len(prompts) * args.block
  target = Decoder(target_cfg, target_cfg.cache_config(
      capacity=512, max_seqs=len(prompts), max_write=width), rngs=nnx.Rngs(0))
  drafter_cfg = dataclasses.replace(target_cfg, num_layers=2, layer_types=("sliding", "full"))
  drafter = Decoder(drafter_cfg, drafter_cfg.cache_config(
      capacity=512, max_seqs=len(prompts), max_write=len(prompts) * 2 * args.block),
      rngs=nnx.Rngs(1))
  outputs, stats = dflash_generate(ModelRunner(target), ModelRunner(drafter), prompts,
                                   args.max_new, args.block)
  plain = greedy_generate(ModelRunner(target), prompts, args.max_new)
  for p, o in zip(prompts, outputs):
    print(f"prompt {p} -> {o}")
  print(f"{stats.rounds} rounds, {stats.drafter_steps} drafter steps, "
        f"{stats.accepted}/{stats.proposed} drafts accepted; equal to plain greedy: "
        f"{outputs == plain}")
  return 0 if outputs == plain else 1


if __name__ == "__main__":
  raise SystemExit(main())
