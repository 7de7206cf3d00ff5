"""Runnable example scripts on jaxkv (not installed; run from the repository root).

- `python -m examples.parallel_sampling`, `python -m examples.speculative`,
  `python -m examples.dflash`: the sequence verbs at work (fork, rewind, owner blocks).

The models and the Hugging Face loader they use are library code: `jaxkv.models`.
"""
