"""Speculative decoding with a small draft model, batched over sequences, on jaxkv.

Each round: the draft model proposes `k` tokens per sequence autoregressively;
the target verifies `[last, d1..dk]` of every sequence in one step; the longest
prefix matching the target's greedy choices is kept plus the target's next
token, and both caches drop the rejected tail with `rewind` (CONTRACT §4.2: rolling
back part of the most recent steps is never refused when `W >= k`). The output
equals plain greedy decoding of the target, token for token.

  python -m examples.speculative
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Sequence

import numpy as np

from jaxkv.serve.decoding import accept_greedy, feed, greedy_generate
from jaxkv.serve import ModelRunner


@dataclasses.dataclass
class SpeculativeStats:
  """Rounds run, drafts proposed and drafts accepted."""

  rounds: int = 0
  proposed: int = 0
  accepted: int = 0


def speculative_generate(target: ModelRunner, draft: ModelRunner,
                         prompts: Sequence[Sequence[int]], max_new: int, k: int = 4
                         ) -> tuple[list[list[int]], SpeculativeStats]:
  """Greedy speculative decoding of every prompt.

  Args:
    target, draft: runners of the two models (same vocabulary); each needs
      `W >= len(prompts) * (k + 1)` and room for every sequence.
    prompts: token ids, each non-empty.
    max_new: new tokens per prompt.
    k: drafts per round.

  Returns:
    `(outputs, stats)`: `max_new` tokens per prompt, equal to greedy decoding
    of `target`.

  Raises:
    ValueError: `k < 1`, `max_new < 1`, or a step width too small.
  """
  if k < 1 or max_new < 1:
    raise ValueError(f"k={k} and max_new={max_new} must be >= 1")
  for name, runner in (("target", target), ("draft", draft)):
    if runner.config.step_width < len(prompts) * (k + 1):
      raise ValueError(f"{name} step width {runner.config.step_width} must be >= "
                       f"len(prompts) * (k + 1) = {len(prompts) * (k + 1)}")
  stats = SpeculativeStats()
  t_ids = [target.seq_new() for _ in prompts]
  d_ids = [draft.seq_new() for _ in prompts]
  confirmed = [list(p) for p in prompts]
  # Both caches hold everything but the last confirmed token.
  feed(target, {t: c[:-1] for t, c in zip(t_ids, confirmed)})
  feed(draft, {d: c[:-1] for d, c in zip(d_ids, confirmed)})
  live = list(range(len(prompts)))
  while live:
    stats.rounds += 1
    # Draft: catch up on confirmed tokens, then k - 1 single-token steps.
    logits = feed(draft, {d_ids[i]: confirmed[i][draft.pos(d_ids[i]):] for i in live})
    drafts = {i: [int(np.argmax(logits[d_ids[i]][-1]))] for i in live}
    for _ in range(k - 1):
      logits = feed(draft, {d_ids[i]: [drafts[i][-1]] for i in live})
      for i in live:
        drafts[i].append(int(np.argmax(logits[d_ids[i]][-1])))
    # Target: verify [last, d1..dk] of every sequence in one step.
    logits = feed(target, {t_ids[i]: [confirmed[i][-1]] + drafts[i] for i in live})
    for i in live:
      before = len(confirmed[i])
      accepted, new = accept_greedy(drafts[i], logits[t_ids[i]])
      stats.proposed += k
      stats.accepted += accepted
      confirmed[i] += new
      # Keep the last confirmed token and the accepted drafts; drop the rest.
      if not target.rewind(t_ids[i], before + accepted):
        raise AssertionError("target rewind refused")
      keep = min(draft.pos(d_ids[i]), before + accepted)
      if not draft.rewind(d_ids[i], keep):
        raise AssertionError("draft rewind refused")
    live = [i for i in live if len(confirmed[i]) - len(prompts[i]) < max_new]
  for s in t_ids:
    target.seq_rm(s)
  for s in d_ids:
    draft.seq_rm(s)
  return [c[len(p):len(p) + max_new] for c, p in zip(confirmed, prompts)], stats


def main(argv=None) -> int:
  from flax import nnx   # pylint: disable=g-import-not-at-top
  from jaxkv.models import Decoder, ModelConfig   # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(prog="python -m examples.speculative", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--k", type=int, default=4, help="drafts per round (default 4)")
  parser.add_argument("--max-new", type=int, default=24, help="new tokens (default 24)")
  args = parser.parse_args(argv)
  target_cfg = ModelConfig.llama(num_layers=3)
  prompts = [[1, 5, 9, 2, 7], [3, 3, 8], [4, 1, 6, 6, 2, 9, 11]]
  width = len(prompts) * (args.k + 1)
  cache = dict(capacity=512, max_seqs=len(prompts), max_write=width)
  target = Decoder(target_cfg, target_cfg.cache_config(**cache), rngs=nnx.Rngs(0))
  # A one-layer random draft: it rarely agrees, which exercises the rewinds.
  draft_cfg = dataclasses.replace(target_cfg, num_layers=1, layer_types=None)
  draft = Decoder(draft_cfg, draft_cfg.cache_config(**cache), rngs=nnx.Rngs(0))
  outputs, stats = speculative_generate(ModelRunner(target), ModelRunner(draft), prompts,
                                        args.max_new, args.k)
  plain = greedy_generate(ModelRunner(target), prompts, args.max_new)
  for p, o in zip(prompts, outputs):
    print(f"prompt {p} -> {o}")
  print(f"{stats.rounds} rounds, {stats.accepted}/{stats.proposed} drafts accepted; "
        f"equal to plain greedy: {outputs == plain}")
  return 0 if outputs == plain else 1


if __name__ == "__main__":
  raise SystemExit(main())
