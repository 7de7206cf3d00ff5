"""The `jaxkv` console script's refusals (the server itself is tested in test_server.py)."""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("uvicorn", reason="jaxkv serve needs the serve extra's uvicorn")

from jaxkv import cli  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf_llama")


def test_bad_arguments_and_checkpoints_are_named(tmp_path, capsys):
  assert cli.main(["serve", "--checkpoint", str(tmp_path)]) == 2
  assert "has no config.json" in capsys.readouterr().err
  assert cli.main(["serve", "--checkpoint", FIXTURE, "--max-seqs", "0"]) == 2
  assert "--max-seqs=0 must be >= 1" in capsys.readouterr().err
  for name in ("--port", "99999"), ("--page-size", "-1"), ("--gpu-memory-utilization", "1.5"):
    assert cli.main(["serve", "--checkpoint", FIXTURE, *name]) == 2
    assert f"{name[0]}={name[1]} must be" in capsys.readouterr().err
  untokenized = tmp_path / "no-tokenizer"
  shutil.copytree(FIXTURE, untokenized)
  os.remove(untokenized / "tokenizer.json")
  assert cli.main(["serve", "--checkpoint", str(untokenized), "--max-len", "64"]) == 2
  assert "tokenizer.json does not exist" in capsys.readouterr().err
  assert cli.main(["serve"]) == 2   # the checkpoint is required
  assert "the checkpoint is required: jaxkv serve MODEL" in capsys.readouterr().err
  assert cli.main(["serve", "--checkpoint", FIXTURE, "--max-logprobs", "-1"]) == 2
  assert "--max-logprobs=-1 must be >= 0" in capsys.readouterr().err
  assert cli.main(["serve", "--checkpoint", FIXTURE, "--max-len", "64", "--max-seqs", "2",
                   "--max-logprobs", "100000"]) == 2
  assert "max_logprobs=100000 must be in [0, vocab_size=" in capsys.readouterr().err
  # Checked against the checkpoint before anything is allocated (no out-of-memory traceback).
  assert cli.main(["serve", "--checkpoint", FIXTURE, "--max-len", "129"]) == 2
  assert "--max-len=129 is past the checkpoint's max_position_embeddings=128" in (
      capsys.readouterr().err)
  assert cli.main(["serve", "--checkpoint", FIXTURE, "--max-write", "100000000"]) == 2
  assert "--max-write=100000000 does not fit: one step" in capsys.readouterr().err
  assert cli.main(["serve", "--checkpoint", FIXTURE, "--data-parallel-size", "0"]) == 2
  assert "--data-parallel-size=0 must be >= 1" in capsys.readouterr().err
  assert cli.main(["serve", "--checkpoint", FIXTURE, "--data-parallel-size", "99"]) == 2
  assert "data_parallel_size=99 = 99 devices; this host has" in capsys.readouterr().err


def test_vllm_spellings_parse_to_the_same_flags():
  ours = cli._parser().parse_args(["serve", "--checkpoint", "m", "--model-name", "x",
                                   "--max-len", "64", "--max-seqs", "2", "--max-write", "32"])
  theirs = cli._parser().parse_args(["serve", "m", "--served-model-name", "x",
                                     "--max-model-len", "64", "--max-num-seqs", "2",
                                     "--max-num-batched-tokens", "32"])
  assert vars(ours) | {"model": None, "checkpoint": "m"} == vars(theirs) | {"model": None,
                                                                           "checkpoint": "m"}
  assert cli._parser().parse_args(["serve", "--model", "m"]).checkpoint == "m"


