"""The serving benchmark: the OpenAI server under load, beside the offline engine on the same queue.

A request mix (lognormal prompt and output lengths, seeded) is sent to a jaxkv
server by the official `openai` client (streaming completions over token-id
prompts, greedy, `max_tokens` = the drawn output length), either all at once
or with Poisson arrivals at given rates. The client runs in separate processes
(`--client-procs`), so its own parsing does not share the server's interpreter.

Against `--url` it measures a running server. Without it, it builds the engine
in this process over `--checkpoint` (or a random-weights checkpoint it writes
with `--write-checkpoint DIR`: the Llama 3.2 1B shape with a word-level
tokenizer covering the whole vocabulary), first serves the same queue offline
with `Engine.run` (the anchor: same engine, same weights), then puts the
OpenAI app on the same engine and sends the queue through HTTP.

Reported per run: wall time, useful (generated) tokens/s, TTFT, time per output
token (TPOT, per request) and inter-chunk latency (ITL) percentiles, end-to-end
latency, goodput (requests/s meeting `--slo-ttft` and `--slo-tpot`), and the
server-to-offline throughput ratio. Writes JSON (`--out`) and a PNG (`--png`:
TTFT CDFs, throughput and p99 TTFT against the arrival rate).

Usage:
  python benchmarks/serve.py --small                          # CPU smoke, a tiny model
  python benchmarks/serve.py --write-checkpoint /tmp/llama1b --rates inf,4,16,64
  python benchmarks/serve.py --url http://127.0.0.1:8000 --model NAME --rates inf
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--small", action="store_true", help="a tiny model and queue (CPU smoke)")
  p.add_argument("--url", default=None, help="measure this running server (no offline anchor)")
  p.add_argument("--model", default=None, help="with --url: the model id to send")
  p.add_argument("--checkpoint", default=None, help="serve this checkpoint directory")
  p.add_argument("--write-checkpoint", default=None, metavar="DIR",
                 help="write a random-weights checkpoint here (reused if present) and serve it")
  p.add_argument("--requests", type=int, default=256)
  p.add_argument("--prompt-median", type=int, default=300)
  p.add_argument("--output-median", type=int, default=150)
  p.add_argument("--engine", choices=("default", "columns"), default=None,
                 help="the engine under the server: 'default' is the one `jaxkv serve --checkpoint "
                      "DIR` builds with no sizing flags (paged, sized from device memory, "
                      "max_len from the checkpoint); 'columns' is --slots columns of rows for the "
                      "queue's longest request. Either way the best offline anchor (columns, "
                      "longest first) runs first on a columns engine of its own (default: 'default'; "
                      "'columns' with --small)")
  p.add_argument("--slots", type=int, default=64, help="columns engine: columns (max_seqs)")
  p.add_argument("--max-write", type=int, default=512, help="step width W")
  p.add_argument("--trace", default=None, metavar="DIR",
                 help="after the first all-at-once server run, send the same queue once more "
                      "under jax.profiler (into DIR, the Python tracer off) and print its device "
                      "busy time, idle gaps and host calls per step")
  p.add_argument("--vocab", type=int, default=None,
                 help="with --url: prompt token ids are drawn below this (the model's vocab_size)")
  p.add_argument("--rates", default="inf",
                 help="comma-separated arrival rates in requests/s; inf = all at once")
  p.add_argument("--rate-requests", type=int, default=0,
                 help="requests per finite-rate run (default: --requests)")
  p.add_argument("--raw-client", action="store_true",
                 help="finite rates run a second time with a bare HTTP/1.1 client: the "
                      "latencies without the openai client's own per-request and per-chunk work")
  p.add_argument("--client-procs", type=int, default=8,
                 help="client processes; a stream fed every step costs the openai client about "
                      "as much as it costs the server, and 4 processes could not keep up with "
                      "256 such streams (their ITL, not the server's)")
  p.add_argument("--server-configs", default="16:fcfs:steps",
                 help="in-process server settings to measure, comma-separated "
                      "INTERVAL:SCHEDULING:STEPPING[:SWITCH_US[:AHEAD[:FRONT]]] (steps per "
                      "entry read back; fcfs or longest_first; steps or entries, as `jaxkv serve "
                      "--stepping`; the interpreter's switch interval in microseconds and the "
                      "steps queued ahead, the AsyncEngine's switch_interval and run_ahead; "
                      "FRONT auto (uvloop and httptools where installed, as `jaxkv serve`), "
                      "asyncio (asyncio's loop and h11) or pN (N front processes, `jaxkv serve "
                      "--api-server-count N`)), consecutive configs of one scheduling on one "
                      "engine over the same weights")
  p.add_argument("--compilation-cache", default="none",
                 help="JAX persistent compilation cache directory (default none): later "
                      "engines of the run load the serving loop from it")
  p.add_argument("--temperature", type=float, default=0.0,
                 help="every request's temperature (default 0: greedy); above 0 request i is "
                      "seeded with i, in the server's queue and the offline anchors alike")
  p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput: TTFT bound, seconds")
  p.add_argument("--slo-tpot", type=float, default=0.05, help="goodput: TPOT bound, seconds")
  p.add_argument("--no-offline", action="store_true", help="skip the offline Engine.run anchor")
  p.add_argument("--skip-best", action="store_true",
                 help="skip the best offline row (the 64-column engine), keep the server "
                      "engine's own offline anchors")
  p.add_argument("--offline-incremental", action="store_true",
                 help="also run the queue offline through the incremental API (LLM.generate's path)")
  p.add_argument("--offline-entry-steps", default="",
                 help="also run offline with at most these many steps per loop entry (comma-"
                      "separated): the cost of visiting the host more often")
  p.add_argument("--profile", default="",
                 help="comma-separated module:Class.method names to time in the server process")
  p.add_argument("--cprofile", action="store_true",
                 help="print cProfile tables: the offline run with the first --offline-entry-steps "
                      "value and the server's driver (the method named by --driver-method)")
  p.add_argument("--driver-method", default="jaxkv.serve.live:LiveQueue.step",
                 help="with --cprofile: the driver's per-entry method to profile")
  p.add_argument("--out", default=None, help="write results JSON here")
  p.add_argument("--png", default=None, help="write the plots here (needs matplotlib)")
  args = p.parse_args(argv)
  if args.small:
    args.requests, args.prompt_median, args.output_median = 12, 12, 6
    args.slots, args.max_write, args.client_procs = 4, 32, 2
  if args.engine is None:
    args.engine = "columns" if args.small else "default"
  try:
    args.rate_list = [math.inf if r.strip() == "inf" else float(r) for r in args.rates.split(",")]
  except ValueError:
    p.error(f"--rates {args.rates!r}: comma-separated numbers or inf")
  if any(r <= 0 for r in args.rate_list):
    p.error("--rates must be positive")
  if args.url and (not args.model or not args.vocab):
    p.error("--url needs --model and --vocab")
  if not args.url and not (args.checkpoint or args.write_checkpoint or args.small):
    p.error("give --checkpoint, --write-checkpoint or --url (or --small)")
  return args


# ------------------------------------------------------------------ the workload

def lengths(rng, n, median, cap, sigma=0.8, floor=1) -> list[int]:
  """Lognormal lengths around `median`, clipped to [floor, cap] (benchmarks/e2e.py's mixed draw)."""
  return [int(min(cap, max(floor, round(x)))) for x in rng.lognormal(np.log(median), sigma, n)]


def workload(n, prompt_median, output_median, vocab, *, seed=0, prompt_cap=2048, output_cap=768):
  """`(prompts, max_tokens)`: random token-id prompts and output lengths, seeded."""
  rng = np.random.default_rng(seed)
  plens = lengths(rng, n, prompt_median, prompt_cap, floor=4)
  outs = lengths(rng, n, output_median, output_cap)
  prompts = [rng.integers(0, vocab, size=m).astype(np.int32).tolist() for m in plens]
  return prompts, outs


# ------------------------------------------------------------------ a checkpoint

def write_checkpoint(path: str, *, small: bool) -> str:
  """A random-weights Llama checkpoint (bf16 safetensors, config.json, tokenizer.json) at `path`.

  The tokenizer is word-level over the whole vocabulary (`t0`, `t1`, ...), so every id the random
  model samples decodes; it has no EOS, so requests end at `max_tokens`, as offline.
  """
  if os.path.exists(os.path.join(path, "config.json")):
    return path
  import jax   # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp   # pylint: disable=g-import-not-at-top
  from safetensors.flax import save_file   # pylint: disable=g-import-not-at-top
  from tokenizers import Tokenizer, models, pre_tokenizers   # pylint: disable=g-import-not-at-top
  from jaxkv.models import ModelConfig   # pylint: disable=g-import-not-at-top
  from jaxkv.models.hf import expected_tensors   # pylint: disable=g-import-not-at-top
  shape = (dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16) if small else
           dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                num_heads=32, num_kv_heads=8, head_dim=64))
  cfg = ModelConfig.llama(tie_embeddings=True, **shape)
  os.makedirs(path, exist_ok=True)
  key = jax.random.PRNGKey(0)
  tensors = {}
  for i, (name, tshape) in enumerate(sorted(expected_tensors(cfg).items())):
    if name.endswith("norm.weight"):
      tensors[name] = jnp.ones(tshape, jnp.bfloat16)
    else:
      scale = 1.0 / math.sqrt(tshape[-1])
      tensors[name] = (jax.random.normal(jax.random.fold_in(key, i), tshape, jnp.float32)
                       * scale).astype(jnp.bfloat16)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.save(os.path.join(path, "tokenizer.json"))
  config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
            "vocab_size": shape["vocab_size"], "hidden_size": shape["hidden_size"],
            "intermediate_size": shape["intermediate_size"],
            "num_hidden_layers": shape["num_layers"], "num_attention_heads": shape["num_heads"],
            "num_key_value_heads": shape["num_kv_heads"], "head_dim": shape["head_dim"],
            "max_position_embeddings": 4096 if small else 131072, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "tie_word_embeddings": True, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False}
  # config.json last: its presence marks a whole checkpoint (reused by later runs).
  with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=1)
  return path


