"""Token automata for structured output (jaxkv/structured/).

Oracles that share no code with the tables: Python's `re` and `jsonschema` judge the text of
random walks through an automaton (every walk that ends in a final state must match, and the
tokens a state allows must be exactly those some matching text continues with, checked on
small vocabularies by brute force), and outlines-core's own `Index` judges the pool's
device lookups state by state.
"""

from __future__ import annotations

import json
import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

oc = pytest.importorskip("outlines_core", reason="structured output needs outlines-core")
jsonschema = pytest.importorskip("jsonschema")

from jaxkv.structured import automaton as am  # noqa: E402
from jaxkv.structured import pool as pl  # noqa: E402
from jaxkv.structured.vocab import token_bytes  # noqa: E402

# A small vocabulary with multi-character tokens, specials (None) and an empty-text id.
VOCAB = [None, None] + [bytes([c]) for c in range(32, 127)] + [
    b"ab", b"abc", b"Pa", b"ris", b"Lon", b"don", b" \"", b"\":", b"{\"", b"\"}", b"12", b"true",
    b"null", b", ", b"\": ", b"name", b"age", b"  ", b"\n"]

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "tag": {"enum": ["a", "bc", "Paris"]}},
     "required": ["ok"]},
    {"type": "array", "items": {"type": "integer", "exclusiveMinimum": -3, "maximum": 40},
     "minItems": 1, "maxItems": 3},
    {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "null"}}, "required": ["x"]}},
     "type": "object", "properties": {"p": {"$ref": "#/$defs/p"}}, "required": ["p"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0,
                                                "exclusiveMaximum": 20},
                                      "qty": {"type": "integer", "minimum": 1},
                                      "t": {"type": "number", "maximum": -2}},
     "required": ["price", "qty", "t"]},
]
REGEXES = [r"[A-Z][a-z]{1,4} [0-9]{2}", r"(ab|abc)+c?", r"-?[0-9]+(\.[0-9]{1,2})?"]
CHOICES = [["Paris", "London", "ab"], ["a+b", "(x)", "a.b"]]


@pytest.fixture(scope="module")
def cache():
  return am.AutomatonCache(VOCAB)


def _walk(a: am.TokenAutomaton, rng: random.Random, max_tokens: int = 60):
  """Random allowed tokens until a final state chooses to stop (or must); the tokens or None."""
  state, out = a.initial, []
  for _ in range(max_tokens):
    if a.final[state] and (a.count[state] == 0 or rng.random() < 0.3):
      return out
    choices = np.flatnonzero(a.allowed(state))
    assert choices.size, "a non-final state allows nothing: the walk is stranded"
    token = int(rng.choice(list(choices)))
    state = a.step(state, token)
    assert state >= 0
    out.append(token)
  return None   # still going: long strings of an unbounded grammar


def _text(tokens) -> str:
  return b"".join(VOCAB[t] for t in tokens).decode()


@pytest.mark.parametrize("kind,value", [("regex", r) for r in REGEXES]
                         + [("choice", c) for c in CHOICES])
def test_every_walk_of_a_regex_or_choice_matches(cache, kind, value):
  a = cache.compile(kind, value)
  pattern = value if kind == "regex" else "|".join(re.escape(c) for c in value)
  rng = random.Random(0)
  seen = 0
  for _ in range(200):
    tokens = _walk(a, rng)
    if tokens is not None:
      assert re.fullmatch(pattern, _text(tokens)), _text(tokens)
      seen += 1
  assert seen > 50
  if kind == "choice":   # every choice is reachable
    texts = {_text(t) for t in (_walk(a, random.Random(i)) for i in range(300)) if t is not None}
    assert texts == set(value)


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_every_walk_of_a_schema_validates(cache, schema):
  a = cache.compile("json", schema)
  rng = random.Random(1)
  seen = 0
  for _ in range(150):
    tokens = _walk(a, rng, max_tokens=80)
    if tokens is not None:
      jsonschema.validate(json.loads(_text(tokens)), schema)
      seen += 1
  assert seen > 20


