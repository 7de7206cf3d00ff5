"""`jaxkv.LLM` on the Llama fixture: text in, text out, stopping at the checkpoint's EOS ids.

Oracles: the token prompt's first greedy token comes from transformers' own logits
(`logits.npz`, teacher-forced by scripts/make_hf_fixtures.py); the text prompt's
greedy continuation from `jaxkv.serve.decoding.greedy_generate` on a separately
loaded model (step-by-step `ModelRunner` calls, not the engine's jitted loop). The
checkpoint copy's generation_config.json names those greedy tokens as its EOS ids,
so the requests stop there deterministically.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="LLM text needs the tokenizers package")
pytest.importorskip("jinja2", reason="chat templates need jinja2 (the serve extra)")

import jaxkv  # noqa: E402
from jaxkv import serve  # noqa: E402
from jaxkv.models import hf  # noqa: E402
from jaxkv.serve import core  # noqa: E402
from jaxkv.serve.decoding import greedy_generate  # noqa: E402
from jaxkv.tokenizer import Tokenizer  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf_llama")
TEXT = "hello world"
SIZES = dict(max_write=16, max_seqs=4, kv_cache_memory=1 << 20)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """`(llm, token prompt, its EOS, text prompt's greedy continuation, EOS ids)`."""
  ckpt = tmp_path_factory.mktemp("llm") / "ckpt"
  shutil.copytree(FIXTURE, ckpt)
  data = np.load(os.path.join(FIXTURE, "logits.npz"))
  tokens = [int(t) for t in data["tokens_3"]]
  token_eos = int(np.argmax(data["logits_3"][-1]))   # transformers' greedy first token
  model, _, _ = hf.load_model(FIXTURE, capacity=256, max_seqs=2, max_write=8)
  text_ids = Tokenizer.from_checkpoint(FIXTURE).encode(TEXT)
  continuation = greedy_generate(serve.ModelRunner(model), [text_ids], 12)[0]
  eos = [token_eos]
  if not set(continuation[:4]) & set(eos):   # the text prompt stops after 2 tokens or more
    eos.append(next(t for i, t in enumerate(continuation) if i >= 2 and t not in continuation[:i]))
  with open(ckpt / "generation_config.json", "w", encoding="utf-8") as f:
    json.dump({"eos_token_id": eos, "bos_token_id": 1}, f)
  with pytest.MonkeyPatch.context() as mp:   # the engine core binds serve_loop at construction
    mp.setattr(core, "serve_loop", _counted(core.serve_loop))
    llm = jaxkv.LLM(str(ckpt), **SIZES)
  return llm, tokens, token_eos, continuation, eos


LOOP_TRACES = []   # (greedy,) per trace of the serving loop by the module's LLM


def _counted(fn):
  def wrapper(*args, greedy=False, **kwargs):
    LOOP_TRACES.append(greedy)
    return fn(*args, greedy=greedy, **kwargs)
  return wrapper


def test_a_token_prompt_stops_at_the_checkpoints_eos(setup):
  llm, tokens, token_eos, _, eos = setup
  assert llm.eos_ids == tuple(eos)
  [out] = llm.generate(tokens, serve.SamplingParams(max_tokens=8))
  assert out.prompt is None and out.prompt_token_ids == tokens
  assert out.token_ids == [token_eos] and out.finish_reason == "stop" and out.text == ""
  # ignore_eos runs to max_tokens.
  [out] = llm.generate(tokens, serve.SamplingParams(max_tokens=3), ignore_eos=True)
  assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_a_text_prompt_returns_text_and_stops_at_eos(setup):
  llm, _, _, continuation, eos = setup
  [out] = llm.generate(TEXT, serve.SamplingParams(max_tokens=12))
  stop = next(i for i, t in enumerate(continuation) if t in eos)
  assert out.token_ids == continuation[:stop + 1] and out.finish_reason == "stop"
  assert out.text == llm.tokenizer.decode(continuation[:stop]) and out.text   # eos text left out
  assert out.prompt == TEXT and out.prompt_token_ids == llm.tokenizer.encode(TEXT)
  timing = out.outputs[0].timing
  assert timing.first_token_seconds is not None and timing.total_seconds >= 0


def test_generate_over_token_ids_equals_engine_run(setup):
  llm, tokens, _, _, eos = setup
  prompts = [tokens, tokens[:5], [5, 9, 11]]
  params = serve.SamplingParams(max_tokens=6, seed=3)
  outs = llm.generate(prompts, params)
  want = llm.engine.run([serve.Request(p, serve.SamplingParams(max_tokens=6, seed=3,
                                                               stop_tokens=tuple(eos)))
                         for p in prompts])
  assert [o.token_ids for o in outs] == [c.tokens for c in want]
  assert [o.finish_reason for o in outs] == [c.finish_reason for c in want]
  assert [o.request_id for o in outs] == [0, 1, 2]


def test_seeds_are_random_unless_given(setup):
  llm, tokens, _, _, _ = setup
  seeds = {llm.generate(tokens[:4])[0].outputs[0].seed for _ in range(3)}
  assert len(seeds) == 3   # three draws from 2**31 seeds
  assert llm.generate(tokens[:4], serve.SamplingParams(seed=7))[0].outputs[0].seed == 7


def test_chat_renders_through_the_template(setup):
  llm, _, _, _, eos = setup
  conversation = [{"role": "system", "content": "S"}, {"role": "user", "content": TEXT}]
  outs = llm.chat([conversation, conversation[1:]], serve.SamplingParams(max_tokens=5))
  assert outs[0].prompt == f"<s><|system|>S<|end|><|user|>{TEXT}<|end|><|assistant|>"
  assert outs[1].prompt == f"<s><|user|>{TEXT}<|end|><|assistant|>"
  for out in outs:
    assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt, add_special_tokens=False)
    [same] = llm.generate(out.prompt_token_ids, serve.SamplingParams(max_tokens=5))
    assert same.token_ids == out.token_ids and same.text == out.text
  with pytest.raises(ValueError, match="unknown role: tool"):
    llm.chat([{"role": "tool", "content": "x"}])


def test_stream_concatenates_to_generates_text(setup):
  llm, _, _, _, _ = setup
  params = serve.SamplingParams(max_tokens=12)
  deltas = list(llm.stream(TEXT, params))
  assert "".join(deltas) == llm.generate(TEXT, params)[0].text and len(deltas) >= 1
  ignored = "".join(llm.stream(TEXT, serve.SamplingParams(max_tokens=6), ignore_eos=True))
  assert ignored == llm.generate(TEXT, serve.SamplingParams(max_tokens=6), ignore_eos=True)[0].text
  # Closing early aborts the request and leaves the engine idle.
  stream = llm.stream(TEXT, serve.SamplingParams(max_tokens=12), ignore_eos=True)
  next(stream)
  stream.close()
  assert not llm.engine.has_unfinished()


def test_bad_prompts_are_named(setup):
  llm = setup[0]
  with pytest.raises(TypeError, match="prompts=.* must be a str"):
    llm.generate([])
  with pytest.raises(TypeError, match="prompts=.* must be a str"):
    llm.generate([1.5])
  with pytest.raises(ValueError, match="params has 1 entries for 2 prompts"):
    llm.generate(["a", "b"], [serve.SamplingParams()])
  # One prompt the engine cannot hold refuses the call before any prompt is queued.
  with pytest.raises(ValueError, match="request 1: prompt"):
    llm.generate([[1, 2], [3] * (llm.engine.max_len + 1)], serve.SamplingParams(max_tokens=2))
  assert not llm.engine.has_unfinished()
  with pytest.raises(ValueError, match="n=2 must be 1"):
    next(llm.stream(TEXT, serve.SamplingParams(n=2)))


def test_top_k_minus_one_means_off():
  assert serve.SamplingParams(top_k=-1) == serve.SamplingParams(top_k=0)
  with pytest.raises(ValueError, match="top_k=-2"):
    serve.SamplingParams(top_k=-2)


def test_vllm_spelled_sampling_params(setup):
  """`jaxkv.SamplingParams` as a vLLM user writes it: stop strings (the text cut before them, or
  with them; the tokens kept those whose text came back), stop_token_ids, ignore_eos,
  max_tokens=None, temperature 1 and a fresh seed by default. The oracle is the greedy
  continuation from `greedy_generate`, decoded here with the tokenizer."""
  llm, _, _, continuation, _ = setup
  defaults = jaxkv.SamplingParams()
  assert (defaults.temperature, defaults.seed, defaults.max_tokens) == (1.0, None, 16)
  greedy = lambda **kw: jaxkv.SamplingParams(temperature=0.0, ignore_eos=True, **kw)
  full = llm.tokenizer.decode(continuation)
  stop = full[len(full) // 3:len(full) // 3 + 2]
  at = full.index(stop)
  for include in (False, True):
    [out] = llm.generate(TEXT, greedy(max_tokens=12, stop=stop, include_stop_str_in_output=include))
    end = at + len(stop) * include
    reach = next(k for k in range(13) if len(llm.tokenizer.decode(continuation[:k])) >= end)
    assert (out.text, out.finish_reason) == (full[:end], "stop")
    assert out.token_ids == continuation[:reach]
    assert "".join(llm.stream(TEXT, greedy(max_tokens=12, stop=[stop],
                                           include_stop_str_in_output=include))) == out.text
  assert not llm.engine.has_unfinished()   # the stream's request ended at the stop string
  k = next(i for i, t in enumerate(continuation) if i >= 2 and t not in continuation[:i])
  [out] = llm.generate(TEXT, greedy(max_tokens=12, stop_token_ids=[continuation[k]]))
  assert out.token_ids == continuation[:k + 1] and out.finish_reason == "stop"
  [out] = llm.generate([5, 9, 11], greedy(max_tokens=None))
  assert len(out.token_ids) == llm.engine.max_len - 3 and out.finish_reason == "length"
  seeds = [o.outputs[0].seed for o in llm.generate([[5, 9], [5, 9]], jaxkv.SamplingParams(
      max_tokens=2))]
  assert seeds[0] != seeds[1]
  # min_tokens: that stop token is held back until k + 2 tokens exist (greedy takes the next best).
  [out] = llm.generate(TEXT, greedy(max_tokens=12, stop_token_ids=[continuation[k]],
                                    min_tokens=k + 2))
  assert out.token_ids[:k] == continuation[:k] and continuation[k] not in out.token_ids[:k + 2]
  assert len(out.token_ids) >= k + 2
  with pytest.raises(ValueError, match="min_tokens=3 must be <= max_tokens=2"):
    jaxkv.SamplingParams(max_tokens=2, min_tokens=3)
  [out] = llm.generate(TEXT, greedy(max_tokens=3, logit_bias={continuation[0]: -100.0}))
  assert out.token_ids[0] != continuation[0]
  [out] = llm.generate(TEXT, greedy(max_tokens=4, allowed_token_ids=[continuation[1], 7]))
  assert set(out.token_ids) <= {continuation[1], 7}
  with pytest.raises(TypeError, match="bad_words"):
    jaxkv.SamplingParams(bad_words=["x"])   # not implemented: refused by name
  with pytest.raises(ValueError, match="stop=.* non-empty strings"):
    jaxkv.SamplingParams(stop=[""])
  with pytest.raises(ValueError, match="temperature"):
    jaxkv.SamplingParams(temperature=-1.0)


def test_llm_takes_vllms_constructor_names():
  llm = jaxkv.LLM(model=FIXTURE, max_model_len=64, max_num_seqs=2, tensor_parallel_size=1,
                  max_write=16, kv_cache_memory=1 << 20)
  assert (llm.engine.max_len, llm.engine.config.max_seqs) == (64, 2)
  with pytest.raises(ValueError, match="give max_len or max_model_len"):
    jaxkv.LLM(FIXTURE, max_len=64, max_model_len=64)


def test_llm_keeps_its_compilations_in_a_persistent_cache(tmp_path):
  """Without a configured cache, `LLM` keeps its programs under ~/.cache/jaxkv/jax, as `jaxkv serve`
  does, so a second process reads them back; one already configured is kept (this suite's)."""
  import subprocess   # pylint: disable=g-import-not-at-top
  import sys   # pylint: disable=g-import-not-at-top
  import jax   # pylint: disable=g-import-not-at-top
  configured = jax.config.jax_compilation_cache_dir
  llm = jaxkv.LLM(FIXTURE, max_model_len=32, max_num_seqs=2, max_write=8, kv_cache_memory=1 << 20)
  assert jax.config.jax_compilation_cache_dir == configured and llm.engine is not None
  with pytest.raises(TypeError, match="compilation_cache=3"):
    jaxkv.LLM(FIXTURE, compilation_cache=3)
  code = ("import jaxkv; llm = jaxkv.LLM(%r, max_model_len=32, max_num_seqs=2, max_write=8, "
          "kv_cache_memory=1 << 20); print(len(llm.generate([[1, 2, 3]], jaxkv.SamplingParams("
          "max_tokens=2, temperature=0))[0].outputs[0].token_ids))" % FIXTURE)
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  env.update(HOME=str(tmp_path), JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.dirname(
                 os.path.abspath(__file__))))] + sys.path))
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split()[-1] == "2"
  cache = tmp_path / ".cache" / "jaxkv" / "jax"
  assert cache.is_dir() and len(list(cache.iterdir())) >= 3   # the loop's programs among them