# ------------------------------------------------------------------ the client

def _percentiles(xs) -> dict:
  if not xs:
    return {"p50": None, "p90": None, "p99": None, "mean": None}
  a = np.asarray(xs, float)
  return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
          "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def sampling(i: int, temperature: float) -> dict:
  """Request `i`'s sampling fields (`--temperature`): greedy, or T with seed `i`, so the
  server and the offline anchors draw the same tokens."""
  return {"temperature": 0.0} if temperature == 0 else {"temperature": temperature, "seed": i}


async def _one(client, model, prompt, max_tokens, send_at, start, extra):
  await asyncio.sleep(max(0.0, start + send_at - time.time()))
  sent = time.time()
  chunks, tokens, error = [], None, None
  try:
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, **extra)
    async for chunk in stream:
      if chunk.usage is not None:
        tokens = chunk.usage.completion_tokens
      if chunk.choices and chunk.choices[0].text:
        chunks.append(time.time())
  except Exception as e:   # pylint: disable=broad-except  (counted as a failed request)
    error = f"{type(e).__name__}: {e}"
  return {"sent": sent, "chunks": chunks, "tokens": tokens, "done": time.time(), "error": error}


async def _one_raw(url, model, prompt, max_tokens, send_at, start, extra):
  """`_one` over a bare HTTP/1.1 connection: the server's latency without the openai client's
  own per-request and per-chunk work (which a client of that SDK pays as well)."""
  import urllib.parse   # pylint: disable=g-import-not-at-top
  await asyncio.sleep(max(0.0, start + send_at - time.time()))
  sent = time.time()
  chunks, tokens, error = [], None, None
  u = urllib.parse.urlsplit(url)
  body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                     "stream": True, "stream_options": {"include_usage": True}} | extra).encode()
  head = (f"POST {u.path}/v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\n"
          f"Authorization: Bearer {os.environ.get('JAXKV_API_KEY', 'x')}\r\n"
          f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
          "Connection: close\r\n\r\n").encode()
  writer = None
  try:
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    writer.write(head + body)
    status = await reader.readline()
    if b" 200 " not in status:
      raise RuntimeError(status.decode().strip())
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
      chunked |= line.lower().startswith(b"transfer-encoding: chunked")
    pending, done = b"", False
    while not done:
      if chunked:
        size = int((await reader.readline()).split(b";")[0], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
          break
        pending += data[:-2]
      else:
        data = await reader.read(65536)
        if not data:
          break
        pending += data
      now = time.time()
      *events, pending = pending.split(b"\n\n")
      for event in events:
        payload = event.removeprefix(b"data: ")
        if payload == b"[DONE]":
          done = True
          break
        msg = json.loads(payload)
        if msg.get("usage"):
          tokens = msg["usage"]["completion_tokens"]
        if msg.get("choices") and msg["choices"][0].get("text"):
          chunks.append(now)
  except Exception as e:   # pylint: disable=broad-except  (counted as a failed request)
    error = f"{type(e).__name__}: {e}"
  finally:
    if writer is not None:
      writer.close()
  return {"sent": sent, "chunks": chunks, "tokens": tokens, "done": time.time(), "error": error}


def _client_main(url, model, jobs, conn, client="openai"):
  """One client process: sends its `jobs` (index, prompt, max_tokens, send offset, sampling
  fields), returns results.

  It reports ready once imported and connected, then waits for the common start time, so a
  process that imports slowly (a cold bytecode cache) cannot spread an all-at-once queue.
  """
  if client == "raw":
    async def main_raw():
      conn.send("ready")
      start = await asyncio.to_thread(conn.recv)
      return await asyncio.gather(*[_one_raw(url, model, p, m, at, start, x)
                                    for _, p, m, at, x in jobs])
    results = asyncio.run(main_raw())
    conn.send([(j[0], r) for j, r in zip(jobs, results)])
    conn.close()
    return
  import openai   # pylint: disable=g-import-not-at-top
  try:   # the client's HTTP package: httpx2 from openai 3 on, httpx before
    import httpx2 as httpx   # pylint: disable=g-import-not-at-top
  except ImportError:
    import httpx   # pylint: disable=g-import-not-at-top

  async def main():
    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=4096,
                                                              max_keepalive_connections=4096))
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=os.environ.get("JAXKV_API_KEY", "x"),
                                max_retries=0, timeout=3600.0, http_client=http)
    await client.models.list()   # the first connection and the whole request path, warmed
    conn.send("ready")
    start = await asyncio.to_thread(conn.recv)
    out = await asyncio.gather(*[_one(client, model, p, m, at, start, x)
                                 for _, p, m, at, x in jobs])
    await client.close()
    return out

  results = asyncio.run(main())
  conn.send([(j[0], r) for j, r in zip(jobs, results)])
  conn.close()


