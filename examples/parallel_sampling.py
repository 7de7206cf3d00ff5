"""Parallel sampling (n > 1) on jaxkv: the prompt is prefilled once, then forked.

`jaxkv.serve.Engine` prefills a request's prompt but its last token in one
sequence, then `seq_clone`s it `n - 1` times (a fork copies the prefix; CONTRACT
§5). Every sample feeds the last prompt token itself and samples with its own
key, `fold_in(fold_in(key(seed), sample_index), token_index)`, so sample 0 of
an `n`-sample request equals the same request with `n = 1`.

  python -m examples.parallel_sampling
"""

from __future__ import annotations

import argparse
from typing import Sequence

from jaxkv import serve


def parallel_samples(engine: serve.Engine, prompt: Sequence[int], n: int, *, max_tokens: int,
                     temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                     seed: int = 0) -> list[list[int]]:
  """`n` samples of one prompt through `engine`, in sample order."""
  params = serve.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                top_p=top_p, seed=seed, n=n)
  completions = engine.run([serve.Request(tuple(prompt), params)])
  return [c.tokens for c in completions]


def main(argv=None) -> int:
  from flax import nnx   # pylint: disable=g-import-not-at-top
  from jaxkv.models import Decoder, ModelConfig   # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(prog="python -m examples.parallel_sampling",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--n", type=int, default=4, help="samples (default 4)")
  parser.add_argument("--max-tokens", type=int, default=12, help="new tokens (default 12)")
  parser.add_argument("--temperature", type=float, default=1.0, help="temperature (default 1)")
  args = parser.parse_args(argv)
  config = ModelConfig.llama()
  model = Decoder(config, config.cache_config(capacity=256, max_seqs=args.n, max_write=16),
                  rngs=nnx.Rngs(0))
  engine = serve.Engine(model, max_len=64)
  prompt = [1, 17, 42, 9, 100, 3, 77, 5]
  samples = parallel_samples(engine, prompt, args.n, max_tokens=args.max_tokens,
                             temperature=args.temperature)
  for i, s in enumerate(samples):
    print(f"sample {i}: {s}")
  prefill_once = len(prompt) - 1 + args.n * args.max_tokens
  print(f"{engine.stats.step_tokens} step tokens (prompt prefilled once: {prefill_once})")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