def test_a_state_allows_exactly_the_tokens_some_match_continues_with(cache):
  """Brute force over the vocabulary: token t is allowed after prefix p iff p + t is a prefix
  of some match, judged by `re` over every string up to the pattern's bounded length."""
  pattern = r"(ab|abc|Pa)ris?"
  a = cache.compile("regex", pattern)
  matches = {m for m in ("abris", "abri", "abcris", "abcri", "Paris", "Pari")}
  assert all(re.fullmatch(pattern, m) for m in matches)
  prefixes = {m[:i] for m in matches for i in range(len(m) + 1)}
  frontier = [(a.initial, "")]
  while frontier:
    state, text = frontier.pop()
    want = {t for t, b in enumerate(VOCAB) if b and (text + b.decode()) in prefixes}
    assert set(np.flatnonzero(a.allowed(state))) == want, text
    assert bool(a.final[state]) == (text in matches)
    frontier += [(a.step(state, t), text + VOCAB[t].decode()) for t in want]


def test_the_pool_agrees_with_outlines_index(cache):
  """Device lookups over a pool of three automata against outlines-core's `Index` walked in
  parallel with the same tokens (its state ids are its own; the walk pairs them)."""
  specs = [("regex", REGEXES[0]), ("json", SCHEMAS[0]), ("choice", CHOICES[0])]
  automata = [cache.compile(k, v) for k, v in specs]
  pool, initials = pl.pack(automata, len(VOCAB), states=512)
  pool = pl.Pool(*map(jnp.asarray, pool))
  vocab = oc.Vocabulary(len(VOCAB), {b: [i for i, x in enumerate(VOCAB) if x == b]
                                     for b in {x for x in VOCAB if x}})
  indexes = [oc.Index(am.spec_regex(k, v), vocab) for k, v in specs]
  allowed = jax.jit(pl.allowed, static_argnums=3)
  advance = jax.jit(pl.advance, static_argnums=3)
  stop = jnp.array([[0, -1]] * 3, jnp.int32)   # id 0 is each row's stop token
  rng = random.Random(2)
  ours = jnp.array(initials, jnp.int32)
  theirs = [ix.get_initial_state() for ix in indexes]
  for _ in range(40):
    rows = np.asarray(allowed(pool, ours, stop, len(VOCAB)))
    tokens = []
    for r, ix in enumerate(indexes):
      want = set(ix.get_allowed_tokens(theirs[r]) or ()) - {len(VOCAB)}
      got = set(np.flatnonzero(rows[r])) - {0}
      assert got == want
      assert rows[r, 0] == ix.is_final_state(theirs[r])   # the stop token only when final
      tokens.append(rng.choice(sorted(want)) if want else 0)
    nxt = np.array(advance(pool, ours, jnp.array(tokens, jnp.int32), len(VOCAB)))
    for r, ix in enumerate(indexes):
      if tokens[r] == 0:   # the stop token leaves the automaton: only stop tokens then
        assert nxt[r] == pl.DEAD
        nxt[r] = initials[r]
        theirs[r] = ix.get_initial_state()
      else:
        theirs[r] = ix.get_next_state(theirs[r], tokens[r])
    ours = jnp.asarray(nxt)
  # Rows without a grammar: everything allowed, state unchanged.
  none = jnp.array([-1], jnp.int32)
  assert bool(np.all(np.asarray(allowed(pool, none, stop[:1], len(VOCAB)))))
  assert int(advance(pool, none, jnp.array([5], jnp.int32), len(VOCAB))[0]) == -1