def send_queue(url, model, prompts, max_tokens, rate, procs, *, seed=0, client="openai",
               temperature: float = 0.0) -> dict:
  """Sends the queue (all at once for rate inf, else Poisson arrivals); per-request records."""
  rng = np.random.default_rng(seed + 1)
  n = len(prompts)
  offsets = (np.zeros(n) if math.isinf(rate)
             else np.cumsum(rng.exponential(1.0 / rate, n)) - 0.0)
  ctx = multiprocessing.get_context("spawn")
  workers = []
  for k in range(procs):
    jobs = [(i, prompts[i], max_tokens[i], float(offsets[i]), sampling(i, temperature))
            for i in range(k, n, procs)]
    if not jobs:
      continue
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_client_main, args=(url, model, jobs, child, client), daemon=True)
    proc.start()
    workers.append((proc, parent))
  for proc, parent in workers:   # every process imported and connected before the first send
    while not parent.poll(1.0):
      if not proc.is_alive():
        raise RuntimeError(f"a client process exited with code {proc.exitcode} (see its error)")
    assert parent.recv() == "ready"
  start = time.time() + 0.2
  for _, parent in workers:
    parent.send(start)
  records = [None] * n
  for proc, parent in workers:
    while not parent.poll(1.0):   # a client process that died would leave recv() waiting
      if not proc.is_alive():
        raise RuntimeError(f"a client process exited with code {proc.exitcode} (see its error)")
    for i, r in parent.recv():
      records[i] = r
    proc.join()
  return summarize(records, max_tokens)


def summarize(records, max_tokens, slo_ttft=2.0, slo_tpot=0.05) -> dict:
  ok = [r for r in records if r["error"] is None]
  ttft = [r["chunks"][0] - r["sent"] for r in ok if r["chunks"]]
  tpot = [(r["chunks"][-1] - r["chunks"][0]) / (r["tokens"] - 1) for r in ok
          if r["chunks"] and r["tokens"] and r["tokens"] > 1]
  itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
  e2e = [r["done"] - r["sent"] for r in ok]
  first = min(r["sent"] for r in records)
  last = max(r["done"] for r in records)
  generated = sum(r["tokens"] or 0 for r in ok)
  good = sum(1 for r in ok if r["chunks"] and r["chunks"][0] - r["sent"] <= slo_ttft and (
      not r["tokens"] or r["tokens"] < 2
      or (r["chunks"][-1] - r["chunks"][0]) / (r["tokens"] - 1) <= slo_tpot))
  short = sum(1 for r, m in zip(records, max_tokens) if r["error"] is None and r["tokens"] != m)
  wall = last - first
  sent = [r["sent"] for r in records]
  return {"requests": len(records), "failed": len(records) - len(ok),
          "send_spread_s": max(sent) - min(sent),
          "errors": sorted({r["error"] for r in records if r["error"]})[:5],
          "short": short, "wall_s": wall, "generated": generated,
          "tokens_per_s": generated / wall, "goodput_rps": good / wall,
          "ttft_s": _percentiles(ttft), "tpot_s": _percentiles(tpot), "itl_s": _percentiles(itl),
          "e2e_s": _percentiles(e2e), "ttft_all": sorted(ttft)}


