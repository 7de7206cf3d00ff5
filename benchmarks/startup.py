"""How long `jaxkv serve` takes to start, and which programs its start compiles.

Starts `jaxkv serve DIR` as a user would (a subprocess, `python -m jaxkv.cli`),
once per run of `--runs`: `cold` with an empty persistent compilation cache directory,
`warm` with the directory the cold run filled (a restart). For each it reports the
seconds from launch until `/health` answers and until a first completion returns, the
server's own "compiled the serving loop in X s" line, and, from jax's compile log
(`JAX_LOG_COMPILES=1` in the server's environment), the tracing, lowering and backend
compile seconds and persistent-cache hits summed by program name, largest first.

  python benchmarks/startup.py --write-checkpoint /tmp/ck --out startup.json   # the 1.24B model
  python benchmarks/startup.py --small                                          # a CPU check
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve import ServerProcess, write_checkpoint   # pylint: disable=g-import-not-at-top,wrong-import-position

_PHASES = (("trace", re.compile(r"Finished tracing (\S+) for jit in ([0-9.e-]+) sec")),
           ("lower", re.compile(r"Finished jaxpr to MLIR module conversion (\S+) in ([0-9.e-]+) sec")),
           ("compile", re.compile(r"Finished XLA compilation of (\S+) in ([0-9.e-]+) sec")))
_HIT = re.compile(r"Persistent compilation cache hit for '([^']+)'")   # by XLA module name
_SERVER = re.compile(r"compiled the serving loop in ([0-9.]+) s .*ready ([0-9.]+) s after start")


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--checkpoint", help="an existing checkpoint directory")
  p.add_argument("--write-checkpoint", default="",
                 help="write the benchmark's random-weights checkpoint here (kept for later runs)")
  p.add_argument("--small", action="store_true", help="a tiny checkpoint and engine (CPU check)")
  p.add_argument("--runs", default="cold,warm",
                 help="comma-separated: cold (an empty compilation cache), warm (the cache the "
                      "previous run filled); default cold,warm")
  p.add_argument("--server-flags", default="",
                 help="more `jaxkv serve` flags, one string (the default: none, as a user starts it)")
  p.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take")
  p.add_argument("--top", type=int, default=12, help="programs listed per run")
  p.add_argument("--out", default="", help="write the results as JSON here")
  args = p.parse_args(argv)
  runs = [r.strip() for r in args.runs.split(",") if r.strip()]
  bad = [r for r in runs if r not in ("cold", "warm")]
  if bad or not runs:
    p.error(f"--runs: {bad or runs!r}: each must be cold or warm")
  if runs[0] == "warm":
    p.error("--runs: a warm run needs a cold run before it (it restarts over that cache)")
  args.run_list = runs
  return args


def _post(url: str, body: dict, timeout: float):
  req = urllib.request.Request(url, data=json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"})
  with urllib.request.urlopen(req, timeout=timeout) as response:
    return response.status, response.read()


def compile_log(text: str) -> dict:
  """Seconds per phase by program name, and persistent-cache hits by XLA module name
  (`"hits"`), from jax's compile log."""
  programs: dict = collections.defaultdict(lambda: {"trace": 0.0, "lower": 0.0, "compile": 0.0,
                                                    "compiles": 0})
  hits: dict = collections.Counter()
  for line in text.splitlines():
    for phase, pattern in _PHASES:
      m = pattern.search(line)
      if m:
        programs[m.group(1)][phase] += float(m.group(2))
        programs[m.group(1)]["compiles"] += phase == "compile"
    m = _HIT.search(line)
    if m:
      hits[m.group(1)] += 1
  return {"programs": dict(programs), "hits": dict(hits)}


def start_once(checkpoint: str, cache_dir: str, flags: list[str], timeout: float) -> dict:
  """Launches `jaxkv serve`, times /health and a first completion, stops it; the figures."""
  log = tempfile.NamedTemporaryFile(suffix=".log", delete=False)
  log.close()
  server = ServerProcess(checkpoint, flags, compilation_cache=cache_dir, log_path=log.name,
                         env={"JAX_LOG_COMPILES": "1", "PYTHONUNBUFFERED": "1"}, poll=0.05,
                         timeout=timeout)
  out = {"command": " ".join(server.proc.args), "health_s": server.ready_s}
  try:
    sent = time.perf_counter()
    status, body = _post(server.url + "/v1/completions", {"model": server.model_name,
                                                          "prompt": "t1 t2 t3", "max_tokens": 8},
                         timeout)
    out["first_request_s"] = time.perf_counter() - sent
    out["first_completion_s"] = server.ready_s + out["first_request_s"]
    assert status == 200 and json.loads(body)["choices"], body
  finally:
    server.close()
    text = server.log_text()
    os.unlink(log.name)
  m = _SERVER.search(text)
  if m:
    out["server_compile_s"], out["server_ready_s"] = float(m.group(1)), float(m.group(2))
  out.update(compile_log(text))
  return out


def main(argv=None) -> int:
  args = _args(argv)
  checkpoint = args.checkpoint or write_checkpoint(
      args.write_checkpoint or tempfile.mkdtemp(prefix="jaxkv-bench-"), small=args.small)
  flags = args.server_flags.split()
  if args.small and "--max-len" not in flags:
    flags += ["--max-len", "256", "--max-seqs", "4", "--max-write", "16"]
  cache_dir = None
  results = {"args": {k: v for k, v in vars(args).items() if k != "run_list"}, "runs": []}
  for run in args.run_list:
    if run == "cold":
      cache_dir = tempfile.mkdtemp(prefix="jaxkv-startup-cache-")
    r = start_once(checkpoint, cache_dir, flags, args.timeout)
    r["run"] = run
    results["runs"].append(r)
    programs = r["programs"]
    total = {k: sum(p[k] for p in programs.values()) for k in ("trace", "lower", "compile")}
    print(f"{run}: /health after {r['health_s']:.2f} s, first completion after "
          f"{r['first_completion_s']:.2f} s (the request {r['first_request_s']:.2f} s); server: "
          f"compiled {r.get('server_compile_s', float('nan')):.2f} s, ready "
          f"{r.get('server_ready_s', float('nan')):.2f} s after its start; jax: trace "
          f"{total['trace']:.2f} s, lower {total['lower']:.2f} s, compile {total['compile']:.2f} s, "
          f"{sum(r['hits'].values())} persistent-cache hits", flush=True)
    print("| program | compiles | trace s | lower s | compile s (a cache hit: loading it) |")
    print("|---|---|---|---|---|")
    ranked = sorted(programs.items(), key=lambda kv: -(kv[1]["trace"] + kv[1]["lower"]
                                                        + kv[1]["compile"]))
    for name, p in ranked[:args.top]:
      print(f"| {name} | {p['compiles']} | {p['trace']:.2f} | {p['lower']:.2f} | "
            f"{p['compile']:.2f} |", flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
