"""Benchmark outlines_core / llguidance / xgrammar on a 128k byte-level BPE vocab.

Prerequisites (from the repo root):
    .venv/bin/python benchmarks/structured_libs/build_tokenizer.py   # -> tok128k/tokenizer.json
    python3 benchmarks/structured_libs/make_schemas.py               # -> schemas.json (needs jsonschema)
Run everything (driver; ~15-30 min on 2 cores, one child process per (library, task)):
    .venv/bin/python benchmarks/structured_libs/bench.py --out benchmarks/structured_libs/results
    .venv/bin/python benchmarks/structured_libs/report.py      # -> RESULTS.md
Single task (what the driver runs in a child process; prints one JSON line):
    .venv/bin/python benchmarks/structured_libs/bench.py --lib outlines --task json:person

Per task (JSON schema / regex / choice) and library it measures, in a fresh process:
  setup_s       one-time per-tokenizer preprocessing (outlines: Vocabulary(); llguidance:
                LLTokenizer(); xgrammar: TokenizerInfo() + GrammarCompiler()).
  compile_s     cold grammar compile for the 128k vocab (outlines: build_regex_from_schema +
                Index(); llguidance: grammar_from_json_schema + LLMatcher() [validates];
                xgrammar: compile_json_schema with an empty cache).
  recompile_s   compiling the same grammar again in the same process (xgrammar: its cache).
  matcher_s     creating a per-request matcher from the compiled grammar.
  walk          the valid instance is tokenized and walked token by token, WALKS times, each
                with a fresh matcher: at each position the next-token bitmask (int32 words,
                128000 bits) is filled [timed: mask_ns], the actual token is checked to be in
                the mask, then the matcher advances with it [timed: adv_ns]. After the last
                token, EOS must be in the mask and the matcher must be accepting.
  invalid       the invalid instance (violates one constraint) is walked the same way; it
                counts as rejected if some token is not in the mask / not accepted, or EOS is
                not allowed at the end.
  outlines only: automaton states, (state, token) transitions incl. EOS self-loops, distinct
                allowed-token sets (see outlines_stats), device-table sizes (dense bitmask per
                distinct set = sets*V/8 B; CSR transitions = 8 B/transition + 4 B/state), and
                get_tokens() (Python list) time per position.
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

WALKS = 3
REGEXES = [
    # name, pattern (implicitly anchored: all three libraries match the whole output),
    # valid, invalid
    ("name_code", r"[A-Z][a-z]+ [0-9]{3}", "Berlin 042", "berlin 042"),
    ("phone_us", r"\(\d{3}\) \d{3}-\d{4}", "(415) 555-0132", "(415) 555-013"),
    ("iso_datetime", r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?Z",
     "2025-03-14T09:26:53.589Z", "2025-03-14 09:26:53Z"),
]
CHOICE = ("choice5", ["positive", "negative", "neutral", "mixed", "not applicable"],
          "not applicable", "unknown")


def load_tasks():
    tasks = []
    for s in json.load(open(os.path.join(HERE, "schemas.json"))):
        tasks.append(dict(id="json:" + s["name"], kind="json", spec=s["schema"],
                          valid=json.dumps(s["valid"]), invalid=json.dumps(s["invalid"]),
                          violates=s["violates"]))
    for name, pat, v, iv in REGEXES:
        tasks.append(dict(id="regex:" + name, kind="regex", spec=pat, valid=v, invalid=iv,
                          violates="pattern"))
    name, ch, v, iv = CHOICE
    tasks.append(dict(id="choice:" + name, kind="choice", spec=ch, valid=v, invalid=iv,
                      violates="choice"))
    return tasks


def walk(backend, compiled, tok, ids, mask, timed=True, check=True):
    from libs import mask_count, mask_has
    t0 = time.perf_counter_ns()
    m = backend.matcher(compiled, mask)
    matcher_ns = time.perf_counter_ns() - t0
    mask_ns, adv_ns, counts = [], [], []
    fail_at = None
    pc = time.perf_counter_ns
    for k, t in enumerate(ids):
        if check:
            mask.fill(0x5A5A5A5A)  # garbage: the library must overwrite every word
        a = pc()
        m.fill()
        b = pc()
        ok_in_mask = mask_has(mask, t)
        c = pc()
        ok_adv = m.advance(t)
        d = pc()
        mask_ns.append(b - a)
        adv_ns.append(d - c)
        if check:
            counts.append(mask_count(mask))
        if not (ok_in_mask and ok_adv):
            fail_at = dict(pos=k, in_mask=ok_in_mask, advanced=ok_adv,
                           token=tok.tk.decode([t]))
            break
    end_ok = None
    if fail_at is None:
        m.fill()
        end_ok = dict(eos_in_mask=mask_has(mask, tok.eos_id), accepting=bool(m.is_accepting()))
    return dict(matcher_ns=matcher_ns, mask_ns=mask_ns, adv_ns=adv_ns, counts=counts,
                fail_at=fail_at, end=end_ok, n=len(ids))


def outlines_stats(index, tok):
    """States / transitions / distinct allowed-token sets of an outlines Index.

    Parsed from the Index's own serialization (Index.__reduce__ -> bincode, varint ints:
    initial, final_states, transitions: map<state, map<token, next_state>>, eos, vocab_size)
    instead of index.get_transitions(), whose Python dict needs ~100 B per transition
    (tens of GB for the larger indexes). Checked equal to get_transitions() on json:person.
    Transition counts include the EOS self-loop of each final state.
    """
    import hashlib
    from array import array
    b = index.__reduce__()[1][0]
    pos = 0
    frm = int.from_bytes

    def rd():
        nonlocal pos
        x = b[pos]
        pos += 1
        if x < 251:
            return x
        k = {251: 2, 252: 4, 253: 8}[x]
        v = frm(b[pos:pos + k], "little")
        pos += k
        return v

    rd()  # initial state
    nf = rd()
    for _ in range(nf):
        rd()
    ns = rd()
    n_trans, digests = 0, {}
    for _ in range(ns):
        rd()  # state id
        n = rd()
        toks = array("I")
        ap = toks.append
        p = pos
        for _ in range(n):
            x = b[p]
            p += 1
            if x >= 251:
                k = 2 if x == 251 else 4 if x == 252 else 8
                x = frm(b[p:p + k], "little")
                p += k
            ap(x)
            y = b[p]
            p += 1
            if y >= 251:
                p += 2 if y == 251 else 4 if y == 252 else 8
        pos = p
        n_trans += n
        h = hashlib.blake2b(array("I", sorted(toks)).tobytes(), digest_size=16).digest()
        digests[h] = n
    rd()  # eos
    rd()  # vocab size
    assert pos == len(b), (pos, len(b))
    dense_mib = len(digests) * (tok.V / 8) / 2**20
    csr_mib = (8 * n_trans + 4 * (ns + 1)) / 2**20
    return dict(states=ns, transitions=n_trans, distinct_sets=len(digests),
                max_set=max(digests.values()) if digests else 0, dense_mib=dense_mib,
                csr_mib=csr_mib, final_states=nf, serialized_mb=len(b) / 1e6)


def phase(msg):
    print(f"[phase {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_task(lib, task_id):
    from libs import BACKENDS, Tok
    import numpy as np
    task = {t["id"]: t for t in load_tasks()}[task_id]
    tok = Tok()
    be = BACKENDS[lib](tok)
    res = dict(lib=lib, task=task_id, kind=task["kind"], violates=task["violates"],
               start=time.strftime("%H:%M:%S"), loadavg_start=os.getloadavg()[0])
    __import__({"outlines": "outlines_core", "llguidance": "llguidance",
                "xgrammar": "xgrammar"}[lib])  # import cost is not part of setup_s
    t0 = time.perf_counter()
    be.setup()
    res["setup_s"] = time.perf_counter() - t0
    gc.collect()
    compile_fn = {"json": be.compile_json, "regex": be.compile_regex,
                  "choice": be.compile_choice}[task["kind"]]
    try:
        if lib == "outlines" and task["kind"] == "json":
            t0 = time.perf_counter()
            rx = be.regex_for_json(task["spec"])
            res["regex_s"] = time.perf_counter() - t0
            res["regex_len"] = len(rx)
        phase("compile start")
        t0 = time.perf_counter()
        compiled = compile_fn(task["spec"])
        res["compile_s"] = time.perf_counter() - t0
    except BaseException as e:  # noqa: BLE001 - record refusal
        res["compile_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return res
    if res["compile_s"] < 10:  # skip for slow compiles (no library caches across processes)
        t0 = time.perf_counter()
        compile_fn(task["spec"])
        res["recompile_s"] = time.perf_counter() - t0
    phase(f"compiled in {res['compile_s']:.1f}s")
    if lib == "outlines":
        res["outlines"] = outlines_stats(compiled, tok)
        phase("stats done")

    ids = tok.encode(task["valid"])
    bad = tok.encode(task["invalid"])
    mask = tok.new_mask()
    walks = [walk(be, compiled, tok, ids, mask, check=(w == 0)) for w in range(WALKS)]
    w0 = walks[0]
    res["n_tokens"] = len(ids)
    res["valid_fail_at"] = w0["fail_at"]
    res["valid_end"] = w0["end"]
    res["accepts_valid"] = bool(w0["fail_at"] is None and w0["end"]["eos_in_mask"]
                                and w0["end"]["accepting"])
    res["allowed_counts"] = w0["counts"]
    res["matcher_us"] = [w["matcher_ns"] / 1e3 for w in walks]
    res["mask_us"] = [[x / 1e3 for x in w["mask_ns"]] for w in walks]
    res["adv_us"] = [[x / 1e3 for x in w["adv_ns"]] for w in walks]
    if lib == "outlines":  # Python-list path, for reference
        from outlines_core import Guide
        g = Guide(compiled, max_rollback=0)
        lt = []
        for t in ids:
            a = time.perf_counter_ns()
            g.get_tokens()
            lt.append((time.perf_counter_ns() - a) / 1e3)
            try:
                g.advance(t, return_tokens=False)
            except Exception:
                break
        res["outlines_list_us"] = lt
    iv = walk(be, compiled, tok, bad, mask, check=True)
    res["invalid_rejected"] = bool(iv["fail_at"] is not None or not iv["end"]["eos_in_mask"]
                                   or not iv["end"]["accepting"])
    res["invalid_fail_at"] = iv["fail_at"]
    res["invalid_n"] = len(bad)
    res["loadavg_end"] = os.getloadavg()[0]
    return res


def versions():
    from importlib.metadata import version
    return {p: version(p) for p in ("outlines_core", "llguidance", "xgrammar", "tokenizers",
                                    "torch", "numpy")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib")
    ap.add_argument("--task")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--libs", default="outlines,llguidance,xgrammar")
    ap.add_argument("--only", default="", help="comma-separated task ids (driver mode)")
    ap.add_argument("--timeout", type=int, default=300, help="per (lib, task) child, seconds")
    args = ap.parse_args()
    if args.lib:
        print(json.dumps(run_task(args.lib, args.task)))
        return
    os.makedirs(args.out, exist_ok=True)
    tasks = [t["id"] for t in load_tasks()]
    if args.only:
        tasks = [t for t in tasks if t in args.only.split(",")]
    json.dump(versions(), open(os.path.join(args.out, "versions.json"), "w"))
    for lib in args.libs.split(","):
        path = os.path.join(args.out, f"{lib}.jsonl")
        done = set()
        if os.path.exists(path):
            done = {json.loads(l)["task"] for l in open(path)}
        for tid in tasks:
            if tid in done:
                continue
            t0 = time.time()
            try:
                p = subprocess.run([sys.executable, __file__, "--lib", lib, "--task", tid],
                                   capture_output=True, text=True, timeout=args.timeout)
                lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
                if lines:
                    r = json.loads(lines[-1])
                else:
                    r = dict(lib=lib, task=tid,
                             compile_error=f"child rc={p.returncode}: {p.stderr[-300:]}")
            except subprocess.TimeoutExpired as e:
                err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
                phases = [l for l in err.splitlines() if l.startswith("[phase")]
                r = dict(lib=lib, task=tid, compile_error=f"timeout > {args.timeout} s",
                         timeout=True, phases=phases)
            with open(path, "a") as f:
                f.write(json.dumps(r) + "\n")
            msg = r.get("compile_error") or (
                f"compile {r['compile_s']*1e3:.1f} ms, valid ok={r['accepts_valid']}, "
                f"invalid rejected={r['invalid_rejected']}")
            print(f"[{lib}] {tid}: {msg} ({time.time()-t0:.1f}s wall)", flush=True)


if __name__ == "__main__":
    main()