# ------------------------------------------------------------------ in-process server

def _print_profile(title, prof, n=22):
  import io   # pylint: disable=g-import-not-at-top
  import pstats   # pylint: disable=g-import-not-at-top
  for key in ("tottime", "cumulative"):
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(n)
    body = [l for l in buf.getvalue().splitlines() if l.strip()][3:]
    print(f"--- cProfile {title} by {key}\n" + "\n".join(body), flush=True)


def _resolve(name):
  """`(owner, attribute)` of a `module:Class.method` name."""
  import importlib   # pylint: disable=g-import-not-at-top
  mod, attr = name.split(":")
  owner = importlib.import_module(mod)
  parts = attr.split(".")
  for part in parts[:-1]:
    owner = getattr(owner, part)
  return owner, parts[-1]


def _profile_method(name, prof):
  """Wraps `module:Class.method` so each call runs under `prof` (in whichever thread calls it)."""
  owner, attr = _resolve(name)
  fn = getattr(owner, attr)

  def profiled(*a, **k):
    prof.enable()
    try:
      return fn(*a, **k)
    finally:
      prof.disable()
  setattr(owner, attr, profiled)


class _Timers:
  """Wraps `module:Class.method` callables to count calls and seconds (`--profile`)."""

  def __init__(self, names):
    self.totals = {}
    for name in filter(None, (n.strip() for n in names.split(","))):
      self._wrap(*_resolve(name), name)

  def _wrap(self, owner, attr, name):
    fn = getattr(owner, attr)
    self.totals[name] = [0, 0.0]
    totals = self.totals[name]

    def timed(*a, **k):
      t = time.perf_counter()
      try:
        return fn(*a, **k)
      finally:
        totals[0] += 1
        totals[1] += time.perf_counter() - t
    setattr(owner, attr, timed)

  def snapshot(self):
    return {k: (v[0], v[1]) for k, v in self.totals.items()}


class ServerProcess:
  """`python -m jaxkv.cli serve CHECKPOINT` on a free port, as a user starts it, until `close`.

  `ready_s`: seconds from launch until `/health` answered (polled every `poll` seconds). The
  server's output goes to `log_path` (default CHECKPOINT/server.log); `log_text()` reads it.
  """

  def __init__(self, checkpoint: str, flags: list[str], *, compilation_cache: str = "none",
               model_name: str = "bench", log_path: str | None = None, env: dict | None = None,
               poll: float = 1.0, timeout: float = 900.0):
    import urllib.request   # pylint: disable=g-import-not-at-top
    with socket.socket() as sock:
      sock.bind(("127.0.0.1", 0))
      self.port = sock.getsockname()[1]
    self.url = f"http://127.0.0.1:{self.port}"
    self.model_name = model_name
    self.log = open(log_path or os.path.join(checkpoint, "server.log"), "w",   # pylint: disable=consider-using-with
                    encoding="utf-8")
    launched = time.perf_counter()
    self.proc = subprocess.Popen([sys.executable, "-m", "jaxkv.cli", "serve", checkpoint,
                                  "--port", str(self.port), "--model-name", model_name,
                                  "--compilation-cache", compilation_cache, *flags],
                                 stdout=self.log, stderr=subprocess.STDOUT,
                                 env=None if env is None else dict(os.environ, **env))
    while True:
      if self.proc.poll() is not None or time.perf_counter() - launched > timeout:
        self.log.flush()
        tail = "".join(self.log_text().splitlines(keepends=True)[-30:])   # the log stays where it ran
        self.close()
        raise RuntimeError(f"the server did not start (exit status {self.proc.poll()}); the end of "
                           f"{self.log.name}:\n{tail}")
      try:
        with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
          if r.status == 200:
            break
      except OSError:   # not listening yet (URLError and timeouts are OSErrors)
        pass
      time.sleep(poll)
    self.ready_s = time.perf_counter() - launched

  def log_text(self) -> str:
    with open(self.log.name, encoding="utf-8", errors="replace") as f:
      return f.read()

  def close(self):
    """SIGTERM, as a user stops it (it drains), then kill after 60 s."""
    self.proc.terminate()
    try:
      self.proc.wait(60)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()
    self.log.close()


class InProcessServer:
  """The OpenAI app over `engine` on 127.0.0.1, run by uvicorn in a thread, with a loop-lag probe."""

  def __init__(self, app, front: str = "auto"):
    import uvicorn   # pylint: disable=g-import-not-at-top
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      self.port = s.getsockname()[1]
    self.url = f"http://127.0.0.1:{self.port}"
    # "auto" is what `jaxkv serve` gets (uvloop and httptools where installed); "asyncio"
    # the pure-Python pair (asyncio's loop, h11).
    loop, http = ("auto", "auto") if front == "auto" else ("asyncio", "h11")
    config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                            lifespan="on", loop=loop, http=http)
    self.server = uvicorn.Server(config)
    self.lags, self.gil_lags = [], []
    self.thread = threading.Thread(
        target=lambda: asyncio.run(self._main(), loop_factory=config.get_loop_factory()),
        daemon=True)
    self.thread.start()
    self._gil_probe = threading.Thread(target=self._gil, daemon=True)
    self._gil_probe.start()
    deadline = time.time() + 60
    while not self.server.started:
      if time.time() > deadline or not self.thread.is_alive():
        raise RuntimeError("the in-process server did not start")
      time.sleep(0.05)
    http = getattr(config, "http_protocol_class", None)
    self.front = (f"{getattr(http, '__module__', '?').rsplit('.', 1)[-1].removesuffix('_impl')}"
                  f" on {self.loop_kind}")

  async def _main(self):
    self.loop = asyncio.get_running_loop()
    self.loop_kind = type(self.loop).__module__.split(".")[0]
    probe = asyncio.ensure_future(self._probe())
    try:
      await self.server.serve()
    finally:
      probe.cancel()

  async def _probe(self):   # how late the event loop wakes from a 10 ms sleep
    while True:
      t = time.perf_counter()
      await asyncio.sleep(0.01)
      self.lags.append(time.perf_counter() - t - 0.01)

  def _gil(self):
    # How late a thread wakes from a 1 ms sleep: mostly the wait for the interpreter lock,
    # which the driver pays each time a step's launch or a device wait returns.
    while not self.server.should_exit:
      t = time.perf_counter()
      time.sleep(0.001)
      self.gil_lags.append(time.perf_counter() - t - 0.001)

  def stop(self):
    self.server.should_exit = True
    self.thread.join(timeout=30)
    self._gil_probe.join(timeout=5)