def test_every_request_kind_runs_on_the_two_loop_programs(setup):
  """Batch sizes, logprobs, n > 1, chat and stream share one loop state: after a greedy and a
  sampled call, none of them traces (so compiles) the serving loop again."""
  llm, tokens, _, _, _ = setup
  llm.generate(tokens, serve.SamplingParams(max_tokens=2))
  llm.generate(tokens, serve.SamplingParams(max_tokens=2, temperature=1.0))
  before = len(LOOP_TRACES)
  assert sorted(set(LOOP_TRACES)) == [False, True]
  outs = llm.generate([tokens[:i + 1] for i in range(9)], serve.SamplingParams(max_tokens=3))
  assert [len(o.outputs) for o in outs] == [1] * 9
  [out] = llm.generate(tokens, serve.SamplingParams(max_tokens=3, logprobs=2, n=2,
                                                    temperature=0.7))
  assert [len(o.logprobs) for o in out.outputs] == [len(o.token_ids) for o in out.outputs]
  llm.chat([{"role": "user", "content": TEXT}], serve.SamplingParams(max_tokens=2))
  list(llm.stream(TEXT, serve.SamplingParams(max_tokens=3, temperature=0.5)))
  assert len(LOOP_TRACES) == before


def test_generate_stops_generating_at_a_stop_string(setup):
  """The sample is aborted once its text holds the stop string (within one loop entry), not run
  to max_tokens; the text is cut there as stream cuts it."""
  llm = setup[0]
  full = llm.generate(TEXT, jaxkv.SamplingParams(max_tokens=12, temperature=0),
                      ignore_eos=True)[0].text
  stop = next(full[i:i + 2] for i in range(len(full) // 3, len(full) - 1)
              if full[i:i + 2].strip() and full.index(full[i:i + 2]) == i)
  before = llm.engine.stats.generated
  params = jaxkv.SamplingParams(max_tokens=100, temperature=0, stop=[stop])
  [out] = llm.generate(TEXT, params, ignore_eos=True)
  assert out.text == full[:full.index(stop)] and out.finish_reason == "stop"
  assert llm.engine.stats.generated - before < 12 + llm.engine.max_steps
  assert "".join(llm.stream(TEXT, params, ignore_eos=True)) == out.text
  assert not llm.engine.has_unfinished()


def test_the_readmes_python_quick_start_runs_verbatim(monkeypatch, capsys):
  """The README's `LLM` quick start, as printed (vLLM's spelling), from the repository root."""
  import pathlib   # pylint: disable=g-import-not-at-top
  root = pathlib.Path(__file__).parents[2]
  text = (root / "README.md").read_text()
  start = text.index("```python\nfrom jaxkv import LLM, SamplingParams")
  block = text[start + len("```python\n"):text.index("```\n", start + 10)]
  monkeypatch.chdir(root)
  exec(compile(block, "README.md", "exec"), {"__name__": "readme"})   # pylint: disable=exec-used
  first = capsys.readouterr().out.split("\n", 1)[0]   # the texts, then the first's finish reason
  assert first.startswith("[") and first.rsplit(" ", 1)[1] in ("stop", "length")


def test_structured_outputs_hold_on_the_fixture_whose_free_text_is_gibberish(setup):
  pytest.importorskip("outlines_core")
  jsonschema = pytest.importorskip("jsonschema")
  import re   # pylint: disable=g-import-not-at-top
  llm = setup[0]
  schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                             "n": {"type": "integer", "minimum": 1,
                                                   "maximum": 9}},
            "required": ["city", "n"]}
  outs = llm.generate([TEXT, "x"], jaxkv.SamplingParams(
      max_tokens=60, temperature=0.9, seed=1, n=2, structured_outputs={"json": schema}))
  for out in outs:
    for o in out.outputs:
      jsonschema.validate(json.loads(o.text), schema)
      assert o.finish_reason == "stop"
  [out] = llm.generate(TEXT, jaxkv.SamplingParams(
      max_tokens=20, temperature=0, structured_outputs=jaxkv.StructuredOutputs(regex=r"[a-c]{3}!")))
  assert re.fullmatch(r"[a-c]{3}!", out.text)
  streamed = "".join(llm.stream(TEXT, jaxkv.SamplingParams(
      max_tokens=20, temperature=0, structured_outputs={"choice": ["yes", "no"]})))
  assert streamed in ("yes", "no")
  with pytest.raises(ValueError, match="grammar .* is not supported"):
    jaxkv.SamplingParams(structured_outputs={"grammar": "root ::= 'a'"})
  with pytest.raises(ValueError, match="exactly one of"):
    jaxkv.SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})
  with pytest.raises(TypeError, match="unknown fields"):
    jaxkv.SamplingParams(structured_outputs={"jsn": {}})
  with pytest.raises(ValueError, match="grammar needs stop_tokens"):
    llm.generate(TEXT, jaxkv.SamplingParams(structured_outputs={"regex": "a+"}), ignore_eos=True)
  assert not llm.engine.has_unfinished()


