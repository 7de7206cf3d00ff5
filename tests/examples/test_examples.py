"""The examples: speculative decoding, DFlash blocks, parallel sampling and the model configs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from examples import dflash, parallel_sampling, speculative
from jaxkv.models import hf
from jaxkv.serve.decoding import greedy_generate
from jaxkv.models import Decoder, Gemma3, Llama, ModelConfig
from jaxkv import serve

PROMPTS = [[1, 5, 9, 2, 7, 30, 12], [3, 3, 8], [4, 1, 6, 6, 2, 9, 11, 40, 41, 2, 2, 17], [9]]
MAX_NEW = 14
TARGET = ModelConfig.gemma3(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                            layer_types=("sliding", "full", "sliding"), num_heads=2,
                            num_kv_heads=1, head_dim=16, sliding_window=4,
                            query_pre_attn_scalar=16.0)
K, BLOCK = 3, 4


def _decoder(config, width, seed):
  cache = config.cache_config(capacity=256, max_seqs=len(PROMPTS), max_write=width)
  return Decoder(config, cache, rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def target():
  return _decoder(TARGET, len(PROMPTS) * (K + 1), 0)


@pytest.fixture(scope="module")
def plain(target):
  return greedy_generate(serve.ModelRunner(target), PROMPTS, MAX_NEW)


def _perturbed_copy(model, scale, seed):
  """The target's weights plus noise: a draft that agrees often but not always."""
  copy = _decoder(TARGET, model.cache_config.step_width, 0)
  nnx.update(copy, nnx.state(model))
  kernel = copy.layers[1].mlp.down_proj.kernel
  noise = jax.random.normal(jax.random.key(seed), kernel[...].shape, jnp.float32)
  kernel[...] = kernel[...] + scale * noise
  return copy


@pytest.mark.parametrize("draft_kind", ["random", "perturbed", "identical"])
def test_speculative_equals_plain_greedy(target, plain, draft_kind):
  if draft_kind == "random":
    draft = _decoder(dataclasses.replace(TARGET, num_layers=1, layer_types=("sliding",)),
                     target.cache_config.step_width, 5)
  else:
    draft = _perturbed_copy(target, 0.0 if draft_kind == "identical" else 0.5, 1)
  outputs, stats = speculative.speculative_generate(
      serve.ModelRunner(target), serve.ModelRunner(draft), PROMPTS, MAX_NEW, K)
  assert outputs == plain
  if draft_kind == "identical":
    assert stats.accepted == stats.proposed
  elif draft_kind == "perturbed":
    assert 0 < stats.accepted < stats.proposed   # both accept and rewind paths ran
  # Each round confirms at least one token per live sequence.
  assert stats.rounds <= MAX_NEW


def test_dflash_equals_plain_greedy(target, plain):
  drafter_config = dataclasses.replace(TARGET, num_layers=2, layer_types=("sliding", "full"))
  drafter = _decoder(drafter_config, 2 * BLOCK * 2, 3)   # W for two sequences' context + block
  outputs, stats = dflash.dflash_generate(serve.ModelRunner(target), serve.ModelRunner(drafter),
                                          PROMPTS, MAX_NEW, BLOCK)
  assert outputs == plain
  assert stats.drafter_steps >= stats.rounds   # owner-block steps ran every round
  assert stats.proposed >= stats.rounds * (BLOCK - 1)


def test_dflash_drafter_rows_stay_uncommitted(target):
  """After a drafter step with an owner block, pos counts context only; hw covers the block."""
  drafter = serve.ModelRunner(_decoder(TARGET, 8, 3))
  seq = drafter.seq_new()
  drafter.step([seq] * 3, [1, 2, 3])
  drafter.step([seq] * 5, [4, 5, 9, 0, 0], owner_blocks=[(2, 3)])
  assert drafter.pos(seq) == 5
  assert int(drafter.cache.hw[seq]) == 8
  with pytest.raises(ValueError, match="BAD_BLOCKS"):
    drafter.step([seq] * 3, [1, 2, 3], owner_blocks=[(0, 2), (2, 1)])


def test_dflash_rejects_small_widths(target):
  with pytest.raises(ValueError, match="block=1"):
    dflash.dflash_generate(serve.ModelRunner(target), serve.ModelRunner(target), PROMPTS, 4, 1)


def test_parallel_sampling_example(target, plain):
  engine = serve.Engine(target, max_len=48)
  samples = parallel_sampling.parallel_samples(engine, PROMPTS[2], 3, max_tokens=5, seed=2)
  assert len(samples) == 3 and all(len(s) == 5 for s in samples)
  assert engine.stats.step_tokens == len(PROMPTS[2]) - 1 + 3 * 5
  # The n samples are independent draws (not one copied), and the seed reproduces them.
  assert len({tuple(s) for s in samples}) > 1
  assert parallel_sampling.parallel_samples(engine, PROMPTS[2], 3, max_tokens=5, seed=2) == samples
  # At temperature 0 every sample is plain greedy decoding (an oracle that shares no engine code).
  greedy = parallel_sampling.parallel_samples(engine, PROMPTS[2], 3, max_tokens=5, temperature=0.0)
  assert greedy == [plain[2][:5]] * 3


def test_model_configs_and_constructors():
  llama = ModelConfig.llama()
  cache = llama.cache_config(capacity=64, max_seqs=2, max_write=4)
  assert all(not layer.policy.is_ring for layer in cache.layers)
  model = Llama(llama, cache, rngs=nnx.Rngs(0))
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert params == llama.num_params
  gemma = ModelConfig.gemma3()
  rings = [layer.policy.window for layer in gemma.cache_layers() if layer.policy.is_ring]
  assert rings == [8] * 5
  with pytest.raises(ValueError, match="'gemma3'"):
    Gemma3(llama, cache, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="cache_config.layers"):
    Decoder(gemma, cache, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_kv_heads=3"):
    ModelConfig.llama(num_kv_heads=3)
  with pytest.raises(ValueError, match="sliding_window=None"):
    ModelConfig.llama(num_layers=1, layer_types=("sliding",))
  with pytest.raises(ValueError, match="tokens must be"):
    model(jnp.zeros((5,), jnp.int32), None)


def test_checkpoint_errors(tmp_path):
  with pytest.raises(ValueError, match="config.json"):
    hf.read_config(str(tmp_path))
  (tmp_path / "config.json").write_text('{"model_type": "bert"}')
  with pytest.raises(ValueError, match="'bert'"):
    hf.read_config(str(tmp_path))
  with pytest.raises(ValueError, match="safetensors"):
    hf.read_tensors(str(tmp_path))
  assert hf.load_tokenizer(str(tmp_path)) is None


def test_example_mains_run(capsys):
  assert speculative.main(["--k", "2", "--max-new", "4"]) == 0
  assert dflash.main(["--block", "3", "--max-new", "4"]) == 0
  assert parallel_sampling.main(["--n", "2", "--max-tokens", "3"]) == 0
  out = capsys.readouterr().out
  assert out.count("equal to plain greedy: True") == 2 and "sample 1:" in out
