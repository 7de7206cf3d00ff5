"""Side measurements referenced in RESULTS.md ("Notes" section). Prints JSON lines.

Usage: .venv/bin/python benchmarks/structured_libs/extras.py   (~2 min)
  1. split of the one-time per-tokenizer setup (each step timed separately, 3 repeats)
  2. xgrammar open_object with strict_mode=False (default True forbids extra properties)
  3. llguidance: new LLMatcher(grammar) vs deep_copy() of a pristine matcher, per request
  4. outlines: \\d (Unicode digits in outlines' regex engine) vs [0-9] compile cost
  5. xgrammar compile of the 3 slowest schemas with max_threads=1 vs 2
"""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from libs import Tok, mask_has  # noqa: E402


def tm(fn, n=1):
    best = []
    out = None
    for _ in range(n):
        t = time.perf_counter()
        out = fn()
        best.append(time.perf_counter() - t)
    return out, sorted(best)[len(best) // 2]


def main():
    tok = Tok()
    S = {s["name"]: s for s in json.load(open(os.path.join(HERE, "schemas.json")))}

    # 1. setup split
    from outlines_core import Vocabulary
    m = {}
    for i, b in enumerate(tok.token_bytes):
        if b is not None:
            m.setdefault(b, []).append(i)
    _, t_ov = tm(lambda: Vocabulary(tok.eos_id, m), 3)
    import llguidance
    _, t_lt = tm(lambda: llguidance.LLTokenizer(tok.json_str, eos_token=tok.eos_id), 3)
    import xgrammar as xgr
    info, t_xi = tm(lambda: xgr.TokenizerInfo(tok.encoded, xgr.VocabType.BYTE_LEVEL,
                                              vocab_size=tok.V, stop_token_ids=[tok.eos_id]), 3)
    _, t_xc = tm(lambda: xgr.GrammarCompiler(info, max_threads=2), 3)
    print(json.dumps(dict(what="setup_split_s", outlines_Vocabulary=t_ov,
                          llguidance_LLTokenizer=t_lt, xgrammar_TokenizerInfo=t_xi,
                          xgrammar_GrammarCompiler=t_xc)))

    # 2. xgrammar strict_mode=False on the open object
    s = S["open_object"]
    for strict in (True, False):
        comp = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        cg = comp.compile_json_schema(json.dumps(s["schema"]), any_whitespace=True,
                                      strict_mode=strict)
        mt = xgr.GrammarMatcher(cg)
        ids = tok.encode(json.dumps(s["valid"]))
        acc = all(mt.accept_token(t) for t in ids) and mt.is_completed()
        print(json.dumps(dict(what="xgrammar_open_object", strict_mode=strict,
                              accepts_valid=bool(acc))))

    # 3. llguidance per-request matcher creation
    lt = llguidance.LLTokenizer(tok.json_str, eos_token=tok.eos_id)
    for name in ("person", "invoice", "profile_many_optional"):
        g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(S[name]["schema"]))
        proto = llguidance.LLMatcher(lt, g, log_level=0)
        _, t_new = tm(lambda: llguidance.LLMatcher(lt, g, log_level=0), 21)
        _, t_cp = tm(lambda: proto.deep_copy(), 21)
        # first mask after deep_copy of a matcher that has already computed one mask
        import numpy as np
        mask = tok.new_mask()
        proto.unsafe_compute_mask_ptr(mask.ctypes.data, mask.size * 4)
        fm = []
        for _ in range(5):
            c = proto.deep_copy()
            t = time.perf_counter()
            c.unsafe_compute_mask_ptr(mask.ctypes.data, mask.size * 4)
            fm.append(time.perf_counter() - t)
        fresh = []
        for _ in range(5):
            c = llguidance.LLMatcher(lt, g, log_level=0)
            t = time.perf_counter()
            c.unsafe_compute_mask_ptr(mask.ctypes.data, mask.size * 4)
            fresh.append(time.perf_counter() - t)
        print(json.dumps(dict(what="llguidance_matcher_per_request", schema=name,
                              new_LLMatcher_us=t_new * 1e6, deep_copy_us=t_cp * 1e6,
                              first_mask_fresh_us=float(np.median(fresh)) * 1e6,
                              first_mask_after_deep_copy_us=float(np.median(fm)) * 1e6)))

    # 4. outlines \d vs [0-9]
    from outlines_core import Index
    voc = Vocabulary(tok.eos_id, m)
    for pat in (r"\(\d{3}\) \d{3}-\d{4}", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"):
        idx, t = tm(lambda: Index(pat, voc), 1)
        print(json.dumps(dict(what="outlines_digit_class", pattern=pat, compile_s=t,
                              states=len(idx.get_transitions()))))

    # 5. xgrammar threads
    for name in ("chat_message", "profile_many_optional", "github_issue"):
        for th in (1, 2):
            comp = xgr.GrammarCompiler(info, max_threads=th, cache_enabled=False)
            _, t = tm(lambda: comp.compile_json_schema(json.dumps(S[name]["schema"])), 3)
            print(json.dumps(dict(what="xgrammar_threads", schema=name, max_threads=th,
                                  compile_ms=t * 1e3)))


if __name__ == "__main__":
    main()