def test_refusals_name_what_is_wrong(cache):
  with pytest.raises(ValueError, match="choice must be a non-empty list"):
    cache.compile("choice", [])
  with pytest.raises(ValueError, match="unknown structured output kind 'grammar'"):
    cache.compile("grammar", "root ::= x")
  with pytest.raises(ValueError, match="json schema"):
    cache.compile("json", "{not json")
  with pytest.raises(ValueError, match="cannot be compiled for this vocabulary"):
    cache.compile("regex", "\u00e9+")   # no token spells it


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "number", "minimum": 0.5}, "'minimum' at \\$ is enforced for integer bounds"),
    ({"minimum": 0}, "'minimum' at \\$ is not enforced"),   # no type: not a number node
    ({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 3}}},
     "'multipleOf' at \\$.properties.a"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems'"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf at \\$ is enforced only"),
    ({"type": "integer", "minimum": 0, "maximum": 10 ** 6}, "wider than"),
    ({"type": "integer", "minimum": 5000}, "too large to spell out"),
    ({"type": "integer", "minimum": 3, "multipleOf": 2}, "'multipleOf' beside numeric bounds"),
])
def test_keywords_the_automaton_cannot_enforce_are_refused_by_name(cache, schema, keyword):
  with pytest.raises(ValueError, match=keyword):
    cache.compile("json", schema)


def test_a_property_named_like_a_keyword_is_a_name_not_a_keyword(cache):
  schema = {"type": "object", "properties": {"minimum": {"type": "boolean"}},
            "required": ["minimum"]}
  a = cache.compile("json", schema)
  tokens = _walk(a, random.Random(3), max_tokens=80)
  jsonschema.validate(json.loads(_text(tokens)), schema)


def test_a_spec_compiles_once(cache):
  a = cache.compile("regex", r"x[0-9]")
  assert cache.compile("regex", r"x[0-9]") is a


def test_token_bytes_of_byte_level_and_metaspace_tokenizers():
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import decoders, models, pre_tokenizers   # pylint: disable=g-import-not-at-top
  bl = tokenizers.Tokenizer(models.BPE({"a": 0, "\u0120": 1, "\u0120a": 2, "\u00c3": 3,
                                        "\u00a9": 4}, [("\u0120", "a")]))
  bl.pre_tokenizer, bl.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
  assert token_bytes(bl) == [b"a", b" ", b" a", b"\xc3", b"\xa9"]   # "é" is two tokens
  import os   # pylint: disable=g-import-not-at-top
  from jaxkv.tokenizer import Tokenizer   # pylint: disable=g-import-not-at-top
  fixture = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf_llama")
  tok = Tokenizer.from_checkpoint(fixture)
  got = token_bytes(tok)
  ids = tok.encode("hello world of France", add_special_tokens=False)
  # The decoder drops the text's first space (Metaspace's "first" scheme) and nothing else.
  assert b"".join(got[i] for i in ids).decode() == " " + tok.decode(ids)
  assert all(got[i] is None for i in range(8))   # the specials


def test_an_index_too_large_to_read_out_is_refused_before_its_tables_are_built():
  small = am.AutomatonCache(VOCAB, max_transitions=50)
  with pytest.raises(ValueError, match="compiles to about .* token transitions before they are "
                                       "grouped by class; at most 50 are read"):
    small.compile("json", SCHEMAS[0])
  a = small.compile("choice", ["ab", "Paris"])   # a few transitions: built
  assert a.tokens.shape[0] <= 50


def test_tokens_a_state_treats_alike_share_a_class_and_every_lookup_is_unchanged(cache):
  """Against outlines-core's own index, token by token: each state allows exactly the index's
  tokens and steps to the state the index names; the tables store far fewer transitions."""
  regex = am.spec_regex("json", SCHEMAS[0])
  index = oc.Index(regex, cache._vocabulary)   # pylint: disable=protected-access
  a = cache.compile("json", SCHEMAS[0])
  raw = index.get_transitions()
  assert a.tokens.shape[0] < sum(len(v) for v in raw.values())
  # Map the index's state ids onto the automaton's by walking both from the start.
  ids, todo = {index.get_initial_state(): a.initial}, [index.get_initial_state()]
  while todo:
    s = todo.pop()
    out = {t: n for t, n in raw.get(s, {}).items() if t < len(VOCAB)}
    allowed = set(np.flatnonzero(a.allowed(ids[s])))
    assert allowed <= set(out)   # (states that reach no final state are pruned)
    for t in range(len(VOCAB)):
      got = a.step(ids[s], t)
      if t not in allowed:
        assert got == -1
        continue
      n = out[t]
      if n not in ids:
        ids[n] = got
        todo.append(n)
      assert got == ids[n], (s, t)


