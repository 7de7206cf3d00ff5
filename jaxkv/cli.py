"""The `jaxkv` console script: `jaxkv serve --checkpoint DIR` starts the OpenAI-compatible server.

The server's packages come with the `serve` extra (`pip install "jaxkv[serve]"`).
Before it listens, `jaxkv serve` prints which attention implementation serves
each layer and why, and compiles the serving loop with a warm-up request (so
the first client does not wait for the compiler) and prints how long that
took; when it stops, it prints the tokens served and the serving tokens/s,
compilation excluded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

_DTYPES = ("auto", "float32", "bfloat16")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="jaxkv", description=__doc__)
  sub = p.add_subparsers(dest="command", required=True)
  s = sub.add_parser("serve", help="serve a Hugging Face checkpoint over an OpenAI-compatible API")
  s.add_argument("--checkpoint", required=True,
                 help="checkpoint directory: config.json, *.safetensors, tokenizer.json "
                      "(tokenizer_config.json for chat, generation_config.json for stop ids)")
  s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
  s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
  s.add_argument("--model-name", default=None,
                 help="the model id clients send (default: the checkpoint's directory name)")
  s.add_argument("--max-seqs", type=int, default=8, help="sequences served at once (default 8)")
  s.add_argument("--max-len", type=int, default=None,
                 help="longest prompt + completion (default: max_position_embeddings, at most "
                      "4096)")
  s.add_argument("--capacity", type=int, default=None,
                 help="cache positions shared by all sequences (default max_seqs * max_len)")
  s.add_argument("--max-write", type=int, default=64,
                 help="step width W: tokens per step (default 64)")
  s.add_argument("--dtype", choices=_DTYPES, default="auto",
                 help="compute and K/V dtype (default auto: the checkpoint's)")
  s.add_argument("--interval", type=int, default=8,
                 help="steps per loop entry: streaming granularity (default 8)")
  s.add_argument("--implementation", choices=["reference", "mosaic_gpu", "interpret"],
                 default=None, help="attention implementation (default: automatic)")
  s.add_argument("--max-logprobs", type=int, default=None,
                 help="most top logprobs a request may ask for per token (default 20, or the "
                      "vocabulary if smaller)")
  s.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
  return p


def build_server(checkpoint: str, *, max_seqs: int = 8, max_len: int | None = None,
                 capacity: int | None = None, max_write: int = 64, dtype: str = "auto",
                 implementation: str | None = None, max_logprobs: int | None = None):
  """`(engine, tokenizer)` for a checkpoint: the model loaded, the engine built, the tokenizer read.

  Raises:
    ValueError: a bad checkpoint or size (named).
  """
  from jaxkv.models import hf   # pylint: disable=g-import-not-at-top
  from jaxkv.serve import Engine   # pylint: disable=g-import-not-at-top
  from jaxkv.server.text import Tokenizer   # pylint: disable=g-import-not-at-top
  tokenizer = Tokenizer.from_checkpoint(checkpoint)
  with open(os.path.join(checkpoint, "config.json"), encoding="utf-8") as f:
    positions = json.load(f).get("max_position_embeddings") or 4096
  max_len = min(int(positions), 4096) if max_len is None else max_len
  capacity = max_seqs * max_len if capacity is None else capacity
  import jax.numpy as jnp   # pylint: disable=g-import-not-at-top
  kv = "auto" if dtype == "auto" else getattr(jnp, dtype)
  model, _, _ = hf.load_model(checkpoint, capacity=capacity, max_seqs=max_seqs,
                              max_write=max_write, dtype=kv, kv_dtype=kv,
                              implementation=implementation)
  engine = Engine(model, max_len=max_len, max_logprobs=max_logprobs)
  if tokenizer.vocab_size > engine.vocab_size:
    raise ValueError(f"{checkpoint}: the tokenizer has {tokenizer.vocab_size} tokens; the model's "
                     f"vocab_size is {engine.vocab_size}")
  return engine, tokenizer


def warm_up(engine) -> float:
  """Compiles what serving runs before the first client; returns the compile seconds.

  One one-token request runs one step (the serving loop compiles) and is then
  aborted (the abort helper compiles); nothing of it stays in the engine.
  """
  from jaxkv.serve import Request, SamplingParams   # pylint: disable=g-import-not-at-top
  before = engine.stats.compile_seconds
  rid = engine.add_request(Request((0,), SamplingParams(max_tokens=2), request_id="warm-up"))
  engine.step(1)
  engine.abort(rid)
  while engine.has_unfinished():
    engine.step(1)
  return engine.stats.compile_seconds - before


def summary(stats, since) -> str:
  """The closing line: tokens served since `since` (the stats after the warm-up, an
  `EngineStats` copy), their serving time and tokens/s, apart from compile time."""
  tokens = stats.generated - since.generated
  seconds = stats.serve_seconds - since.serve_seconds
  rate = f"{tokens / seconds:.1f} tokens/s" if seconds > 0 else "no serving time"
  return (f"jaxkv serve: generated {tokens} tokens in {seconds:.2f} s of serving ({rate}, "
          f"compilation excluded); compile {stats.compile_seconds:.2f} s in all")


def serve(args) -> int:
  try:
    import uvicorn   # pylint: disable=g-import-not-at-top
    from jaxkv.server.app import create_app   # pylint: disable=g-import-not-at-top
  except ImportError as e:
    print(f"jaxkv serve needs the serve extra (pip install 'jaxkv[serve]'): {e}", file=sys.stderr)
    return 2
  for name in ("max_seqs", "max_write", "interval"):
    if getattr(args, name) < 1:
      print(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1", file=sys.stderr)
      return 2
  if args.max_logprobs is not None and args.max_logprobs < 0:
    print(f"--max-logprobs={args.max_logprobs} must be >= 0", file=sys.stderr)
    return 2
  try:
    engine, tokenizer = build_server(args.checkpoint, max_seqs=args.max_seqs, max_len=args.max_len,
                                     capacity=args.capacity, max_write=args.max_write,
                                     dtype=args.dtype, implementation=args.implementation,
                                     max_logprobs=args.max_logprobs)
  except (ValueError, OSError) as e:
    print(f"jaxkv serve: {e}", file=sys.stderr)
    return 2
  from jaxkv.serve.report import gemm_line, implementation_lines   # pylint: disable=g-import-not-at-top
  for line in implementation_lines(engine.implementations):
    print(f"jaxkv serve: {line}", flush=True)
  print(f"jaxkv serve: {gemm_line(engine.gemm)}", flush=True)
  # Said before it starts: on a CPU the compile takes tens of seconds and would look like a hang.
  print("jaxkv serve: compiling the serving loop with a warm-up request ...", flush=True)
  print(f"jaxkv serve: compiled the serving loop in {warm_up(engine):.2f} s (before the first "
        "client)", flush=True)
  name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
  app = create_app(engine, tokenizer, model_name=name, interval=args.interval)
  warm = dataclasses.replace(engine.stats)
  uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
  print(summary(engine.stats, warm), flush=True)
  return 0


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  if args.command == "serve":
    return serve(args)
  raise AssertionError(args.command)


if __name__ == "__main__":
  sys.exit(main())
