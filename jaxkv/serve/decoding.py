"""Host-level decoding helpers shared by the examples: packed feeding and plain greedy.

`feed` packs several sequences' pending tokens onto the `W`-wide step axis of a
`jaxkv.serve.ModelRunner` (chunked when they do not fit), which is how
prefill, catch-up and verify steps of the other examples are built.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from jaxkv.serve import ModelRunner


def feed(runner: ModelRunner, pending: Mapping[int, Sequence[int]]) -> dict[int, np.ndarray]:
  """Writes every sequence's pending tokens, packing sequences into W-wide steps.

  Args:
    runner: the model's runner.
    pending: sequence id -> tokens to append (empty lists are skipped).

  Returns:
    sequence id -> `float32[len(tokens), vocab]` logits of those tokens.
  """
  width = runner.config.step_width
  queue = [(s, list(t)) for s, t in pending.items() if len(t)]
  out: dict[int, list[np.ndarray]] = {s: [] for s, _ in queue}
  while queue:
    seq_ids, tokens, spans = [], [], []
    while queue and len(seq_ids) < width:
      s, toks = queue[0]
      take = toks[:width - len(seq_ids)]
      spans.append((s, len(seq_ids), len(take)))
      seq_ids += [s] * len(take)
      tokens += take
      if len(take) == len(toks):
        queue.pop(0)
      else:
        queue[0] = (s, toks[len(take):])
    logits = runner.step(seq_ids, tokens)
    for s, start, length in spans:
      out[s].append(logits[start:start + length])
  return {s: np.concatenate(parts) for s, parts in out.items()}


def greedy_generate(runner: ModelRunner, prompts: Sequence[Sequence[int]],
                    max_new: int) -> list[list[int]]:
  """Plain greedy decoding of every prompt, batched one token per sequence per step.

  The reference the speculative examples must reproduce token for token.
  """
  seqs = [runner.seq_new() for _ in prompts]
  if None in seqs:
    raise ValueError(f"prompts: {len(prompts)} sequences exceed max_seqs="
                     f"{runner.config.max_seqs}")
  logits = feed(runner, {s: list(p) for s, p in zip(seqs, prompts)})
  outputs = [[int(np.argmax(logits[s][-1]))] for s in seqs]
  for _ in range(max_new - 1):
    logits = feed(runner, {s: [out[-1]] for s, out in zip(seqs, outputs)})
    for s, out in zip(seqs, outputs):
      out.append(int(np.argmax(logits[s][-1])))
  for s in seqs:
    runner.seq_rm(s)
  return outputs


def accept_greedy(drafts: Sequence[int], target_logits: np.ndarray) -> tuple[int, list[int]]:
  """Greedy verification: the accepted draft count and the tokens to append.

  Args:
    drafts: `k` proposed tokens following the last confirmed token.
    target_logits: `[k + 1, vocab]` target logits at the last confirmed token
      and at each draft token.

  Returns:
    `(a, tokens)`: the first `a` drafts equal the target's greedy choices, and
    `tokens` is those drafts plus the target's own next token (`a + 1` tokens).
  """
  choices = np.argmax(target_logits, axis=-1)
  accepted = 0
  while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
    accepted += 1
  return accepted, [int(t) for t in drafts[:accepted]] + [int(choices[accepted])]
