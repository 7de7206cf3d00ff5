"""Example models and decoding recipes on jaxkv (public names only).

- `examples.models`: Llama-style and Gemma-3-style decoders in Flax NNX.
- `examples.hf`: loading Hugging Face checkpoints (safetensors + config.json).
- `examples.parallel_sampling`, `examples.speculative`, `examples.dflash`: the
  sequence verbs at work (fork, rewind, owner blocks).
"""
