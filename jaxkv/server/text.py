"""The server's text I/O, now in `jaxkv.tokenizer` (re-exported here for the server's imports)."""

from jaxkv.tokenizer import TextStream, Tokenizer, generation_eos_ids

__all__ = ["TextStream", "Tokenizer", "generation_eos_ids"]
