"""Train a ~128k byte-level BPE tokenizer on local text (no downloads).

Usage (from repo root):
    .venv/bin/python benchmarks/structured_libs/build_tokenizer.py [--mb 150] [--vocab 128000]

Corpus: .py/.txt/.md/.json/.html files (< 2 MB each) under /usr/lib/python3*
and the venv's site-packages, shuffled with a fixed seed, capped at --mb MB.
Output: benchmarks/structured_libs/tok128k/tokenizer.json (gitignored).
Special tokens: <|endoftext|> (EOS, id 0) and <|pad|> (id 1).
"""
import argparse
import glob
import os
import random
import sys
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
EXTS = (".py", ".txt", ".md", ".json", ".html")
EOS = "<|endoftext|>"


def corpus_files():
    roots = sorted(glob.glob("/usr/lib/python3*")) + sorted(
        glob.glob(os.path.join(ROOT, ".venv/lib/python3*/site-packages")))
    out = []
    for r in roots:
        for dp, _, fns in os.walk(r):
            for fn in fns:
                if fn.endswith(EXTS):
                    p = os.path.join(dp, fn)
                    try:
                        s = os.path.getsize(p)
                    except OSError:
                        continue
                    if 0 < s < 2_000_000 and os.path.isfile(p):
                        out.append((p, s))
    out.sort()
    random.Random(0).shuffle(out)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=150)
    ap.add_argument("--vocab", type=int, default=128000)
    args = ap.parse_args()
    cap = int(args.mb * 1e6)
    files, tot = [], 0
    for p, s in corpus_files():
        if tot + s > cap:
            continue
        files.append(p)
        tot += s
        if tot > cap * 0.999:
            break
    print(f"corpus: {len(files)} files, {tot/1e6:.1f} MB", flush=True)

    def it():
        for p in files:
            try:
                with open(p, "r", encoding="utf-8", errors="replace") as f:
                    yield f.read()
            except OSError:
                pass

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab, min_frequency=2, special_tokens=[EOS, "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    t0 = time.time()
    tok.train_from_iterator(it(), trainer=trainer, length=len(files))
    print(f"trained in {time.time()-t0:.1f}s, vocab size {tok.get_vocab_size()}", flush=True)
    os.makedirs(os.path.join(HERE, "tok128k"), exist_ok=True)
    out = os.path.join(HERE, "tok128k", "tokenizer.json")
    tok.save(out)
    print("saved", out, "eos id", tok.token_to_id(EOS))


if __name__ == "__main__":
    sys.exit(main())