def test_bounded_numbers_admit_only_numbers_in_range():
  """`_bounded_number`'s regex against `jsonschema` on random bounds: every text it admits is
  valid, and every valid plain decimal (except a negative zero) is admitted."""
  rng = random.Random(0)
  texts = [str(x) for x in range(-40, 41)] + [f"{x}.{f}" for x in range(-40, 41)
                                              for f in ("0", "00", "5", "05", "001", "999")]
  texts += ["0.0", "1000", "1000.5", "1003", "12345", "-12345", "100000.25"]
  # Fractions of the longest admitted length (16 digits) and one past it.
  long_fractions = ["0." + "0" * 15 + "1", "0." + "0" * 16, "3." + "9" * 16, "1." + "0" * 16,
                    "-2." + "5" * 16]
  too_long = ["0." + "0" * 16 + "1", "3." + "9" * 17, "2." + "0" * 17]
  texts += long_fractions + too_long
  checked = 0
  for kind in ("number", "integer"):
    for _ in range(150):
      node = {"type": kind} | {k: rng.choice([rng.randint(-30, 30), 0, 1, 99, 1000, -99])
                               for k in ("minimum", "maximum", "exclusiveMinimum",
                                         "exclusiveMaximum") if rng.random() < 0.4}
      try:
        pattern = am._bounded_number(node, "$")   # pylint: disable=protected-access
      except ValueError as e:   # a range too wide, or none at all
        assert "wider than" in str(e) or "too large" in str(e) or "admits no" in str(e)
        continue
      if pattern is None:
        continue
      checked += 1
      for text in texts:
        value = json.loads(text)
        valid = not (kind == "integer" and "." in text) and jsonschema.Draft202012Validator(
            node).is_valid(value)
        admitted = re.fullmatch(pattern, text) is not None
        assert valid or not admitted, (node, text)
        assert admitted or not valid or text.startswith("-0") or text in too_long, (node, text)
        assert not (admitted and text in too_long), (node, text)
  assert checked > 150


def test_bounded_fractions_keep_the_automaton_small(cache):
  """A bounded number's fraction is spelled unambiguously: an open range such as (0, 1) once
  compiled to ~98k states (an ambiguous `[0-9]{0,15}[1-9][0-9]{0,15}`), past any pool."""
  for node in ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
               {"type": "number", "exclusiveMinimum": -1, "maximum": 2},
               {"type": "number", "exclusiveMinimum": 7}):
    a = cache.compile("json", {"type": "object", "properties": {"x": node}, "required": ["x"]})
    assert a.num_states < 400, (node, a.num_states)


def test_the_process_compiler_caches_refuses_and_kills_a_compile_past_its_timeout(cache):
  from jaxkv.structured import worker   # pylint: disable=g-import-not-at-top
  pc = worker.ProcessCompiler(VOCAB, timeout=120)
  try:
    a = pc.compile("regex", r"x[0-9]{1,3}")
    assert pc.compile("regex", r"x[0-9]{1,3}") is a and pc.compiles == 1
    b = cache.compile("regex", r"x[0-9]{1,3}")   # the same tables as compiled here
    for name in ("final", "mask_of", "masks", "start", "count", "tokens", "next"):
      assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.identity == b.identity
    with pytest.raises(ValueError, match="cannot be compiled for this vocabulary"):
      pc.compile("regex", "\u00e9+")
    # "an `a` 16th from the end" determinises to 2^17 states: about 15 s here, killed at 0.2 s.
    pc.timeout = 0.2
    with pytest.raises(worker.CompileTimeout, match="did not compile within 0.2 s"):
      pc.compile("regex", "[ab]*a[ab]{15}")
    assert pc._child is None   # pylint: disable=protected-access
    pc.timeout = 120
    assert pc.compile("regex", r"y[0-9]").num_states == 3 and pc.compiles == 2   # a new child
  finally:
    pc.close()