def _serve_fronts(args, results, engine, tokenizer, prompts, max_tokens, tag, count, aio_args):
  """`run_rates` against `count` front processes (`jaxkv.http.fronts.FrontProcesses`)."""
  from jaxkv.http.fronts import FrontProcesses   # pylint: disable=g-import-not-at-top
  fronts = FrontProcesses(engine, tokenizer, count=count, host="127.0.0.1", port=0,
                          app_args=dict(model_name="bench"),
                          server_args=dict(log_level="warning"), aio_args=aio_args)
  fronts.start()
  thread = threading.Thread(target=fronts.serve, daemon=True)
  thread.start()
  url = f"http://127.0.0.1:{fronts.port}"
  deadline = time.time() + 120
  while True:   # the fronts import and build their apps
    try:
      with socket.create_connection(("127.0.0.1", fronts.port), timeout=1) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        if c.recv(64).startswith(b"HTTP/1.1 200"):
          break
    except OSError:
      pass
    if time.time() > deadline:
      raise RuntimeError("the front processes did not start")
    time.sleep(0.2)
  print(f"  HTTP front: {count} processes", flush=True)
  try:
    # Each front process keeps its own /metrics: one scrape would see one front's share.
    run_rates(args, results, url, "bench", prompts, max_tokens, None, None, tag, engine=engine,
              server_metrics=False)
  finally:
    fronts.stop()
    thread.join(timeout=60)
    engine.core.drop()


