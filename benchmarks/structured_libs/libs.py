"""Uniform wrappers around outlines_core / llguidance / xgrammar for the benchmark.

Each backend exposes:
  setup()                       -> one-time per-tokenizer preprocessing (timed by caller)
  compile_json(schema_dict)     -> compiled object (grammar + vocab index)
  compile_regex(pattern)        -> compiled object
  compile_choice(list_of_str)   -> compiled object
  matcher(compiled, mask)       -> object bound to the int32 bitmask `mask` with
                                   .fill() (writes the next-token mask into `mask`),
                                   .advance(tok) -> bool, .is_accepting()
All bitmasks are int32 arrays of ceil(V/32) words, bit i set <=> token i allowed
(the layout all three libraries share).
"""
import json
import os
import re

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TOK_PATH = os.path.join(HERE, "tok128k", "tokenizer.json")
EOS = "<|endoftext|>"


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Tok:
    """The trained tokenizer plus its byte-level vocabulary."""

    def __init__(self, path=TOK_PATH):
        from tokenizers import Tokenizer
        self.path = path
        self.json_str = open(path).read()
        self.tk = Tokenizer.from_file(path)
        self.V = self.tk.get_vocab_size(with_added_tokens=True)
        self.eos_id = self.tk.token_to_id(EOS)
        vocab = self.tk.get_vocab(with_added_tokens=True)
        self.encoded = [""] * self.V          # ByteLevel ('Ġ') form
        for s, i in vocab.items():
            self.encoded[i] = s
        spec = json.loads(self.json_str)["added_tokens"]
        self.special_ids = sorted(t["id"] for t in spec if t.get("special"))
        dec = {c: b for b, c in bytes_to_unicode().items()}
        self.token_bytes = [None] * self.V    # real bytes; None for special tokens
        for i, s in enumerate(self.encoded):
            if i not in self.special_ids:
                self.token_bytes[i] = bytes(dec[c] for c in s)
        self.words = (self.V + 31) // 32

    def encode(self, text):
        return self.tk.encode(text, add_special_tokens=False).ids

    def new_mask(self):
        return np.zeros(self.words, dtype=np.int32)


def mask_has(mask, tok):
    return bool((int(mask[tok >> 5]) >> (tok & 31)) & 1)


def mask_count(mask):
    return int(np.unpackbits(mask.view(np.uint8)).sum())


# ----------------------------------------------------------------- outlines_core
class Outlines:
    name = "outlines_core"

    def __init__(self, tok):
        self.tok = tok

    def setup(self):
        from outlines_core import Vocabulary
        m = {}
        for i, b in enumerate(self.tok.token_bytes):
            if b is None:
                continue
            m.setdefault(b, []).append(i)
        self.vocab = Vocabulary(self.tok.eos_id, m)

    def regex_for_json(self, schema):
        from outlines_core.json_schema import build_regex_from_schema
        return build_regex_from_schema(json.dumps(schema))

    def compile_regex(self, pattern):
        from outlines_core import Index
        return Index(pattern, self.vocab)

    def compile_json(self, schema):
        return self.compile_regex(self.regex_for_json(schema))

    def compile_choice(self, choices):
        return self.compile_regex("(" + "|".join(re.escape(c) for c in choices) + ")")

    def matcher(self, index, mask):
        return OutlinesMatcher(index, mask)


class OutlinesMatcher:
    def __init__(self, index, mask):
        from outlines_core import Guide
        self.g = Guide(index, max_rollback=0)
        self.index = index
        self.ptr, self.n = mask.ctypes.data, mask.size

    def fill(self):
        self.g.write_mask_into(self.ptr, self.n, 4)

    def allowed_list(self):
        return self.g.get_tokens()

    def advance(self, t):
        try:
            self.g.advance(t, return_tokens=False)
            return True
        except Exception:
            return False

    def is_accepting(self):
        return self.g.is_finished() or self.index.is_final_state(self.g.get_state())


# ----------------------------------------------------------------- llguidance
class LLGuidance:
    name = "llguidance"

    def __init__(self, tok):
        self.tok = tok

    def setup(self):
        import llguidance
        self.llg = llguidance
        self.lltok = llguidance.LLTokenizer(self.tok.json_str, eos_token=self.tok.eos_id)

    def _check(self, grammar):
        m = self.llg.LLMatcher(self.lltok, grammar, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return grammar

    def compile_json(self, schema):
        return self._check(self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema)))

    def compile_regex(self, pattern):
        return self._check(self.llg.LLMatcher.grammar_from_regex(pattern))

    def compile_choice(self, choices):
        lark = "start: " + " | ".join(json.dumps(c) for c in choices)
        return self._check(self.llg.LLMatcher.grammar_from_lark(lark))

    def matcher(self, grammar, mask):
        return LLGMatcher(self.llg.LLMatcher(self.lltok, grammar, log_level=0), mask)


class LLGMatcher:
    def __init__(self, m, mask):
        self.m = m
        if m.is_error():
            raise RuntimeError(m.get_error())
        self.ptr, self.nbytes = mask.ctypes.data, mask.size * 4

    def fill(self):
        self.m.unsafe_compute_mask_ptr(self.ptr, self.nbytes)

    def advance(self, t):
        return self.m.consume_token(t)

    def is_accepting(self):
        return self.m.is_accepting()


# ----------------------------------------------------------------- xgrammar
class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, max_threads=2, cache=True):
        self.tok = tok
        self.max_threads = max_threads
        self.cache = cache

    def setup(self):
        import xgrammar as xgr
        self.xgr = xgr
        self.info = xgr.TokenizerInfo(self.tok.encoded, xgr.VocabType.BYTE_LEVEL,
                                      vocab_size=self.tok.V, stop_token_ids=[self.tok.eos_id],
                                      add_prefix_space=False)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=self.max_threads,
                                            cache_enabled=self.cache)

    def compile_json(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)

    def compile_regex(self, pattern):
        return self.compiler.compile_regex(pattern)

    def compile_choice(self, choices):
        ebnf = "root ::= " + " | ".join(json.dumps(c) for c in choices)
        return self.compiler.compile_grammar(ebnf)

    def matcher(self, compiled, mask):
        return XGRMatcher(self.xgr.GrammarMatcher(compiled), mask)


class XGRMatcher:
    def __init__(self, m, mask):
        import torch
        self.m = m
        # xgrammar takes DLPack tensors; this torch view shares memory with `mask`.
        self.t = torch.from_numpy(mask).view(1, -1)

    def fill(self):
        self.m.fill_next_token_bitmask(self.t, 0)

    def advance(self, t):
        return self.m.accept_token(t)

    def is_accepting(self):
        return self.m.is_completed() or self.m.is_terminated()


BACKENDS = {"outlines": Outlines, "llguidance": LLGuidance, "xgrammar": XGrammar}
