"""Every `LoopState` field is either per-column (`[S, ...]`, moved by the paged loop's column swap) or
listed in `state.NON_COLUMN_FIELDS`.

Before: the sampling and timing merges added per-output-row fields (`[R]`, `[RL, T]`) that the swap
would have moved as columns; with `R == S` silently, with `R != S` as an assert inside the trace.
"""

from __future__ import annotations

import dataclasses

from jaxkv.models import ModelConfig
from jaxkv.serve import SamplingParams
from jaxkv.serve.state import NON_COLUMN_FIELDS, init_loop_state, pack_queue


def test_every_field_is_per_column_or_listed():
  config = dataclasses.replace(
      ModelConfig.llama(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=8).cache_config(
                            capacity=64, max_seqs=3, max_write=4), page_size=4)
  # 5 requests, one with logprobs: R = 8 output rows and 8 logprob rows, S = 3 columns.
  params = [SamplingParams(max_tokens=2, logprobs=1)] + [SamplingParams(max_tokens=2)] * 4
  queue = pack_queue([(1, 2)] * 5, params, max_len=8, max_stop=1, num_logprobs=1)
  ls = init_loop_state(config, queue, num_widths=1, prefix_cache=True)
  s = config.max_seqs
  for f in dataclasses.fields(ls):
    value = getattr(ls, f.name)
    if f.name in NON_COLUMN_FIELDS:
      continue
    assert value.shape[:1] == (s,), (f.name, value.shape)
  for name in ("out_admitted", "out_first", "out_finished", "out_tokens"):
    assert getattr(ls, name).shape[0] != s and name in NON_COLUMN_FIELDS
