"""Your own Flax NNX model on a jaxkv cache: greedy decoding of several prompts in one `jax.jit`.

`CachedAttention` takes the cache state and returns the new one, so the whole
loop (prefill, then one token per sequence per step) is one compiled function
with the state donated. Run: `python -m examples.nnx_decode_loop`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import jaxkv
from jaxkv.nnx import CachedAttention

pure = jaxkv.pure


class TinyLM(nnx.Module):
  """Embedding, attention blocks over the cache's layers, and an output head."""

  def __init__(self, cache_config, *, vocab: int, features: int, num_heads: int, rngs):
    self.embed = nnx.Embed(vocab, features, rngs=rngs)
    self.attn = nnx.List([CachedAttention(cache_config, layer, features=features,
                                          num_heads=num_heads, rngs=rngs)
                          for layer in range(cache_config.num_layers)])
    self.head = nnx.Linear(features, vocab, rngs=rngs)

  def __call__(self, tokens, state):
    x = self.embed(tokens)                      # [W, features]
    for attn in self.attn:                      # every layer, in order
      out, state = attn(x, state)
      x = x + out
    return self.head(x), state                  # logits [W, vocab]


def generate(model, config, prompts, max_new: int):
  """Greedy `max_new` tokens for each prompt; `(tokens [B, max_new], logits [B, max_new, V])`.

  The prompts are prefilled in one step (`sum(len) <= max_write`), then every
  sequence decodes one token per step. A non-OK status stops nothing inside the
  jit, so the worst status of every verb is returned and checked here.
  """
  width, batch = config.max_write, len(prompts)
  seq_ids = [s for s, p in enumerate(prompts) for _ in p]
  pad = lambda xs, fill: jnp.asarray(list(xs) + [fill] * (width - len(xs)), jnp.int32)
  last = jnp.asarray([sum(map(len, prompts[:s + 1])) - 1 for s in range(batch)])
  graphdef, params = nnx.split(model)
  no_blocks = jnp.zeros((width, 2), jnp.int32)

  def step(params, state, ids, tokens, n):
    state, declared = pure.declare_step(config, state, ids, n, no_blocks)
    state, prepared = pure.prepare_step(config, state)
    logits, state = nnx.merge(graphdef, params)(tokens, state)
    state, committed = pure.commit_step(config, state)
    return state, logits, jnp.maximum(jnp.maximum(declared, prepared), committed)

  @jax.jit
  def run(params, state):
    for _ in prompts:
      state, _, _ = pure.seq_new(config, state)
    state, logits, status = step(params, state, pad(seq_ids, config.max_seqs),
                                 pad([t for p in prompts for t in p], 0), len(seq_ids))
    first = logits[last]                                   # each prompt's last token
    decode_ids = pad(range(batch), config.max_seqs)

    def body(carry, _):
      state, logits, status = carry
      token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      tokens = jnp.zeros((width,), jnp.int32).at[:batch].set(token)
      state, out, step_status = step(params, state, decode_ids, tokens, batch)
      return (state, out[:batch], jnp.maximum(status, step_status)), (token, logits)

    (state, _, status), (tokens, seen) = jax.lax.scan(body, (state, first, status), None,
                                                      length=max_new)
    return tokens.T, jnp.swapaxes(seen, 0, 1), status

  tokens, logits, status = run(params, jaxkv.init_state(config))
  if int(status) != jaxkv.Status.OK:
    raise RuntimeError(f"a verb refused: {jaxkv.Status(int(status)).name}")
  return tokens, logits


def main():
  """Builds a 2-layer model, decodes three prompts, prints them; returns what the test checks."""
  config = jaxkv.CacheConfig([jaxkv.LayerConfig(jaxkv.LayerPolicy.flat(), 2, 16)] * 2,
                             capacity=64, max_seqs=4, max_write=8, kv_dtype=jnp.float32)
  model = TinyLM(config, vocab=50, features=32, num_heads=4, rngs=nnx.Rngs(0))
  prompts = [[1, 2, 3], [7, 8], [4]]
  tokens, logits = generate(model, config, prompts, max_new=6)
  for prompt, out in zip(prompts, tokens.tolist()):
    print(prompt, "->", out)
  return model, prompts, tokens, logits


if __name__ == "__main__":
  main()