def test_startup_refusals_come_before_loading(tmp_path, capsys):
  """A taken port, a bad log level, the checkpoint given twice and a config.json of the wrong
  types: one line and rc 2, without loading or compiling anything."""
  import json, socket   # pylint: disable=g-import-not-at-top,multiple-imports
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    assert cli.main(["serve", FIXTURE, "--port", str(port)]) == 2
    assert f"--port={port}: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main(["serve", FIXTURE, "--log-level", "bogus"])
  assert "invalid choice: 'bogus'" in capsys.readouterr().err
  assert cli.main(["serve", FIXTURE, "--checkpoint", FIXTURE]) == 2
  assert "give the checkpoint once" in capsys.readouterr().err
  for field, value in (("vocab_size", "128"), ("max_position_embeddings", "abc")):
    bad = tmp_path / field
    shutil.copytree(FIXTURE, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {field: value}))
    assert cli.main(["serve", str(bad), "--max-len", "64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{field}={value!r} must be an integer" in err, err


def test_max_logprobs_reaches_the_engine():
  engine, _, _ = cli.build_server(FIXTURE, max_seqs=2, max_len=64, max_logprobs=3)
  assert engine.max_logprobs == 3


def test_serve_reports_implementations_and_compiles_before_listening(monkeypatch, capsys):
  """Before it listens: one line per (implementation, reason), the decode GEMM and the warm-up's
  compile time;
  when it stops: the tokens served after the warm-up and their tokens/s."""
  ran = {}

  def fake_run(app, args):   # the server "serves" one request while it runs
    engine = app.state.engine
    ran["compile_before"] = engine.stats.compile_seconds
    assert not engine.has_unfinished()   # the warm-up left nothing behind
    from jaxkv import serve   # pylint: disable=g-import-not-at-top
    engine.add_request(serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=4)))
    stepwise, live, tokens = args.stepping == "steps", engine.live, 0   # as the driver steps
    while engine.has_unfinished() or stepwise and live.has_work():
      tokens += sum(len(d.tokens) for d in live.step(args.interval, stepwise=stepwise))
    ran["tokens"] = tokens
    ran["compile_after"] = engine.stats.compile_seconds

  monkeypatch.setattr(cli, "_run_server", fake_run)
  assert cli.main(["serve", "--checkpoint", FIXTURE, "--max-len", "64", "--max-seqs", "2",
                   "--compilation-cache", "none"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0] == ("jaxkv serve: attention: reference on layers 0-1 (2 of 2): the default "
                    "device (cpu: cpu) is not an NVIDIA GPU of compute capability >= 9.0")
  assert out[1] == "jaxkv serve: decode GEMM: gemm='xla': XLA's for every product"
  assert out[2] == "jaxkv serve: speculative decoding: off"
  # The startup block: the sizing plan's lines, then the compilation cache.
  block = out[3:out.index("jaxkv serve: compiling the serving loop with a warm-up request ...")]
  assert [line.split(":")[1].strip() for line in block] == [
      "model", "dtype", "storage", "K/V", "max_len", "max concurrency", "compilation cache"]
  assert "storage: paged, page size 64, prefix caching on" in block[2]
  assert block[4].endswith("(--max-len)")
  compiled_line = out[3 + len(block) + 1]
  compiled = float(compiled_line.split("compiled the serving loop in ")[1].split(" s")[0])
  # The engine's first compile was the warm-up's (printed to 2 decimals).
  assert compiled > 0 and compiled == pytest.approx(ran["compile_before"], abs=0.006)
  # The warm-up compiled the loop: serving the request compiled (almost) nothing more.
  assert ran["compile_after"] - ran["compile_before"] < compiled / 4
  assert out[-1].startswith(f"jaxkv serve: generated {ran['tokens']} tokens in ")
  assert "tokens/s, compilation excluded" in out[-1]


def _readme_block(language: str) -> str:
  """The README's first `language` code block of its "Quick start: serve a checkpoint" section."""
  import pathlib, re   # pylint: disable=g-import-not-at-top,multiple-imports
  text = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
  section = text.split("## Quick start: serve a checkpoint", 1)[1].split("\n## ", 1)[0]
  return re.search(rf"```{language}\n(.*?)```", section, re.S).group(1)


def test_readme_serve_command_is_a_valid_command_line():
  """The README's `jaxkv serve` line parses as printed (the process test below serves its client)."""
  line = next(l for l in _readme_block("bash").splitlines() if " serve " in l)
  argv = line.split("#")[0].split()
  assert argv[0].endswith("jaxkv") and argv[1] == "serve"
  args = cli._parser().parse_args(argv[1:])
  assert args.checkpoint == "tests/fixtures/hf_llama" and args.port == 8000
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert os.path.isdir(os.path.join(root, args.checkpoint))


def test_sigterm_drains_in_flight_requests_and_prints_the_summary():
  """`jaxkv serve` as a process: a SIGTERM while a stream is in flight lets it finish (within
  --shutdown-timeout), refuses new connections, prints the closing summary and exits."""
  import signal, threading   # pylint: disable=g-import-not-at-top,multiple-imports
  import openai   # pylint: disable=g-import-not-at-top
  from http_server import serving_process   # pylint: disable=g-import-not-at-top
  with serving_process("--checkpoint", FIXTURE, "--max-len", "128", "--max-seqs", "2",
                       "--compilation-cache", "none", "--interval", "1", "--shutdown-timeout",
                       "60", "--stats-interval", "0", "--log-level", "warning") as (
                           proc, port, client):
    # The README's serve quick start: its Python client as printed, against this server.
    scope: dict = {}
    exec(compile(_readme_block("python").replace("localhost:8000", f"127.0.0.1:{port}"),   # pylint: disable=exec-used
                 "README.md", "exec"), scope)
    assert scope["reply"].choices[0].finish_reason in ("stop", "length")
    assert 0 < scope["reply"].usage.completion_tokens <= 16
    got, first = {}, threading.Event()

    def stream():
      chunks = client.completions.create(model="hf_llama", prompt=[1, 2, 3], max_tokens=100,
                                         stream=True, extra_body={"ignore_eos": True})
      for c in chunks:
        first.set()
        got["reason"] = c.choices[0].finish_reason or got.get("reason")

    thread = threading.Thread(target=stream)
    thread.start()
    assert first.wait(300)
    proc.send_signal(signal.SIGTERM)
    thread.join(300)
    assert got.get("reason") == "length"   # drained: the stream in flight finished
    with pytest.raises(openai.APIConnectionError):   # no new connection while draining or after
      client.models.list()
    out, _ = proc.communicate(timeout=300)
  assert "jaxkv serve: generated" in out and "tokens/s" in out, out[-2000:]


def test_chat_template_flag_replaces_the_checkpoints_template():
  """--chat-template's Jinja text renders every chat (seen through /tokenize, which runs no
  engine). No capsys here: uvicorn's log handlers would keep its capture file past the test."""
  import httpx   # pylint: disable=g-import-not-at-top
  import tokenizers   # pylint: disable=g-import-not-at-top
  from http_server import running   # pylint: disable=g-import-not-at-top
  from jaxkv.http.app import create_app   # pylint: disable=g-import-not-at-top
  template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
  engine, tokenizer, _ = cli.build_server(FIXTURE, max_seqs=2, max_len=64)
  with running(create_app(engine, tokenizer, model_name="m", chat_template=template)) as url:
    got = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]},
                     timeout=60).json()["tokens"]
  tok = tokenizers.Tokenizer.from_file(os.path.join(FIXTURE, "tokenizer.json"))
  assert got == tok.encode("[user]Hi", add_special_tokens=False).ids


def test_a_chat_template_that_is_neither_a_file_nor_a_name_is_refused(capsys):
  assert cli.main(["serve", FIXTURE, "--max-len", "64", "--chat-template", "nosuchname"]) == 2
  assert "--chat-template='nosuchname' is neither a file nor a template name" in (
      capsys.readouterr().err)
