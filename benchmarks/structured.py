"""Structured output through `jaxkv serve`: what a schema costs the batch, and whether outputs hold.

Serves a random-weights checkpoint (`serve.py --write-checkpoint`'s 1.24B Llama shape, or
`--small`) whose tokenizer is a synthetic byte-level vocabulary of the model's size (256 bytes,
then words, digit groups, punctuation runs and random strings, as a real BPE vocabulary mixes
them; id V-1 is a special end token that constrained requests stop on), with the server's own
defaults, and measures over HTTP (streamed completions, one asyncio client):

1. `schema_vs_none`: N concurrent requests constrained by a JSON schema, then the same N
   unconstrained, each generating as many tokens as its constrained twin did (`ignore_eos`):
   throughput and inter-token latency (ITL) ratios.
2. `half_mix`: N requests of which half carry the schema, against N with none: the
   unconstrained half's ITL in each.
3. `schema_set`: every schema of tests/fixtures/schemas.json once, at once (sampled): how many
   outputs parse and validate (`jsonschema`), how many were refused (the pool or the compile
   timeout) and each first request's latency (its compile included).
4. `cold_compile`: N/2 unconstrained streams, with and without one request of a new schema sent
   while they run: the streams' largest gap between tokens and ITL p99.

Usage:
  python benchmarks/structured.py --small                      # CPU smoke
  python benchmarks/structured.py --write-checkpoint /tmp/llama1b --out structured.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve as serve_bench  # noqa: E402  pylint: disable=wrong-import-position
from jaxkv.structured.vocab import _byte_level_table  # noqa: E402  pylint: disable=wrong-import-position,protected-access

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA_SET = os.path.join(ROOT, "tests", "fixtures", "schemas.json")
# The throughput schema: a classification record (enums, bounded integers, booleans, a short
# array), the shape most structured-output traffic has.
SCHEMA = {"type": "object", "properties": {
    "label": {"enum": ["positive", "negative", "neutral", "mixed"]},
    "score": {"type": "integer", "minimum": 0, "maximum": 100},
    "topics": {"type": "array", "items": {"enum": ["price", "service", "quality", "delivery"]},
               "minItems": 1, "maxItems": 3},
    "urgent": {"type": "boolean"}}, "required": ["label", "score", "topics", "urgent"]}
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have "
         "from or one had by word but not what all were we when your can said there use an "
         "each which she do how their if will up other about out many then them these so some "
         "her would make like him into time has look two more write go see number no way could "
         "people my than first water been call who oil its now find long down day did get come "
         "made may part name age city true false null value price score label data list item "
         "type id key error status result user text count total").split()


def _args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--small", action="store_true",
                 help="a tiny model, 4 requests, a small engine, 4 schemas of the set (CPU smoke)")
  p.add_argument("--write-checkpoint", default="/tmp/jaxkv-structured-ckpt", metavar="DIR")
  p.add_argument("--concurrency", type=int, default=None, help="requests at once (default 64)")
  p.add_argument("--server-flags", default="", help="more `jaxkv serve` flags")
  p.add_argument("--skip", default="", help="parts to skip, comma-separated")
  p.add_argument("--out", default=None)
  return p.parse_args(argv)


def byte_level_tokenizer(path: str, vocab_size: int, seed: int = 0) -> None:
  """Replaces `path`'s tokenizer.json with a synthetic byte-level vocabulary of `vocab_size`."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers   # pylint: disable=g-import-not-at-top
  table = {b: c for c, b in _byte_level_table().items()}
  rng = random.Random(seed)
  texts: list[bytes] = [bytes([b]) for b in range(256)]
  seen = set(texts)
  punct = list(b'{}[]":,. -_()!?;\'/')
  while len(texts) < vocab_size - 1:
    r = rng.random()
    if r < 0.45:
      t = (b" " if rng.random() < 0.6 else b"") + rng.choice(WORDS).encode()
      t = t.capitalize() if rng.random() < 0.2 else t
      t += rng.choice([b"", b"s", b"ed", b"ing", b"er", b"ly"])
    elif r < 0.6:
      t = str(rng.randrange(10 ** rng.randint(1, 3))).encode()
    elif r < 0.7:
      t = bytes(rng.choice(punct) for _ in range(rng.randint(2, 3)))
    else:
      t = bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
      t = (b" " + t) if rng.random() < 0.5 else t
    if t not in seen:
      seen.add(t)
      texts.append(t)
  vocab = {"".join(table[b] for b in t): i for i, t in enumerate(texts)}
  tok = Tokenizer(models.BPE(vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken("<|end|>", special=True)])
  tok.save(os.path.join(path, "tokenizer.json"))


