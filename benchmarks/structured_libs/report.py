"""Turn results/*.jsonl (written by bench.py) into markdown tables on stdout.

Usage: .venv/bin/python benchmarks/structured_libs/report.py [results_dir] > tables.md
(RESULTS.md was assembled from this output plus hand-written notes.)
"""
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
LIBS = ["outlines", "llguidance", "xgrammar"]


def load(d):
    R = {}
    for lib in LIBS:
        p = os.path.join(d, f"{lib}.jsonl")
        if os.path.exists(p):
            for line in open(p):
                r = json.loads(line)
                R[(lib, r["task"])] = r
    return R


def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def f(x, nd=1):
    if x is None or (isinstance(x, float) and np.isnan(x)):
        return "-"
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.{nd}f}"


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "results")
    R = load(d)
    tasks = []
    for (lib, t) in R:
        if t not in tasks:
            tasks.append(t)
    order = json.load(open(os.path.join(HERE, "schemas.json")))
    order = ["json:" + s["name"] for s in order]
    tasks = [t for t in order if t in tasks] + [t for t in tasks if t not in order]

    def ok(r):
        return r is not None and "compile_s" in r

    # ---- summary per library
    print("| | outlines_core | llguidance | xgrammar |")
    print("|---|---|---|---|")
    rows = {}
    for lib in LIBS:
        rs = [R.get((lib, t)) for t in tasks]
        good = [r for r in rs if ok(r)]
        js = [r for r in good if r["kind"] == "json"]
        setup = [r["setup_s"] for r in good]
        comp = [r["compile_s"] * 1e3 for r in js]
        rec = [r["recompile_s"] * 1e3 for r in js if "recompile_s" in r]
        mask_all = [x for r in good for w in r["mask_us"] for x in w]
        mask_js = [x for r in js for w in r["mask_us"] for x in w]
        first = [r["mask_us"][0][0] for r in good]
        adv = [x for r in good for w in r["adv_us"] for x in w]
        mcr = [r["matcher_us"][0] for r in good]
        refused = [t for t, r in zip(tasks, rs) if not ok(r)]
        badvalid = [r["task"] for r in good if not r["accepts_valid"]]
        rej = sum(r["invalid_rejected"] for r in good)
        rows[lib] = dict(
            setup=f"{np.median(setup):.2f} s" if setup else "-",
            comp=(f"{min(comp):.1f} / {np.median(comp):.1f} / {max(comp):,.1f}" if comp else "-"),
            rec=(f"{np.median(rec):.3f}" if rec else "-"),
            mcr=f"{np.median(mcr):.0f}" if mcr else "-",
            first=f"{np.median(first):.0f} / {max(first):,.0f}" if first else "-",
            mask=(f"{np.mean(mask_js):.1f} / {pct(mask_js, 50):.1f} / {pct(mask_js, 99):.0f} / "
                  f"{max(mask_js):,.0f}" if mask_js else "-"),
            mask_all=(f"{np.mean(mask_all):.1f} / {pct(mask_all, 50):.1f} / "
                      f"{pct(mask_all, 99):.0f}" if mask_all else "-"),
            adv=f"{np.mean(adv):.1f} / {pct(adv, 99):.0f}" if adv else "-",
            n=str(len(mask_js)),
            refused=", ".join(x.split(":")[1] for x in refused) or "none",
            badvalid=", ".join(x.split(":")[1] for x in badvalid) or "none",
            rej=f"{rej} / {len(good)}",
        )
    labels = [("setup", "one-time per-tokenizer setup (median of runs)"),
              ("comp", "JSON compile, cold: min / median / max (ms)"),
              ("rec", "JSON re-compile same process, median (ms)"),
              ("mcr", "new matcher from compiled grammar, median (µs)"),
              ("first", "first mask of a request: median / max (µs)"),
              ("mask", "per-token mask, JSON: mean / p50 / p99 / max (µs)"),
              ("n", "  (token-mask samples, JSON)"),
              ("mask_all", "per-token mask, all tasks: mean / p50 / p99 (µs)"),
              ("adv", "advance by one token: mean / p99 (µs)"),
              ("refused", "tasks refused / failed to compile"),
              ("badvalid", "valid instance NOT accepted"),
              ("rej", "invalid instance rejected (tasks)")]
    for k, lab in labels:
        print(f"| {lab} | " + " | ".join(rows[l][k] for l in LIBS) + " |")
    print()

    # ---- per-task table
    print("| task | tok | compile ms: outl / llg / xgr | mask µs p50: outl / llg / xgr "
          "| mask µs p99: outl / llg / xgr |")
    print("|---|---|---|---|---|")
    for t in tasks:
        cs, p50, p99, ntok = [], [], [], "-"
        for lib in LIBS:
            r = R.get((lib, t))
            if not ok(r):
                cs.append("timeout" if r and r.get("timeout") else "ERR")
                p50.append("-")
                p99.append("-")
                continue
            ntok = r["n_tokens"]
            cs.append(f(r["compile_s"] * 1e3))
            xs = [x for w in r["mask_us"] for x in w]
            p50.append(f(pct(xs, 50)))
            p99.append(f(pct(xs, 99)))
        print(f"| {t.split(':',1)[1]} ({t.split(':')[0][0]}) | {ntok} | {' / '.join(cs)} | "
              f"{' / '.join(p50)} | {' / '.join(p99)} |")
    print()

    # ---- outlines automaton
    print("| task | regex chars | states | transitions | distinct sets | largest set "
          "| dense MiB | CSR MiB | get_tokens() list µs p50/p99 |")
    print("|---|---|---|---|---|---|---|---|---|")
    dm, cm = [], []
    for t in tasks:
        r = R.get(("outlines", t))
        if not ok(r):
            msg = (r or {}).get("compile_error", "missing")[:60]
            print(f"| {t.split(':',1)[1]} | {r.get('regex_len', '-') if r else '-'} | "
                  f"{msg} | | | | | | |")
            continue
        o = r["outlines"]
        dm.append(o["dense_mib"])
        cm.append(o["csr_mib"])
        lt = r.get("outlines_list_us", [])
        print(f"| {t.split(':',1)[1]} | {r.get('regex_len', '-')} | {o['states']:,} | "
              f"{o['transitions']:,} | {o['distinct_sets']:,} | {o['max_set']:,} | "
              f"{o['dense_mib']:.2f} | {o['csr_mib']:.1f} | "
              f"{f(pct(lt, 50))} / {f(pct(lt, 99))} |")
    if dm:
        print(f"\ndense MiB range {min(dm):.2f}-{max(dm):.2f}, CSR MiB range "
              f"{min(cm):.2f}-{max(cm):.1f}, sum over tasks dense {sum(dm):.1f} + CSR "
              f"{sum(cm):.1f} MiB")
    print()

    # ---- coverage details
    print("| task | violates | outlines | llguidance | xgrammar |")
    print("|---|---|---|---|---|")
    for t in tasks:
        cells, viol = [], ""
        for lib in LIBS:
            r = R.get((lib, t))
            if not ok(r):
                cells.append("refused: " + ((r or {}).get("compile_error", "?")[:70]
                                            .replace("|", "/").replace("\n", " ")))
                continue
            viol = r["violates"]
            v = "valid ok" if r["accepts_valid"] else (
                f"VALID REJECTED at tok {r['valid_fail_at']['pos']}/{r['n_tokens']}"
                if r["valid_fail_at"] else f"VALID not final {r['valid_end']}")
            iv = (f"rejects invalid (tok {r['invalid_fail_at']['pos']}/{r['invalid_n']})"
                  if r["invalid_fail_at"] else
                  ("rejects invalid (at EOS)" if r["invalid_rejected"] else "ACCEPTS INVALID"))
            cells.append(f"{v}; {iv}")
        print(f"| {t.split(':',1)[1]} | {viol} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
