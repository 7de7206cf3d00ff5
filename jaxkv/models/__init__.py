"""Decoder models that serve on jaxkv, and their Hugging Face loader.

- `jaxkv.models.decoder`: Llama-style (also Mistral, Qwen2/2.5, Qwen3) and
  Gemma-3-style decoders in Flax NNX (`ModelConfig`, `build`, `Decoder`,
  tensor-parallel helpers).
- `jaxkv.models.hf`: loading Hugging Face checkpoints (config.json + safetensors),
  strictly and shard by shard; `hf_config` validates config.json, `safetensors_io`
  reads tensors lazily.
"""

from jaxkv.models.decoder import (GEMMA3, LLAMA, Decoder, DecoderLayer, Gemma3, Llama, MLP,
                                  ModelConfig, build, param_spec, shard_model, shard_params)

__all__ = ["GEMMA3", "LLAMA", "Decoder", "DecoderLayer", "Gemma3", "Llama", "MLP", "ModelConfig",
           "build", "param_spec", "shard_model", "shard_params"]