async def _chat(client, url, body) -> dict:
  """One streamed completion: its text, finish reason, token times and status."""
  sent = time.perf_counter()
  times, text, finish, status, usage = [], "", None, None, None
  async with client.stream("POST", url + "/v1/completions", json=body | {
      "model": "bench", "stream": True, "stream_options": {"include_usage": True}}) as r:
    status = r.status_code
    if status != 200:
      return {"status": status, "error": (await r.aread()).decode()[:300], "sent": sent}
    async for line in r.aiter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      event = json.loads(line[6:])
      if event.get("usage"):
        usage = event["usage"]["completion_tokens"]
      for c in event.get("choices", ()):
        piece = c.get("text")
        if piece:
          text += piece
          times.append(time.perf_counter())
        finish = c.get("finish_reason") or finish
  return {"status": status, "text": text, "finish": finish, "times": times, "sent": sent,
          "done": time.perf_counter(), "tokens": usage}


async def _many(url, bodies) -> tuple[list[dict], float]:
  import httpx   # pylint: disable=g-import-not-at-top
  limits = httpx.Limits(max_connections=len(bodies) + 8)
  async with httpx.AsyncClient(timeout=1800, limits=limits) as client:
    start = time.perf_counter()
    out = await asyncio.gather(*(_chat(client, url, b) for b in bodies))
    return out, time.perf_counter() - start


def _itl(records) -> list[float]:
  gaps = []
  for r in records:
    t = r.get("times") or []
    gaps += list(np.diff(t) / 1.0)
  return gaps


def _stats(records, wall) -> dict:
  gaps = _itl(records)
  tokens = sum(r.get("tokens") or 0 for r in records)
  return {"wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall,
          "itl_p50_ms": 1e3 * float(np.percentile(gaps, 50)) if gaps else None,
          "itl_p99_ms": 1e3 * float(np.percentile(gaps, 99)) if gaps else None,
          "max_gap_ms": 1e3 * max(gaps) if gaps else None,
          "errors": [r.get("error") for r in records if r["status"] != 200][:3]}


def _prompt(i: int) -> str:
  return f"Review {i}: the delivery was late but the price was fair. As JSON:"