def test_a_stream_dropped_by_a_failure_in_another_calls_step_raises(setup, monkeypatch):
  """A generate's step fails and the engine drops every request in flight, an open stream's
  too: the generate raises, and so does the stream when it resumes (it is never reported as
  complete); nothing stays in the engine."""
  llm = setup[0]
  stream = llm.stream(TEXT, jaxkv.SamplingParams(max_tokens=40, temperature=0), steps=1)
  next(stream)
  engine, real_step = llm.engine, llm.engine.step

  def failing(steps):   # what a device failure does: everything in flight dropped, then raised
    dropped = sorted(llm._open)   # pylint: disable=protected-access
    for rid in dropped:
      engine.abort(rid)
    while engine.has_unfinished():
      real_step(steps)
    e = serve.EngineError(f"step failed; requests {dropped} were dropped: boom", [])
    e.failed, e.deltas = dropped, []
    raise e
  monkeypatch.setattr(engine, "step", failing)
  with pytest.raises(serve.EngineError, match="boom"):
    llm.generate(["x"], jaxkv.SamplingParams(max_tokens=5, temperature=0))
  monkeypatch.setattr(engine, "step", real_step)
  with pytest.raises(serve.EngineError, match="boom"):
    list(stream)
  assert not engine.has_unfinished() and not llm._open and not llm._failed   # pylint: disable=protected-access