def build_engine(checkpoint, args, prompts, max_tokens):
  """`(model, max_len, tokenizer)`: the checkpoint loaded as bf16 over a cache sized for the queue."""
  import jax.numpy as jnp   # pylint: disable=g-import-not-at-top
  from jaxkv.models import hf   # pylint: disable=g-import-not-at-top
  from jaxkv.tokenizer import Tokenizer   # pylint: disable=g-import-not-at-top
  longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
  rows = -(-longest // 128) * 128
  capacity = max(min(sum(len(p) + m for p, m in zip(prompts, max_tokens)), args.slots * rows), rows)
  kwargs = dict(capacity=capacity, max_seqs=args.slots, max_write=args.max_write,
                dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, initial_capacity=rows)
  model, _, _ = hf.load_model(checkpoint, **kwargs)
  return model, rows, Tokenizer.from_checkpoint(checkpoint)


def run_offline(engine, prompts, max_tokens, admission, max_steps=None, prof=None,
                temperature: float = 0.0) -> dict:
  from jaxkv.serve import Request, SamplingParams   # pylint: disable=g-import-not-at-top
  reqs = [Request(tuple(p), SamplingParams(max_tokens=m, **sampling(i, temperature)))
          for i, (p, m) in enumerate(zip(prompts, max_tokens))]
  saved = engine.max_steps
  engine.max_steps = saved if max_steps is None else max_steps   # a traced loop argument
  try:
    engine.run(reqs, admission=admission)   # compiles
    t = time.perf_counter()
    if prof is not None:
      prof.enable()
    done = engine.run(reqs, admission=admission)
    if prof is not None:
      prof.disable()
    wall = time.perf_counter() - t
  finally:
    engine.max_steps = saved
  generated = sum(len(c.tokens) for c in done)
  stats = engine.stats
  ttft = [c.timing.first_token_seconds for c in done if c.timing.first_token_seconds is not None]
  return {"admission": admission, "wall_s": wall, "generated": generated,
          "tokens_per_s": generated / wall, "steps": stats.steps,
          "step_ms": 1e3 * stats.step_seconds, "loop_entries": stats.loop_entries,
          "ttft_s": _percentiles(ttft),
          "tokens": {c.request_id: c.tokens for c in done}}


def run_incremental(engine, prompts, max_tokens, temperature: float = 0.0) -> dict:
  """The queue through the incremental API (`add_request`, then `step` of `max_steps` until
  done): `jaxkv.LLM.generate`'s path, fcfs, on the same engine. Run twice, the second timed."""
  from jaxkv.serve import Request, SamplingParams   # pylint: disable=g-import-not-at-top
  for timed in (False, True):
    tokens, first, start = {}, {}, time.perf_counter()
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
      engine.add_request(Request(tuple(p), SamplingParams(max_tokens=m,
                                                          **sampling(i, temperature)),
                                 request_id=i))
    steps0, entries0 = engine.stats.steps, engine.stats.loop_entries
    while engine.has_unfinished():
      for d in engine.step(engine.max_steps):
        tokens.setdefault(d.request_id, []).extend(d.tokens)
        first.setdefault(d.request_id, time.perf_counter() - start)
    wall = time.perf_counter() - start
  generated = sum(map(len, tokens.values()))
  steps = engine.stats.steps - steps0
  return {"admission": "fcfs", "wall_s": wall, "generated": generated,
          "tokens_per_s": generated / wall, "steps": steps, "step_ms": 1e3 * wall / max(1, steps),
          "loop_entries": engine.stats.loop_entries - entries0,
          "ttft_s": _percentiles(list(first.values())), "tokens": tokens}


def _offline(results, key, label, engine, prompts, max_tokens, admission, temperature) -> None:
  off = run_offline(engine, prompts, max_tokens, admission, temperature=temperature)
  results[f"offline_{key}"] = {k: v for k, v in off.items() if k != "tokens"} | {"label": label}
  print(_line(f"offline ({label})", off) + f"  step {off['step_ms']:.2f} ms, "
        f"{off['steps']} steps", flush=True)


def _line(name, r) -> str:
  t, p, i = r["ttft_s"], r.get("tpot_s", {}), r.get("itl_s", {})
  fmt = lambda x: "-" if x is None else f"{1e3 * x:.1f}"
  return (f"{name:<28} {r['wall_s']:8.2f} s {r['tokens_per_s']:10.0f} tok/s  TTFT p50/p90/p99 "
          f"{fmt(t['p50'])}/{fmt(t['p90'])}/{fmt(t['p99'])} ms  TPOT p50 {fmt(p.get('p50'))} ms  "
          f"ITL p50/p99 {fmt(i.get('p50'))}/{fmt(i.get('p99'))} ms"
          + (f"  sends spread {fmt(r['send_spread_s'])} ms" if "send_spread_s" in r else ""))


def plot(results, path):
  import matplotlib   # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt   # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  for name, r in results["server"].items():
    xs = r["ttft_all"]
    axes[0].plot(xs, np.arange(1, len(xs) + 1) / max(1, len(xs)), label=f"rate {name}")
  axes[0].set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
  axes[0].legend(fontsize=7)
  series = {}
  for name, r in results["server"].items():
    tag, _, rate = name.rpartition("/")
    if rate != "inf":
      series.setdefault(tag, []).append((float(rate), r))
  for tag, points in series.items():
    points.sort(key=lambda p: p[0])
    axes[1].plot([k for k, _ in points], [v["tokens_per_s"] for _, v in points], "o-", label=tag)
    axes[2].plot([k for k, _ in points], [v["ttft_s"]["p99"] for _, v in points], "o-", label=tag)
  for ax, title in ((axes[1], "throughput (tok/s)"), (axes[2], "TTFT p99 (s)")):
    ax.set(xlabel="arrival rate (requests/s)", title=title)
    if series:
      ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def _trace_summary(trace_dir, steps, label) -> dict:
  """Device busy time and idle gaps of the newest trace under `trace_dir` (profile_step's
  summary: busy = the union of GPU kernel intervals, over the span from the first kernel to
  the last)."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import profile_step   # pylint: disable=g-import-not-at-top
  summary = profile_step.summarize(trace_dir, steps, label)
  profile_step._print(summary)   # pylint: disable=protected-access
  return {k: v for k, v in summary.items() if k != "all"}


def _traced_run(args, engine, url, model_name, prompts, max_tokens, label) -> dict:
  """Sends the queue at once under `jax.profiler` (into `--trace`); the trace's summary."""
  import jax   # pylint: disable=g-import-not-at-top
  # Device and runtime events only: jax's default Python tracer records every Python call
  # of the server's threads and slows exactly the host work being measured.
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  steps0 = engine.stats.steps
  with jax.profiler.trace(args.trace, profiler_options=options):
    r = send_queue(url, model_name, prompts, max_tokens, math.inf, args.client_procs,
                   temperature=args.temperature)
  print(_line(label, r), flush=True)
  return _trace_summary(args.trace, engine.stats.steps - steps0, label) | {"wall_s": r["wall_s"]}


def _server_sums(url) -> dict:
  """The server's own latency histograms' `_sum` and `_count` (its `/metrics`), by name; {} if
  it has none. Differences of two reads give the server's mean TTFT and queue time for a run:
  the client's TTFT less the server's is the HTTP round trip and the client itself."""
  import urllib.request   # pylint: disable=g-import-not-at-top
  try:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as f:
      text = f.read().decode()
  except OSError:
    return {}
  out = {}
  for line in text.splitlines():
    name, _, value = line.partition(" ")
    base = name.split("{")[0]
    if base.startswith(("jaxkv_time_to_first_token_seconds_", "jaxkv_queue_time_seconds_")) and (
        base.endswith(("_sum", "_count"))):
      out[base] = out.get(base, 0.0) + float(value)
  return out


def _server_means(before: dict, after: dict) -> dict:
  mean = lambda h: ((after[h + "_sum"] - before.get(h + "_sum", 0.0))
                    / max(1.0, after[h + "_count"] - before.get(h + "_count", 0.0))
                    if h + "_sum" in after else None)
  return {"server_ttft_mean_s": mean("jaxkv_time_to_first_token_seconds"),
          "server_queue_mean_s": mean("jaxkv_queue_time_seconds")}


def run_rates(args, results, url, model_name, prompts, max_tokens, server, timers, tag,
              engine=None, server_metrics=True):
  """Sends the queue at every rate of `--rates` and records each run under `tag/rate`."""
  send_queue(url, model_name, prompts[:4], [2] * 4, math.inf, 1)   # the app's paths, warm
  traced = False
  for rate in args.rate_list:
    n = args.requests if math.isinf(rate) or not args.rate_requests else args.rate_requests
    if server is not None:
      server.lags.clear()
      server.gil_lags.clear()
      before = timers.snapshot()
    if engine is not None:
      s0 = engine.stats
      steps0, entries0, pace0, call0 = (s0.steps, s0.loop_entries, s0.pace_seconds,
                                        s0.step_call_seconds)
      admit0, admissions0 = s0.admit_seconds, s0.admissions
    sums0 = _server_sums(url) if server_metrics else {}
    r = send_queue(url, model_name, prompts[:n], max_tokens[:n], rate, args.client_procs,
                   temperature=args.temperature)
    if server_metrics:
      r |= _server_means(sums0, _server_sums(url))
    if engine is not None:
      s1 = engine.stats
      r["steps"] = s1.steps - steps0
      r["loop_entries"] = s1.loop_entries - entries0
      r["wall_ms_per_step"] = 1e3 * r["wall_s"] / max(1, r["steps"])
      # Stepping's driver: waiting for the device (it sets the pace) and inside the steps'
      # calls (the launches, then the interpreter lock), per step.
      r["pace_ms_per_step"] = 1e3 * (s1.pace_seconds - pace0) / max(1, r["steps"])
      r["call_ms_per_step"] = 1e3 * (s1.step_call_seconds - call0) / max(1, r["steps"])
      print(f"  {r['steps']} steps in {r['loop_entries']} loop entries, "
            f"{r['wall_ms_per_step']:.2f} ms of wall per step (driver: waiting for the device "
            f"{r['pace_ms_per_step']:.2f} ms, in step calls {r['call_ms_per_step']:.2f} ms)",
            flush=True)
      r["admissions"] = s1.admissions - admissions0
      r["admit_ms_each"] = 1e3 * (s1.admit_seconds - admit0) / max(1, r["admissions"])
      print(f"  {r['admissions']} admission blocks, {r['admit_ms_each']:.2f} ms in each call "
            "(it returns once the device has run the steps queued before it)", flush=True)
    if r.get("server_ttft_mean_s") is not None:
      print(f"  the server's own means: TTFT {1e3 * r['server_ttft_mean_s']:.1f} ms (client's "
            f"mean {1e3 * (r['ttft_s']['mean'] or 0):.1f} ms), queue {1e3 * r['server_queue_mean_s']:.1f} ms",
            flush=True)
    if server is not None:
      r["loop_lag_s"] = _percentiles(server.lags) | {"max": max(server.lags, default=0.0)}
      r["gil_lag_s"] = _percentiles(server.gil_lags) | {"max": max(server.gil_lags,
                                                                  default=0.0)}
      after = timers.snapshot()
      r["profile"] = {k: {"calls": after[k][0] - before[k][0],
                          "seconds": after[k][1] - before[k][1]} for k in after}
    if args.trace and math.isinf(rate) and not traced and engine is not None:
      # The same load once more under the profiler: the figures above (lag, timers) stay untraced.
      traced = True
      r["trace"] = _traced_run(args, engine, url, model_name, prompts[:n], max_tokens[:n],
                               f"server {tag} rate inf (a second run, traced)")
    name = "inf" if math.isinf(rate) else f"{rate:g}"
    results["server"][f"{tag}/{name}" if tag else name] = r
    print(_line(f"server {tag} rate {name}", r) + f"  failed {r['failed']} short {r['short']}",
          flush=True)
    if r["errors"]:
      print(f"  errors: {r['errors']}", flush=True)
    if args.raw_client and not math.isinf(rate):   # the same arrivals, no SDK in the client
      sums0 = _server_sums(url) if server_metrics else {}
      raw = send_queue(url, model_name, prompts[:n], max_tokens[:n], rate, args.client_procs,
                       client="raw", temperature=args.temperature)
      if server_metrics:
        raw |= _server_means(sums0, _server_sums(url))
      results["server"][(f"{tag}/{name}" if tag else name) + "-raw"] = raw
      print(_line(f"server {tag} rate {name} (bare HTTP client)", raw)
            + f"  failed {raw['failed']} short {raw['short']}", flush=True)
    if "loop_lag_s" in r:
      lag = r["loop_lag_s"]
      print(f"  event-loop lag p50/p99/max {1e3 * (lag['p50'] or 0):.1f}/"
            f"{1e3 * (lag['p99'] or 0):.1f}/{1e3 * lag['max']:.1f} ms", flush=True)
      gil = r["gil_lag_s"]
      print(f"  thread wake-up lag (1 ms sleeps) p50/p99/max {1e3 * (gil['p50'] or 0):.2f}/"
            f"{1e3 * (gil['p99'] or 0):.2f}/{1e3 * gil['max']:.2f} ms", flush=True)
    for k, v in r.get("profile", {}).items():
      print(f"  {k}: {v['calls']} calls, {v['seconds']:.3f} s", flush=True)
    for admission in ("best", "longest_first", "fcfs"):
      off = results.get(f"offline_{admission}")
      if off and math.isinf(rate) and n == len(prompts):
        ratio = r["tokens_per_s"] / off["tokens_per_s"]
        r[f"vs_offline_{admission}"] = ratio
        ttft = lambda q: (r["ttft_s"][q] or 0) / max(1e-9, off["ttft_s"][q] or 0)
        print(f"  server / offline ({admission}): throughput {ratio:.2f}x, TTFT p50 "
              f"{ttft('p50'):.2f}x, p99 {ttft('p99'):.2f}x", flush=True)


def main(argv=None) -> int:
  args = _args(argv)
  results = {"args": {k: v for k, v in vars(args).items() if k != "rate_list"}, "server": {}}
  if args.url:
    url, model_name, vocab = args.url.rstrip("/"), args.model, args.vocab
  else:
    import jax   # pylint: disable=g-import-not-at-top
    checkpoint = args.checkpoint or write_checkpoint(
        args.write_checkpoint or tempfile.mkdtemp(prefix="jaxkv-bench-"), small=args.small)
    from jaxkv.models import hf   # pylint: disable=g-import-not-at-top
    vocab = hf.read_config(checkpoint).vocab_size
  prompts, max_tokens = workload(args.requests, args.prompt_median, args.output_median, vocab)
  print(f"queue: {len(prompts)} requests, prompts {min(map(len, prompts))}..{max(map(len, prompts))} "
        f"(sum {sum(map(len, prompts))}), outputs {min(max_tokens)}..{max(max_tokens)} "
        f"(sum {sum(max_tokens)})", flush=True)
  from jaxkv.serve.aio import SWITCH_INTERVAL   # pylint: disable=g-import-not-at-top
  from jaxkv.serve.live import RUN_AHEAD   # pylint: disable=g-import-not-at-top
  configs = []
  for item in args.server_configs.split(","):
    interval, scheduling, stepping, switch_us, ahead, front = (item.split(":") + [""] * 5)[:6]
    if front not in ("", "auto", "asyncio") and not (front[:1] == "p" and front[1:].isdigit()
                                                     and int(front[1:]) > 1):
      raise SystemExit(f"--server-configs: front {front!r} must be auto, asyncio or pN "
                       "(N > 1 front processes)")
    configs.append((int(interval), scheduling or "fcfs", stepping or "entries",
                    int(switch_us or 1e6 * SWITCH_INTERVAL), int(ahead or RUN_AHEAD),
                    front or "auto"))
  if args.url:
    run_rates(args, results, url, model_name, prompts, max_tokens, None, None, "")
  else:
    from jaxkv.cli import build_server, warm_up   # pylint: disable=g-import-not-at-top
    from jaxkv.serve.loading import use_compilation_cache   # pylint: disable=g-import-not-at-top
    from jaxkv.serve import Engine   # pylint: disable=g-import-not-at-top
    from jaxkv.http.app import create_app   # pylint: disable=g-import-not-at-top
    import cProfile   # pylint: disable=g-import-not-at-top
    use_compilation_cache(args.compilation_cache)
    t = time.perf_counter()
    model, max_len, tokenizer = build_engine(checkpoint, args, prompts, max_tokens)
    engine = Engine(model, max_len=max_len)
    print(f"device {jax.devices()[0].device_kind}; model loaded in {time.perf_counter() - t:.1f} s "
          f"(columns engine: {args.slots} slots, W={args.max_write}, max_len={max_len})",
          flush=True)
    if not args.no_offline and not args.skip_best:
      # The best offline row (columns, longest first), whatever engine the server runs.
      _offline(results, "best", "columns, longest_first", engine, prompts, max_tokens,
               "longest_first", args.temperature)
    if args.engine == "default":
      del engine, model
      gc.collect()   # the columns engine's cache goes before the default one takes the memory
      engine = None
    built = None   # the scheduling the default engine was built for: reused while it holds
    for i, (interval, scheduling, stepping, switch_us, ahead, front) in enumerate(configs):
      if args.engine == "default" and built != scheduling:
        engine = None
        gc.collect()
        t = time.perf_counter()
        engine, tokenizer, plan = build_server(checkpoint, scheduling=scheduling)
        built = scheduling
        if i == 0:
          print(f"default engine built in {time.perf_counter() - t:.1f} s:\n  "
                + "\n  ".join(plan.lines()), flush=True)
      elif built != scheduling:
        engine = Engine(model, max_len=max_len, scheduling=scheduling)
        built = scheduling
      if i == 0 and not args.no_offline:   # the same engine offline: the server's anchor
        for admission in ("longest_first", "fcfs"):
          _offline(results, admission, f"{args.engine} engine, {admission}", engine, prompts,
                   max_tokens, admission, args.temperature)
        if args.offline_incremental:
          off = run_incremental(engine, prompts, max_tokens, args.temperature)
          results["offline_incremental"] = {k: v for k, v in off.items() if k != "tokens"}
          print(_line("offline (incremental API)", off) + f"  wall per step "
                f"{off['step_ms']:.2f} ms, {off['loop_entries']} entries", flush=True)
        for j, k in enumerate(filter(None, args.offline_entry_steps.split(","))):
          prof = cProfile.Profile() if args.cprofile and j == 0 else None
          off = run_offline(engine, prompts, max_tokens, "fcfs", int(k), prof,
                            temperature=args.temperature)
          if prof is not None:
            _print_profile(f"offline, {k}-step entries", prof)
          results[f"offline_fcfs_{k}_steps"] = {k2: v for k2, v in off.items() if k2 != "tokens"}
          print(_line(f"offline (fcfs, {k}-step entries)", off)
                + f"  step {off['step_ms']:.2f} ms, {off['loop_entries']} entries", flush=True)
      app = create_app(engine, tokenizer, model_name="bench", interval=interval,
                       stepping=stepping)
      t = time.perf_counter()
      aio = app.state.aio
      # Experiment knobs of the AsyncEngine create_app builds (not flags of `jaxkv serve`).
      aio.switch_interval, aio.run_ahead = switch_us * 1e-6, ahead
      compiled = warm_up(aio)
      tag = f"i{interval}-{scheduling}-{stepping}" + (
          "" if (switch_us, ahead) == (int(1e6 * SWITCH_INTERVAL), RUN_AHEAD)
          else f"-s{switch_us}-a{ahead}") + ("" if front == "auto" else f"-{front}")
      print(f"server {tag}: warmed up in {time.perf_counter() - t:.1f} s ({compiled:.1f} s "
            "compiling)", flush=True)
      timers = _Timers(args.profile)
      driver_prof = None
      if args.cprofile:   # one profiler at a time in Python 3.12: the driver's
        driver_prof = cProfile.Profile()
        _profile_method(args.driver_method, driver_prof)
      if front.startswith("p"):   # front processes over a host of the engine, as the CLI runs
        # The fronts' host serves the engine with an AsyncEngine of its own: one at a time.
        aio.close(timeout=10)
        del app
        _serve_fronts(args, results, engine, tokenizer, prompts, max_tokens, tag, int(front[1:]),
                      dict(interval=interval, stepping=stepping, switch_interval=switch_us * 1e-6,
                           run_ahead=ahead))
        continue
      server = InProcessServer(app, front)
      print(f"  HTTP front: {server.front}", flush=True)
      try:
        run_rates(args, results, server.url, "bench", prompts, max_tokens, server, timers,
                  tag, engine=engine)
      finally:
        server.stop()
        # The driver threads keep the engine alive: its K/V goes now, before the next engine.
        aio.close(timeout=10)
        engine.core.drop()
        if driver_prof is not None:
          _print_profile("server driver", driver_prof)
      del app
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1)
  if args.png:
    plot(results, args.png)
  return 0


if __name__ == "__main__":
  sys.exit(main())