def main(argv=None) -> int:
  args = _args(argv)
  ckpt = serve_bench.write_checkpoint(args.write_checkpoint, small=args.small)
  with open(os.path.join(ckpt, "config.json"), encoding="utf-8") as f:
    vocab = json.load(f)["vocab_size"]
  byte_level_tokenizer(ckpt, vocab)
  end = vocab - 1   # the special end token the constrained requests stop on
  n = args.concurrency or (4 if args.small else 64)
  skip = set(filter(None, args.skip.split(",")))
  flags = args.server_flags.split() + (["--max-seqs", "8", "--max-len", "512"] if args.small
                                       else [])
  results: dict = {"vocab_size": vocab, "concurrency": n, "schema": SCHEMA}
  def save():   # after each part: a run cut short keeps what it measured
    if args.out:
      with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, default=str)

  server = serve_bench.ServerProcess(ckpt, flags)
  url = server.url
  fmt = {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA}}
  constrained = lambda i: {"prompt": _prompt(i), "max_tokens": 256, "temperature": 0.7,
                           "seed": i, "response_format": fmt, "stop_token_ids": [end]}
  free = lambda i, k: {"prompt": _prompt(i), "max_tokens": k, "temperature": 0.7, "seed": i,
                       "ignore_eos": True}
  try:
    t = time.perf_counter()   # warm-up: the schema's compile and the sampled loop's
    warm, _ = asyncio.run(_many(url, [constrained(0), free(0, 4)]))
    results["warm_up_s"] = time.perf_counter() - t
    if warm[0]["status"] != 200:
      raise RuntimeError(f"the schema was refused: {warm[0]['error']}")
    if "schema_vs_none" not in skip:
      with_schema, wall = asyncio.run(_many(url, [constrained(i) for i in range(n)]))
      valid = 0
      import jsonschema   # pylint: disable=g-import-not-at-top
      for r in with_schema:
        try:
          jsonschema.validate(json.loads(r["text"]), SCHEMA)
          valid += 1
        except (ValueError, jsonschema.ValidationError, KeyError):
          pass
      lengths = [max(r.get("tokens") or 1, 1) for r in with_schema]
      without, wall0 = asyncio.run(_many(url, [free(i, k) for i, k in enumerate(lengths)]))
      a, b = _stats(with_schema, wall), _stats(without, wall0)
      results["schema_vs_none"] = {"schema": a, "none": b, "valid": valid, "requests": n,
                                   "throughput_ratio": a["tok_per_s"] / b["tok_per_s"],
                                   "itl_p50_ratio": a["itl_p50_ms"] / b["itl_p50_ms"]}
      save()
    if "half_mix" not in skip:
      half = [constrained(i) if i % 2 else free(i, 128) for i in range(n)]
      mixed, wall = asyncio.run(_many(url, half))
      none, wall0 = asyncio.run(_many(url, [free(i, 128) for i in range(n)]))
      a = _stats([r for i, r in enumerate(mixed) if i % 2 == 0], wall)
      b = _stats([r for i, r in enumerate(none) if i % 2 == 0], wall0)
      results["half_mix"] = {"free_half_in_mix": a, "same_half_without": b,
                             "itl_p50_ratio": a["itl_p50_ms"] / b["itl_p50_ms"]}
      save()
    if "cold_compile" not in skip:
      m = max(n // 2, 1)
      length = 40 if args.small else 200
      base, wall0 = asyncio.run(_many(url, [free(i, length) for i in range(m)]))

      async def with_compile():
        import httpx   # pylint: disable=g-import-not-at-top
        async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(
            max_connections=m + 8)) as client:
          streams = [asyncio.ensure_future(_chat(client, url, free(i, length)))
                     for i in range(m)]
          await asyncio.sleep(0.5)
          fresh = dict(SCHEMA, properties=dict(SCHEMA["properties"], extra={
              "type": "integer", "minimum": 0, "maximum": 7 + int(time.time()) % 50}))
          cold = await _chat(client, url, constrained(999) | {"response_format": {
              "type": "json_schema", "json_schema": {"name": "cold", "schema": fresh}}})
          return await asyncio.gather(*streams), cold
      t = time.perf_counter()
      streams, cold = asyncio.run(with_compile())
      wall = time.perf_counter() - t
      results["cold_compile"] = {"without": _stats(base, wall0), "with": _stats(streams, wall),
                                 "cold_request_s": cold.get("done", cold["sent"]) - cold["sent"],
                                 "cold_status": cold["status"]}
      save()
    if "schema_set" not in skip:
      with open(SCHEMA_SET, encoding="utf-8") as f:
        schemas = json.load(f)[:4 if args.small else None]
      bodies = [{"prompt": _prompt(i), "max_tokens": 400, "temperature": 0.8, "seed": i,
                 "stop_token_ids": [end], "response_format": {
                     "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s}}}
                for i, s in enumerate(schemas)]
      outs, wall = asyncio.run(_many(url, bodies))
      import jsonschema   # pylint: disable=g-import-not-at-top
      rows = []
      for s, r in zip(schemas, outs):
        row = {"status": r["status"], "latency_s": (r.get("done") or r["sent"]) - r["sent"]}
        if r["status"] == 200:
          try:
            jsonschema.validate(json.loads(r["text"]), s)
            row["valid"] = True
          except (ValueError, jsonschema.ValidationError):
            row["valid"], row["finish"] = False, r["finish"]
        else:
          row["error"] = r["error"]
        rows.append(row)
      served = [r for r in rows if r["status"] == 200]
      results["schema_set"] = {"schemas": len(rows), "served": len(served),
                               "valid": sum(r.get("valid", False) for r in served),
                               "wall_s": wall, "rows": rows}
      save()
  finally:
    server.close()
  for k in ("schema_vs_none", "half_mix", "schema_set", "cold_compile"):
    if k in results:
      v = {kk: vv for kk, vv in results[k].items() if kk != "rows"}
      print(k, json.dumps(v, default=str)[:900])
  save()
  return 0


if __name__ == "__main__":
  sys.exit(main())
