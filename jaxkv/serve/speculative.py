"""Speculative decoding inside the serving loop: the config, the drafters, the verification.

A speculating column carries its pending token and up to `k` draft tokens in one
step (the draft sits in its token buffer past `length`, `Columns.draft` long);
the model returns logits for each of those `k + 1` rows, the longest prefix of
the draft that equals the argmax is accepted, the tokens are emitted as plain
decoding would have emitted them one by one, and the rejected tail is rolled
back with `pure.rewind_many`. docs/DESIGN.md, "Speculative decoding", has the
design and its trade-offs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np

from jaxkv import CacheConfig

METHODS = ("ngram", "custom")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """How an `Engine` drafts and verifies (`Engine(speculative=...)`); part of the compiled
  loop's static key, so two configs are two compiled loops.

  Args:
    method: `"ngram"` (prompt lookup: the most recent earlier occurrence of the
      sequence's last `n` tokens, `ngram_max >= n >= ngram_min`, longest first,
      proposes the up to `k` tokens that followed it; no second model) or
      `"custom"` (`drafter`, a device function: experiments and tests).
    k: most draft tokens per sequence and step (vLLM's `num_speculative_tokens`);
      at most the engine's `max_speculative_tokens(config)`.
    ngram_min, ngram_max: the n-gram sizes tried (vLLM's `prompt_lookup_min/max`).
    ngram_window: the lookup searches the column's last `ngram_window` tokens only
      (its cost is `[S, ngram_window]` compares a step, not `[S, max_len]`: at a
      131,072-token `max_len` and 256 columns the whole buffer is 128 MiB a compare).
    drafter: for `"custom"`: `drafter(tokens int32[S, L], length int32[S], k) ->
      (draft int32[S, k], count int32[S])`, traced inside the loop; `count` is
      clipped to `[0, k]` and to the column's limit. Hashable (it is in the jit key).
    max_pause: a step whose drafts were all rejected pauses drafting for 1 step,
      the next such round for 2, then 4, ... up to `max_pause` steps (`pause_after`);
      a round that accepts a token ends the doubling. A workload the drafter cannot
      predict then pays a verify round now and then, not every step. 0: never pause.

  Only plain greedy requests speculate (`admission.plain_greedy`: temperature 0,
  no penalty, bias, logprobs, grammar or `min_tokens` held stop), and a request may
  opt out (`SamplingParams(speculative=False)`); the others decode one token per
  step in the same steps, which is exact.
  """

  method: str = "ngram"
  k: int = 3
  ngram_min: int = 1
  ngram_max: int = 3
  drafter: Callable | None = None
  max_pause: int = 64
  ngram_window: int = 4096

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"speculative.method={self.method!r} must be one of {METHODS} "
                       "(a draft model is not built yet)")
    for name, low in (("k", 1), ("ngram_min", 1), ("ngram_max", 1), ("ngram_window", 1),
                      ("max_pause", 0)):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"speculative.{name}={value!r} must be an int >= {low}")
    if self.ngram_min > self.ngram_max:
      raise ValueError(f"speculative.ngram_min={self.ngram_min} must be <= "
                       f"speculative.ngram_max={self.ngram_max}")
    if self.ngram_window <= self.ngram_max:
      raise ValueError(f"speculative.ngram_window={self.ngram_window} must be > "
                       f"speculative.ngram_max={self.ngram_max}")
    if (self.method == "custom") != (self.drafter is not None):
      raise ValueError("speculative.drafter must be given with method='custom', and only then")
    if self.drafter is not None and not callable(self.drafter):
      raise ValueError(f"speculative.drafter={self.drafter!r} must be callable")


def describe(spec: SpeculativeConfig | None) -> str:
  """The startup line of a speculation config."""
  if spec is None:
    return "speculative decoding: off"
  how = (f"prompt lookup of {spec.ngram_min}..{spec.ngram_max} tokens in the last "
         f"{spec.ngram_window}" if spec.method == "ngram" else f"custom drafter {spec.drafter!r}")
  pause = (f"pausing up to {spec.max_pause} steps after a rejected round" if spec.max_pause
           else "never pausing")
  return (f"speculative decoding: {spec.method}, up to {spec.k} draft tokens per greedy sequence "
          f"and step ({how}), {pause}")


def max_speculative_tokens(config: CacheConfig) -> int:
  """The largest `k` a cache allows: a column's pending token and draft fit one step
  (`k + 1 <= W`), and rolling a whole draft back never goes below a ring's floor.

  A column's high-water mark is at most `k + 1` past its kept length (each step keeps
  at least the pending token), so a ring of `R` rows and window `w` that wraps
  allows `k <= R - w + 1` (CONTRACT §4.2); a ring clamped to `capacity` never wraps.
  """
  bound = config.step_width - 1
  for rows, window in config.rings():
    if rows < config.capacity:
      bound = min(bound, rows - window + 1)
  return bound


def check_speculative(speculative, config: CacheConfig) -> SpeculativeConfig | None:
  """`speculative` checked against the engine's cache; raises ValueError naming it."""
  if speculative is None:
    return None
  if not isinstance(speculative, SpeculativeConfig):
    raise TypeError(f"speculative={speculative!r} must be a jaxkv.serve.SpeculativeConfig")
  bound = max_speculative_tokens(config)
  if speculative.k > bound:
    raise ValueError(f"speculative.k={speculative.k} must be <= {bound} for this cache (a "
                     f"column's token and draft fit one step of W={config.step_width}, and a "
                     "rejected draft never rewinds below a ring's floor)")
  return speculative


# ----------------------------------------------------------------------------- drafters


def _shifted(tokens, by: int):
  """`tokens` moved `by` places right along the token axis (`-1` shifted in)."""
  if by == 0:
    return tokens
  return jnp.pad(tokens, ((0, 0), (by, 0)), constant_values=-1)[:, :tokens.shape[1]]


def ngram_draft(tokens, length, k: int, ngram_min: int, ngram_max: int, window: int | None = None):
  """Prompt lookup on every column's own history (no loop, no branch).

  Args:
    tokens: `int32[S, L]` each column's tokens; length: `int32[S]` how many are known.
    k, ngram_min, ngram_max: static.
    window: static: search only each column's last `window` known tokens (None: all).

  Returns:
    `(draft int32[S, k], count int32[S])`: the tokens that followed the most recent
    earlier occurrence of the column's last `n` tokens (the largest `n` that has
    one), at most `k` and only known ones.
  """
  s, max_len = tokens.shape
  if window is not None and window < max_len:
    # The same lookup on each column's last `window` tokens, gathered into `[S, window]`.
    base = jnp.clip(length - window, 0, max_len - window)
    part = jnp.take_along_axis(tokens, base[:, None] + jnp.arange(window)[None, :], axis=1)
    return ngram_draft(part, length - base, k, ngram_min, ngram_max)
  idx = jnp.arange(max_len, dtype=jnp.int32)
  cont = jnp.full((s,), -1, jnp.int32)   # where the chosen match's continuation starts
  for n in range(ngram_min, ngram_max + 1):   # a longer match overrides a shorter one
    # Continuation start `e` matches when tokens[e - n + t] == tokens[length - n + t] for
    # every t: column-shifted compares, `n` of `[S, L]` each.
    match = (idx[None, :] >= n) & (idx[None, :] < length[:, None]) & (length[:, None] > n)
    for t in range(n):
      last = jnp.take_along_axis(tokens, jnp.clip(length - n + t, 0, max_len - 1)[:, None],
                                 axis=1)
      match &= _shifted(tokens, n - t) == last
    found = jnp.max(jnp.where(match, idx[None, :], -1), axis=1)
    cont = jnp.where(found >= 0, found, cont)
  count = jnp.where(cont >= 0, jnp.minimum(k, length - cont), 0).astype(jnp.int32)
  at = jnp.clip(cont[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :], 0, max_len - 1)
  return jnp.take_along_axis(tokens, at, axis=1), count


def propose(spec: SpeculativeConfig, tokens, length):
  """`(draft int32[S, k], count int32[S])` of `spec`'s drafter."""
  if spec.method == "ngram":
    return ngram_draft(tokens, length, spec.k, spec.ngram_min, spec.ngram_max, spec.ngram_window)
  draft, count = spec.drafter(tokens, length, spec.k)
  return jnp.asarray(draft, jnp.int32), jnp.clip(jnp.asarray(count, jnp.int32), 0, spec.k)


def speculates(params, grammar):
  """`bool[S]`: columns whose token is the argmax (`admission.plain_greedy`, on the device)
  and whose request did not opt out: only they draft."""
  return ((params.speculative == 1) & (params.temperature == 0)
          & (params.repetition_penalty == 1) & (params.presence_penalty == 0)
          & (params.frequency_penalty == 0) & (params.logprobs < 0) & (params.restrict == 0)
          & jnp.all(params.bias_tokens == -1, axis=1) & (grammar == -1)
          & ((params.min_tokens == 0) | jnp.all(params.stop_tokens == -1, axis=1)))


def pause_after(pause, verified, kept, ok, max_pause: int):
  """`int32[2]` `(steps left, misses)` of the drafting pause after a step.

  Args:
    pause: `int32[2]` before the step (`LoopState.draft_pause`).
    verified, kept: `int32[]` draft tokens the step verified and accepted.
    ok: whether the step ran; max_pause: static (`SpeculativeConfig.max_pause`).

  A step that verified drafts and accepted none is a miss: the pause becomes
  `min(2 ** (misses - 1), max_pause)` steps. A step that accepted one ends the misses.
  Every other step counts the pause down.
  """
  if max_pause == 0:
    return pause
  left, misses = pause[0], pause[1]
  rounded = ok & (verified > 0)
  miss = rounded & (kept == 0)
  cap = max(max_pause - 1, 0).bit_length() + 1   # misses past this pause max_pause anyway
  misses = jnp.where(miss, jnp.minimum(misses + 1, cap), jnp.where(rounded, 0, misses))
  left = jnp.where(miss, jnp.minimum(jnp.left_shift(1, misses - 1), max_pause),
                   jnp.maximum(left - ok.astype(jnp.int32), 0))
  return jnp.stack([left, misses]).astype(jnp.int32)


def accepted(draft, count, target):
  """`int32[S]`: the longest prefix of each column's draft (`count` long) equal to `target`
  (`int32[S, k]`, the argmax after each verified position)."""
  k = draft.shape[1]
  match = (jnp.arange(k)[None, :] < count[:, None]) & (draft == target)
  return jnp.cumprod(match.astype(jnp.int32), axis=1).sum(axis=1, dtype=jnp.int32)
