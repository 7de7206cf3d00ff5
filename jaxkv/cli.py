"""The `jaxkv` console script: `jaxkv serve --checkpoint DIR` starts the OpenAI-compatible server.

The server's packages come with the `serve` extra (`pip install "jaxkv[serve]"`).
With no sizing flags the K/V storage is sized from device memory (paged, prefix
caching on, `max_len` the checkpoint's context: `jaxkv.serve.sizing`). Before it
listens, `jaxkv serve` prints one block: which attention implementation serves
each layer and why, the decode GEMM, the model, dtypes, storage, K/V bytes and
token capacity, `max_len` and where it came from, the concurrency, the
compilation cache, and the compile time of a warm-up request (so the first
client does not wait for the compiler); when it stops, it prints the tokens
served and the serving tokens/s, compilation excluded.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import textwrap
import time


_DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# `jaxkv.serve.aio.STEPPING`, spelled here so that parsing the flags imports no jax.
_STEPPING = ("steps", "entries")
# `jaxkv.serve.loading.DEFAULT_COMPILATION_CACHE`, spelled here so that parsing imports no jax.
DEFAULT_COMPILATION_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "jaxkv", "jax")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="jaxkv", description=__doc__)
  p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
  sub = p.add_subparsers(dest="command", required=True)
  s = sub.add_parser(
      "serve", help="serve a Hugging Face checkpoint over an OpenAI-compatible API",
      description=textwrap.fill(
          "Serve a Hugging Face checkpoint (a directory or a hub id) over an OpenAI-compatible "
          "HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /metrics). "
          "With no sizing flags the K/V cache is sized from device memory. vLLM's spellings of "
          "the common flags are accepted (a positional model or --model, --served-model-name, "
          "--max-model-len, --max-num-seqs, --max-num-batched-tokens).", 78),
      epilog="example:\n  jaxkv serve tests/fixtures/hf_llama --port 8000\n"
             "  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\\n"
             "    -d '{\"prompt\": \"Hello\", \"max_tokens\": 8}'",
      formatter_class=argparse.RawDescriptionHelpFormatter)
  s.add_argument("model", nargs="?", default=None,
                 help="the checkpoint (as --checkpoint; vLLM's positional model)")
  s.add_argument("--checkpoint", "--model", dest="checkpoint", default=None,
                 help="checkpoint directory or Hugging Face model id: config.json, *.safetensors, "
                      "tokenizer.json (tokenizer_config.json / chat_template.jinja for chat, "
                      "generation_config.json for stop ids)")
  s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
  s.add_argument("--port", type=int, default=8000, help="port, 1..65535 (default 8000)")
  s.add_argument("--model-name", "--served-model-name", dest="model_name", default=None,
                 help="the model id clients send (default: the checkpoint's directory name)")
  g = s.add_argument_group("sizing (default: from device memory)")
  g.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES",
                 help="bytes for K/V storage (wins over --gpu-memory-utilization)")
  g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                 help="fraction of the device's memory for weights, K/V and the loop (default "
                      "0.9); ignored when --kv-cache-memory is given")
  g.add_argument("--max-seqs", "--max-num-seqs", dest="max_seqs", type=int, default=None,
                 help="sequences served at once (default: what the K/V budget holds, at most "
                      "256 and the step width)")
  g.add_argument("--max-len", "--max-model-len", dest="max_len", type=int, default=None,
                 help="longest prompt + completion (default: the checkpoint's "
                      "max_position_embeddings; refused if one sequence of it cannot fit)")
  g.add_argument("--page-size", type=int, default=64,
                 help="positions per K/V page (default 64, served at full speed by the kernels "
                      "for head dims 64/128/256); 0: one column of max_len per sequence")
  g.add_argument("--no-prefix-caching", action="store_true",
                 help="do not keep and reuse prompt pages across requests (on by default with "
                      "paged storage)")
  g.add_argument("--max-write", "--max-num-batched-tokens", dest="max_write", type=int,
                 default=512,
                 help="step width W: most tokens per step (default 512)")
  g.add_argument("--tensor-parallel-size", type=int, default=1,
                 help="split K/V heads and weights over this many local devices (default 1)")
  g.add_argument("--data-parallel-size", type=int, default=1,
                 help="engines behind the one server, each with its own weights and cache on its "
                      "own --tensor-parallel-size devices; a request goes to the least busy "
                      "(default 1)")
  g.add_argument("--dtype", choices=_DTYPES, default="auto",
                 help="compute dtype (default auto: the checkpoint's)")
  g.add_argument("--kv-cache-dtype", choices=_DTYPES + ("fp8", "fp8_e4m3", "fp8_e5m2"),
                 default="auto",
                 help="K/V storage dtype (default auto: the compute dtype); fp8 (= fp8_e4m3) and "
                      "fp8_e5m2 store 1 byte per value with per-head scales (docs/CONTRACT.md 3.2)")
  r = s.add_argument_group("serving")
  r.add_argument("--stepping", choices=_STEPPING, default="steps",
                 help="steps: single steps queued ahead of the GPU, new requests joining at the "
                      "next step, tokens read back after every step while the host keeps up "
                      "(sampled requests step in loop entries); entries: loop entries of up to "
                      "--interval steps, each returning when the GPU has run it (default steps)")
  r.add_argument("--api-server-count", type=int, default=1,
                 help="HTTP front processes: 1 serves HTTP in the engine's process; N > 1 runs N "
                      "front processes on the port beside it, so the engine's process only steps "
                      "and N event loops write the streams (default 1)")
  r.add_argument("--interval", type=int, default=16,
                 help="most steps per entry, and read back at once: tokens stream in chunks of at "
                      "most this many (default 16)")
  r.add_argument("--min-interval", type=int, default=None,
                 help="--stepping entries: steps per loop entry while fewer than a sixteenth of "
                      "the sequences run and nothing waits: the longest a request waits to join "
                      "a quiet server (default interval / 4)")
  r.add_argument("--speculative-method", choices=("ngram",), default=None,
                 help="draft tokens for greedy requests and verify them in one step (ngram: "
                      "prompt lookup in the request's own tokens); the tokens are the same")
  r.add_argument("--num-speculative-tokens", type=int, default=None,
                 help="most draft tokens per sequence and step (default 3; at most "
                      "--max-write - 1)")
  r.add_argument("--prompt-lookup-min", type=int, default=None,
                 help="ngram: shortest suffix looked up (default 1)")
  r.add_argument("--prompt-lookup-max", type=int, default=None,
                 help="ngram: longest suffix looked up, tried first (default 3)")
  r.add_argument("--scheduling", choices=("fcfs", "longest_first"), default="fcfs",
                 help="admission order of waiting requests (default fcfs)")
  r.add_argument("--max-queued", type=int, default=4096,
                 help="requests waiting for admission beyond which new ones get 503 with "
                      "Retry-After (default 4096)")
  r.add_argument("--max-queued-tokens", type=int, default=2**23,
                 help="prompt tokens waiting for admission beyond which new requests get 503 "
                      "with Retry-After (default 8388608)")
  r.add_argument("--api-key", default=os.environ.get("JAXKV_API_KEY"),
                 help="require 'Authorization: Bearer KEY' on every /v1 route (default: the "
                      "JAXKV_API_KEY environment variable, else no key)")
  r.add_argument("--allowed-origins", default=None,
                 help="comma-separated origins allowed by CORS (default: none)")
  r.add_argument("--max-body-bytes", type=int, default=32 * 2**20,
                 help="largest request body; larger ones get 413 (default 32 MiB)")
  r.add_argument("--max-prompts", type=int, default=1024,
                 help="most prompts in one completions request; more get 413 (default 1024)")
  r.add_argument("--stats-interval", type=float, default=10.0,
                 help="seconds between one-line stats logs while serving; 0: none (default 10)")
  r.add_argument("--compilation-cache", default=DEFAULT_COMPILATION_CACHE,
                 help="JAX persistent compilation cache directory, or 'none' (default "
                      f"{DEFAULT_COMPILATION_CACHE})")
  r.add_argument("--chat-template", default=None, metavar="FILE_OR_NAME",
                 help="the chat template: a file of Jinja text, or a template name of the "
                      "checkpoint's set (default: the checkpoint's default template)")
  r.add_argument("--tool-call-parser", default="auto",
                 choices=["auto", "none", "llama3_json", "mistral", "hermes"],
                 help="how tool calls are read out of text for tool_choice=auto: a format, "
                      "'none' (tool_choice=auto is refused), or 'auto' (default: the model "
                      "family's: llama3_json for Llama, mistral for Mistral, hermes for "
                      "Qwen2/3; none for Gemma 3)")
  r.add_argument("--grammar-compile-timeout", type=float, default=60.0,
                 help="seconds a structured-output schema may take to compile; a longer one "
                      "gets 400 naming its field (default 60)")
  r.add_argument("--implementation", choices=["reference", "mosaic_gpu", "interpret"],
                 default=None, help="attention implementation (default: automatic)")
  r.add_argument("--max-logprobs", type=int, default=None,
                 help="most top logprobs a request may ask for per token (default 20, or the "
                      "vocabulary if smaller)")
  r.add_argument("--shutdown-timeout", type=float, default=30.0,
                 help="on SIGTERM/SIGINT: seconds in-flight requests may take to finish before "
                      "they are aborted (default 30); new connections are refused meanwhile")
  r.add_argument("--log-level", default="info", choices=_LOG_LEVELS,
                 help="uvicorn log level (default info)")
  return p


def _version() -> str:
  from jaxkv import __version__   # pylint: disable=g-import-not-at-top
  return __version__


def build_server(checkpoint: str, *, max_seqs: int | None = None, max_len: int | None = None,
                 max_write: int = 512, page_size: int | None = 64, dtype: str = "auto",
                 kv_cache_dtype: str = "auto", kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float | None = None, prefix_caching: bool = True,
                 tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                 implementation: str | None = None,
                 max_logprobs: int | None = None, scheduling: str = "fcfs", flags: bool = False,
                 speculative=None):
  """`(engine, tokenizer, plan)` for a checkpoint: sized from memory, loaded, the engine built.

  The flags' values go to `jaxkv.serve.loading.build_engine` (sizing:
  `jaxkv.serve.sizing.plan_serving`); a server needs the checkpoint's tokenizer.

  Raises:
    ValueError: a bad checkpoint or size (named).
  """
  from jaxkv.serve.loading import build_engine   # pylint: disable=g-import-not-at-top
  engine, _, tokenizer, plan = build_engine(
      checkpoint, tensor_parallel_size=tensor_parallel_size,
      data_parallel_size=data_parallel_size, max_logprobs=max_logprobs,
      scheduling=scheduling, need_tokenizer=True, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
      max_len=max_len, max_seqs=max_seqs, page_size=page_size, kv_cache_memory=kv_cache_memory,
      gpu_memory_utilization=gpu_memory_utilization, prefix_caching=prefix_caching,
      max_write=max_write, implementation=implementation, flags=flags, speculative=speculative)
  return engine, tokenizer, plan


def speculative_config(args):
  """The `SpeculativeConfig` the speculative flags name, or None (ValueError naming a flag)."""
  if args.speculative_method is None:
    for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
      if getattr(args, name) is not None:
        raise ValueError(f"--{name.replace('_', '-')} needs --speculative-method")
    return None
  from jaxkv.serve import SpeculativeConfig   # pylint: disable=g-import-not-at-top
  given = {"k": args.num_speculative_tokens, "ngram_min": args.prompt_lookup_min,
           "ngram_max": args.prompt_lookup_max}
  return SpeculativeConfig(method=args.speculative_method,
                           **{k: v for k, v in given.items() if v is not None})


def warm_up(aio) -> float:
  """`AsyncEngine.warm_up`: compiles what serving runs before the first client; the compile
  seconds.

  Everything alive after it (the model, the compiled loop, the imports) is then frozen out of
  the garbage collector's generations (`gc.freeze`), so a full collection under load walks
  only the objects serving makes, not the whole start-up heap.
  """
  seconds = aio.warm_up()
  gc.collect()
  gc.freeze()
  return seconds


def summary(stats, since) -> str:
  """The closing line: tokens served since `since` (the stats after the warm-up, an
  `EngineStats` copy), their serving time and tokens/s, apart from compile time."""
  tokens = stats.generated - since.generated
  seconds = stats.serve_seconds - since.serve_seconds
  rate = f"{tokens / seconds:.1f} tokens/s" if seconds > 0 else "no serving time"
  return (f"jaxkv serve: generated {tokens} tokens in {seconds:.2f} s of serving ({rate}, "
          f"compilation excluded); compile {stats.compile_seconds:.2f} s in all")


def _check_args(args) -> str | None:
  """The first bad flag's message, or None (checked before anything is loaded)."""
  if (args.model is None) == (args.checkpoint is None):
    return ("give the checkpoint once: as the positional model or as --checkpoint/--model"
            if args.model is not None else "the checkpoint is required: jaxkv serve MODEL "
            "(a directory or a Hugging Face model id), or --checkpoint MODEL")
  for name in ("max_write", "interval", "tensor_parallel_size", "data_parallel_size",
               "max_queued", "max_queued_tokens", "max_body_bytes", "max_prompts",
               "api_server_count"):
    if getattr(args, name) < 1:
      return f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1"
  for name in ("max_seqs", "max_len", "min_interval", "kv_cache_memory"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      return f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1"
  if args.page_size < 0:
    return f"--page-size={args.page_size} must be >= 0 (0: column storage)"
  if not 1 <= args.port <= 65535:
    return f"--port={args.port} must be in [1, 65535]"
  if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
    return f"--gpu-memory-utilization={args.gpu_memory_utilization} must be in (0, 1]"
  if args.max_logprobs is not None and args.max_logprobs < 0:
    return f"--max-logprobs={args.max_logprobs} must be >= 0"
  if args.shutdown_timeout < 0:
    return f"--shutdown-timeout={args.shutdown_timeout} must be >= 0"
  if args.stats_interval < 0:
    return f"--stats-interval={args.stats_interval} must be >= 0"
  if not args.grammar_compile_timeout > 0:
    return f"--grammar-compile-timeout={args.grammar_compile_timeout} must be > 0"
  if args.api_key is not None and not args.api_key:
    return "--api-key must not be empty"
  return _port_taken(args.host, args.port)


def _port_taken(host: str, port: int) -> str | None:
  """Why `host:port` cannot be listened on, or None: checked before the minutes of loading and
  compiling, not after (the server binds it again when it starts)."""
  import socket   # pylint: disable=g-import-not-at-top
  try:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
  except OSError as e:
    return f"--host={host}: {e}"
  family, kind, proto, _, address = infos[0]
  with socket.socket(family, kind, proto) as sock:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds
    try:
      sock.bind(address)
    except OSError as e:
      return f"--port={port}: cannot listen on {host}:{port}: {e.strerror or e}"
  return None


def _tool_call_parser(choice: str, checkpoint: str) -> str | None:
  """`--tool-call-parser`'s parser name (None: none), "auto" read from config.json's model_type."""
  if choice != "auto":
    return None if choice == "none" else choice
  from jaxkv.http.tools import FAMILY_PARSERS   # pylint: disable=g-import-not-at-top
  try:
    with open(os.path.join(checkpoint, "config.json"), encoding="utf-8") as f:
      family = json.load(f).get("model_type")
  except (OSError, ValueError, AttributeError):
    return None
  return FAMILY_PARSERS.get(family)


def serve(args) -> int:
  try:
    import uvicorn  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import  (checked up front)
    from jaxkv.http.app import create_app   # pylint: disable=g-import-not-at-top
  except ImportError as e:
    print(f"jaxkv serve needs the serve extra (pip install 'jaxkv[serve]'): {e}", file=sys.stderr)
    return 2
  problem = _check_args(args)
  if problem:
    print(problem, file=sys.stderr)
    return 2
  args.checkpoint = args.checkpoint or args.model
  chat_template, template_name = args.chat_template, None
  if chat_template is not None and os.path.isfile(chat_template):
    with open(chat_template, encoding="utf-8") as f:
      chat_template = f.read()
  elif chat_template is not None and not any(mark in chat_template for mark in ("{{", "{%")):
    template_name = chat_template   # neither a file nor Jinja text: a name, checked once loaded
  from jaxkv.serve.loading import use_compilation_cache   # pylint: disable=g-import-not-at-top
  started = time.perf_counter()
  cache_dir = use_compilation_cache(args.compilation_cache)
  try:
    speculative = speculative_config(args)
    engine, tokenizer, plan = build_server(
        args.checkpoint, max_seqs=args.max_seqs, max_len=args.max_len, max_write=args.max_write,
        page_size=args.page_size or None, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        prefix_caching=not args.no_prefix_caching,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size, implementation=args.implementation,
        max_logprobs=args.max_logprobs, scheduling=args.scheduling, flags=True,
        speculative=speculative)
  except (ValueError, TypeError, OSError, ImportError) as e:   # TypeError: a config.json type
    print(f"jaxkv serve: {e}", file=sys.stderr)
    return 2
  if template_name is not None:
    names = sorted(tokenizer.chat_template) if isinstance(tokenizer.chat_template, dict) else []
    if template_name not in names:
      print(f"jaxkv serve: --chat-template={template_name!r} is neither a file nor a template "
            f"name of the checkpoint (its names: {names or 'none, one template'})",
            file=sys.stderr)
      return 2
  from jaxkv.serve.report import gemm_line, implementation_lines   # pylint: disable=g-import-not-at-top
  from jaxkv.serve.speculative import describe as describe_speculative   # pylint: disable=g-import-not-at-top
  for line in implementation_lines(engine.implementations):
    print(f"jaxkv serve: {line}", flush=True)
  print(f"jaxkv serve: {gemm_line(engine.gemm)}", flush=True)
  print(f"jaxkv serve: {describe_speculative(speculative)}", flush=True)
  for line in plan.lines():
    print(f"jaxkv serve: {line}", flush=True)
  if args.data_parallel_size > 1:
    print(f"jaxkv serve: data parallel: {args.data_parallel_size} engines, each sized as above, "
          f"on devices {[str(e.device or e.mesh.devices.tolist()) for e in engine.engines]}",
          flush=True)
  print(f"jaxkv serve: compilation cache: {cache_dir or 'off'}", flush=True)
  # Said before it starts: on a CPU the compile takes tens of seconds and would look like a hang.
  name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
  app_args = dict(model_name=name, max_queued=args.max_queued,
                  max_queued_tokens=args.max_queued_tokens,
                  stats_interval=args.stats_interval, api_key=args.api_key,
                  allowed_origins=[o.strip() for o in (args.allowed_origins or "").split(",")
                                   if o.strip()],
                  max_body_bytes=args.max_body_bytes, max_prompts=args.max_prompts,
                  chat_template=chat_template,
                  tool_call_parser=_tool_call_parser(args.tool_call_parser, args.checkpoint),
                  grammar_compile_timeout=args.grammar_compile_timeout)
  aio_args = dict(interval=args.interval, min_interval=args.min_interval,
                  stepping=args.stepping)
  app = create_app(engine, tokenizer, **aio_args, **app_args, on_shutdown=lambda: close())
  print("jaxkv serve: compiling the serving loop with a warm-up request ...", flush=True)
  compiled = warm_up(app.state.aio)
  print(f"jaxkv serve: compiled the serving loop in {compiled:.2f} s (before the first "
        f"client); ready {time.perf_counter() - started:.2f} s after start", flush=True)
  warm = dataclasses.replace(engine.stats)
  closed = []

  def close():   # once: at the app's shutdown (uvicorn re-raises SIGTERM after it), or after run
    if not closed:
      closed.append(True)
      print(summary(engine.stats, warm), flush=True)

  if args.api_server_count > 1:
    app.state.aio.close()   # it compiled the programs; the host's AsyncEngine steps the engine
    del app
    _run_fronts(engine, tokenizer, args, app_args, aio_args)
  else:
    _run_server(app, args)
  close()
  return 0


def _run_fronts(engine, tokenizer, args, app_args: dict, aio_args: dict) -> None:
  """Serves through `--api-server-count` front processes until a shutdown signal has drained
  them (`jaxkv.http.fronts`)."""
  from jaxkv.http.fronts import serve_with_fronts   # pylint: disable=g-import-not-at-top
  serve_with_fronts(
      engine, tokenizer, count=args.api_server_count, host=args.host, port=args.port,
      app_args=app_args, aio_args=aio_args,
      server_args=dict(log_level=args.log_level,
                       timeout_graceful_shutdown=args.shutdown_timeout),
      on_listening=lambda: print(f"jaxkv serve: {args.api_server_count} front processes on "
                                 f"{args.host}:{args.port}", flush=True))


def _run_server(app, args) -> None:
  """Serves `app` until a shutdown signal; the drain answers what is left at the timeout."""
  import uvicorn   # pylint: disable=g-import-not-at-top
  from jaxkv.http.tasks import DrainingServer   # pylint: disable=g-import-not-at-top
  config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                          timeout_graceful_shutdown=args.shutdown_timeout)
  DrainingServer(config, app.state.drain).run()


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  if args.command == "serve":
    return serve(args)
  raise AssertionError(args.command)


if __name__ == "__main__":
  sys.exit(main())
