"""A grammar as a token automaton the device can step: allowed-token masks and transitions.

A spec (a JSON schema, a regex or a list of choices) is compiled by outlines-core into a
deterministic automaton over token ids of one vocabulary (regular languages only: a JSON
schema becomes a regex first). `TokenAutomaton` holds it as flat arrays a jitted step can
index without leaving the device: one packed bitmask per distinct allowed-token set, and
each state's transitions sorted by token (a binary search finds the next state). Nothing
here runs per token on the host, so a constrained request never makes the device wait.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import threading

import numpy as np

from jaxkv import _optional

_META = set("\\.+*?()|[]{}^$#&-~")


def regex_escape(text: str) -> str:
  """`text` as a literal in outlines-core's regex dialect (escapes metacharacters only)."""
  return "".join("\\" + c if c in _META else c for c in text)


def spec_regex(kind: str, value) -> str:
  """The regex of a spec: `("json", schema dict or str)`, `("regex", pattern)` or
  `("choice", [str, ...])`.

  Raises:
    ValueError: an unknown kind, an empty choice list, or a schema outlines-core refuses
      (the message names the kind).
  """
  if kind == "regex":
    if not isinstance(value, str) or not value:
      raise ValueError("regex must be a non-empty string")
    return value
  if kind == "choice":
    if (not isinstance(value, (list, tuple)) or not value
        or not all(isinstance(c, str) and c for c in value)):
      raise ValueError("choice must be a non-empty list of non-empty strings")
    return "(" + "|".join(regex_escape(c) for c in value) + ")"
  if kind == "json":
    json_schema = _optional.require("outlines_core", "structured output").json_schema
    try:
      schema = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
      raise ValueError(f"json schema: not JSON: {e}") from e
    numbers: dict[str, str] = {}
    text = json.dumps(enforceable(schema, numbers=numbers))
    try:
      regex = json_schema.build_regex_from_schema(text)
    except Exception as e:   # pylint: disable=broad-except  (the library raises its own types)
      raise ValueError(f"json schema: {e}") from e
    for placeholder, number in numbers.items():   # the bounded numbers, back in place
      quoted = f'"{placeholder}"'
      if quoted not in regex:
        raise ValueError("json schema: a bounded number could not be placed (report this)")
      regex = regex.replace(quoted, number)
    return regex
  raise ValueError(f"unknown structured output kind {kind!r} (json, regex or choice)")


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
  """What a request's output must be, spelled as vLLM's `StructuredOutputsParams`: exactly one
  of `json` (a JSON schema as a dict or JSON text, or a pydantic model class), `regex`,
  `choice` (a list of strings) or `json_object=True` (any JSON object). `grammar`
  (a context-free grammar) is refused: the engine follows automata, which hold regular
  languages only.

  Raises:
    ValueError: none or several given, or `grammar`.
  """

  json: object = None
  regex: str | None = None
  choice: object = None
  grammar: str | None = None
  json_object: bool = False

  def __post_init__(self):
    given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
    given += ["json_object"] if self.json_object else []
    if len(given) != 1:
      raise ValueError(f"structured outputs: give exactly one of json, regex, choice, "
                       f"json_object (got {given or 'none'})")
    if self.grammar is not None:
      raise ValueError("structured outputs: grammar (a context-free grammar) is not supported; "
                       "json, regex, choice and json_object are")

  def spec(self) -> tuple[str, object]:
    """`(kind, value)` for `AutomatonCache.compile`."""
    if self.json_object:
      return "json", {"type": "object"}
    if self.json is not None:
      schema = self.json
      if isinstance(schema, type) and hasattr(schema, "model_json_schema"):   # pydantic
        schema = schema.model_json_schema()
      return "json", schema
    if self.regex is not None:
      return "regex", self.regex
    return "choice", list(self.choice) if isinstance(self.choice, (list, tuple)) else self.choice


# Schema keywords the regex translation would drop silently: refused by name instead, so an
# output never fails the schema it was asked for (numeric bounds on a number or an integer
# node are spelled out as a regex of their own: `_bounded_number`).
UNENFORCED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
              "uniqueItems", "minProperties", "maxProperties", "if", "then", "else", "not",
              "allOf", "dependentRequired", "dependentSchemas", "patternProperties",
              "propertyNames", "contains", "minContains", "maxContains",
              "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
MAX_ENUM_RANGE = 1024   # integer parts a bounded range may spell out one by one
# Fractions of at most 16 digits (a float64 holds about 16): an output always ends, where
# unbounded digits let a model that never stops writing them run to max_tokens.
_FRACTION = r"(\.[0-9]{1,16})?"
# Not zero: spelled by where its first nonzero digit is, so the regex stays unambiguous (an
# ambiguous spelling's automaton grows with every digit it could be).
_NONZERO_FRACTION = r"\.(" + "|".join(f"0{{{k}}}[1-9][0-9]{{0,{15 - k}}}" for k in range(16)) + ")"
_ZERO_FRACTION = r"(\.0{1,16})?"


def _alternatives(values) -> str:
  return "(" + "|".join(str(v) for v in values) + ")"


def _at_least(lo: int, inclusive: bool, fraction: bool, where: str) -> str:
  """Digits of a magnitude `m >= lo` (`> lo` unless `inclusive`), `lo >= 0`, with a fraction
  when `fraction`.

  Raises:
    ValueError: spelling it takes more than `MAX_ENUM_RANGE` alternatives.
  """
  frac = _FRACTION if fraction else ""
  digits = len(str(lo))
  first = lo if inclusive or fraction else lo + 1
  if len(str(first)) > digits:   # lo = 99 exclusive: every 3-digit number on
    digits += 1
  if 10 ** digits - first > MAX_ENUM_RANGE:
    raise ValueError(f"json schema: the bound at {where} is too large to spell out (at most "
                     f"{MAX_ENUM_RANGE} numbers before the digits run free)")
  parts = []
  if fraction and not inclusive:
    parts.append(f"{lo}{_NONZERO_FRACTION}")
    first = lo + 1
  if first < 10 ** digits:
    parts.append(_alternatives(range(first, 10 ** digits)) + frac)
  parts.append(f"[1-9][0-9]{{{digits},}}" + frac)
  return "(" + "|".join(parts) + ")"


def _between(lo: int, lo_incl: bool, hi: int, hi_incl: bool, fraction: bool) -> str | None:
  """Digits of a magnitude in `[lo, hi]` (ends open unless inclusive), `0 <= lo <= hi`;
  None when it admits nothing."""
  parts = []
  frac = _FRACTION if fraction else ""
  inner = range(lo + 1, hi)
  if lo < hi:
    if lo_incl:
      parts.append(f"{lo}{frac}")
    elif fraction:
      parts.append(f"{lo}{_NONZERO_FRACTION}")
  if inner:
    parts.append(_alternatives(inner) + frac)
  if hi_incl and (lo < hi or (lo == hi and lo_incl)):
    parts.append(f"{hi}{_ZERO_FRACTION if fraction else ''}")
  return "(" + "|".join(parts) + ")" if parts else None


def _bounded_number(node: dict, where: str) -> str | None:
  """The regex of a bounded `number`/`integer` schema (None: not one). Integer-valued bounds
  only; no exponent (a JSON number without one is still a number).

  Raises:
    ValueError: a bound that is not an integer, or a range too wide to spell out.
  """
  kind = node.get("type")
  if kind not in ("number", "integer") or not any(k in node for k in _BOUNDS):
    return None
  extra = set(node) - set(_BOUNDS) - {"type", "title", "description", "default", "examples"}
  if extra:
    raise ValueError(f"json schema: {sorted(extra)[0]!r} beside numeric bounds at {where} is "
                     "not enforced by structured output")
  fraction = kind == "number"
  bounds = {}
  for k in _BOUNDS:
    if k not in node:
      continue
    v = node[k]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
      raise ValueError(f"json schema: keyword {k!r} at {where} is enforced for integer bounds "
                       f"only (got {v!r})")
    bounds[k] = int(v)
  lows = [(bounds[k], k == "minimum") for k in ("minimum", "exclusiveMinimum") if k in bounds]
  highs = [(bounds[k], k == "maximum") for k in ("maximum", "exclusiveMaximum") if k in bounds]
  # The tighter bound of each side (at a tie the exclusive one).
  lo = max(lows, default=None, key=lambda b: (b[0], not b[1]))
  hi = min(highs, default=None, key=lambda b: (b[0], b[1]))
  if lo is not None and not fraction and not lo[1]:
    lo = (lo[0] + 1, True)   # an integer above 3 is at least 4
  if hi is not None and not fraction and not hi[1]:
    hi = (hi[0] - 1, True)
  any_magnitude = "(0|[1-9][0-9]*)" + (_FRACTION if fraction else "")
  parts: list[str | None] = []
  if lo is not None and hi is not None:
    if hi[0] - lo[0] > MAX_ENUM_RANGE:
      raise ValueError(f"json schema: the range at {where} is wider than {MAX_ENUM_RANGE} "
                       "(a narrower range, or one bound)")
    (a, a_in), (b, b_in) = lo, hi
    if a >= 0:
      parts.append(_between(a, a_in, b, b_in, fraction))
    elif b < 0 or (b == 0 and not b_in):
      m = _between(-b, b_in, -a, a_in, fraction)
      parts.append(None if m is None else "-" + m)
    else:
      parts.append(_between(0, True, b, b_in, fraction))
      m = _between(0, False, -a, a_in, fraction)
      parts.append(None if m is None else "-" + m)
  elif lo is not None:
    a, a_in = lo
    if a >= 0:
      parts.append(_at_least(a, a_in, fraction, where))
    else:
      parts.append(any_magnitude)
      m = _between(0, False, -a, a_in, fraction)
      parts.append(None if m is None else "-" + m)
  else:
    b, b_in = hi
    if b > 0 or (b == 0 and b_in):
      parts.append("-" + any_magnitude)
      parts.append(_between(0, True, b, b_in, fraction))
    else:
      parts.append("-" + _at_least(-b, b_in, fraction, where))
  parts = [p for p in parts if p is not None]
  if not parts:
    raise ValueError(f"json schema: {where} admits no {kind}")
  return "(" + "|".join(parts) + ")"


def enforceable(schema, where: str = "$", numbers: dict | None = None):
  """`schema` with each bounded number replaced by a placeholder string constant whose regex
  goes into `numbers` (`spec_regex` puts it back into the schema's regex).

  Raises:
    ValueError: a keyword the translation would ignore (`UNENFORCED`), named with its path.
  """
  if isinstance(schema, bool) or not isinstance(schema, dict):
    return schema
  numbers = {} if numbers is None else numbers
  bounded = _bounded_number(schema, where)
  if bounded is not None:
    placeholder = f"JAXKVNUMBER{len(numbers)}X"
    numbers[placeholder] = bounded
    return {"const": placeholder}
  out = {}
  for key, value in schema.items():
    if key in UNENFORCED:
      raise ValueError(f"json schema: keyword {key!r} at {where} is not enforced by structured "
                       "output (integer bounds on a number or an integer are)")
    if key == "oneOf" and isinstance(value, list):   # "exactly one" holds for disjoint types only
      types = [v.get("type") if isinstance(v, dict) else None for v in value]
      if (not all(isinstance(t, str) for t in types) or len(set(types)) < len(types)
          or {"integer", "number"} <= set(types)):   # an integer is a number too
        raise ValueError(f"json schema: oneOf at {where} is enforced only over branches of "
                         "distinct single types (use anyOf)")
    if key in _SCHEMA_MAPS and isinstance(value, dict):
      value = {k: enforceable(v, f"{where}.{key}.{k}", numbers) for k, v in value.items()}
    elif key in _SCHEMA_LISTS and isinstance(value, list):
      value = [enforceable(v, f"{where}.{key}[{i}]", numbers) for i, v in enumerate(value)]
    elif key in _SCHEMA_VALUES:
      value = enforceable(value, f"{where}.{key}", numbers)
    out[key] = value
  return out


@dataclasses.dataclass(frozen=True, eq=False)
class TokenAutomaton:
  """A deterministic automaton over token ids (`AutomatonCache.compile`).

  Tokens that every state treats alike (the same next state from each state, or refused by
  each) share a class: a free-text state of a large vocabulary has a few classes where it has
  most of the vocabulary's tokens, so transitions are stored by class.

  Attributes:
    vocab_size: token ids are `0..vocab_size-1`.
    initial: the start state.
    final: `bool[S]`: the text so far is a whole match (stop tokens may end it).
    mask_of: `int32[S]`: each state's row of `masks`.
    masks: `uint32[M, ceil(V / 32)]`: the distinct allowed-token sets, packed (bit
      `t % 32` of word `t // 32` is token `t`).
    class_of: `int32[V]`: each token's class.
    start, count: `int32[S]`: each state's transitions, `tokens[start:start + count]`.
    tokens, next: `int32[T]`: transition classes (ascending within a state) and targets.
    key: a digest of the spec and vocabulary it was compiled from.
  """

  vocab_size: int
  initial: int
  final: np.ndarray
  mask_of: np.ndarray
  masks: np.ndarray
  class_of: np.ndarray
  start: np.ndarray
  count: np.ndarray
  tokens: np.ndarray
  next: np.ndarray
  key: str = ""

  @property
  def identity(self):
    """Equal for automata of one spec and vocabulary (its `key`; else this object): requests
    whose automata arrive as copies (from a front process) share one place in the pool."""
    return self.key or id(self)

  @property
  def num_states(self) -> int:
    return int(self.final.shape[0])

  @property
  def nbytes(self) -> int:
    """Bytes of its arrays: what placing it on the device takes."""
    return sum(a.nbytes for a in (self.final, self.mask_of, self.masks, self.class_of,
                                  self.start, self.count, self.tokens, self.next))

  def allowed(self, state: int) -> np.ndarray:
    """`bool[vocab_size]`: the tokens state `state` allows."""
    bits = np.unpackbits(self.masks[self.mask_of[state]].view(np.uint8), bitorder="little")
    return bits[:self.vocab_size].astype(bool)

  def step(self, state: int, token: int) -> int:
    """The state after `token` (-1 if the state does not allow it)."""
    if not self.allowed(state)[token]:
      return -1
    lo, n = int(self.start[state]), int(self.count[state])
    key = int(self.class_of[token])
    i = lo + int(np.searchsorted(self.tokens[lo:lo + n], key))
    return int(self.next[i]) if i < lo + n and self.tokens[i] == key else -1

  def is_dead_end(self, state: int) -> bool:
    """A final state with no transitions: only a stop token may follow."""
    return bool(self.final[state]) and int(self.count[state]) == 0


def _vocabulary_key(token_bytes) -> str:
  h = hashlib.sha256()
  for b in token_bytes:
    h.update(b"\x00" if b is None else b"\x01" + len(b).to_bytes(4, "little") + b)
  return h.hexdigest()


def from_transitions(transitions: dict, initial, finals, vocab_size: int, *,
                     drop=(), key: str = "") -> TokenAutomaton:
  """Packs `{state: {token: next state}}` (any hashable state ids) into a `TokenAutomaton`;
  tokens in `drop` (the library's end-of-sequence stand-in) and states that cannot reach a
  final state are left out (a sampled path never strands)."""
  finals = set(finals)
  # Each state's edges as arrays: a schema at a large vocabulary has millions of transitions,
  # so nothing below loops over them in Python (the GIL would stall every other thread).
  raw = {s: (np.fromiter(out.keys(), np.int64, len(out)), list(out.values()))
         for s, out in transitions.items()}
  states = set(raw) | finals | {initial}
  for _, nexts in raw.values():
    states.update(nexts)
  # Keep the states from which a final state is reachable (reverse search from the finals).
  back: dict = {}
  for s, (_, nexts) in raw.items():
    for n in set(nexts):
      back.setdefault(n, set()).add(s)
  live, todo = set(finals), list(finals)
  while todo:
    for p in back.get(todo.pop(), ()):
      if p not in live:
        live.add(p)
        todo.append(p)
  if initial not in live:
    raise ValueError("the grammar matches no text this vocabulary can spell")
  order = [initial] + sorted((s for s in live if s != initial), key=repr)
  index = {s: i for i, s in enumerate(order)}
  words = -(-vocab_size // 32)
  drop = np.array(sorted(drop), np.int64)
  edges = []   # each state's kept (tokens, targets), targets as indices of `order`
  for s in order:
    tokens, nexts = raw.get(s, (np.zeros(0, np.int64), []))
    target = np.fromiter((index.get(n, -1) for n in nexts), np.int64, len(nexts))
    keep = (target >= 0) & (tokens >= 0) & (tokens < vocab_size) & ~np.isin(tokens, drop)
    edges.append((tokens[keep], target[keep]))
  class_of = _classes(edges, vocab_size)
  final = np.array([s in finals for s in order], bool)
  start = np.zeros(len(order), np.int32)
  count = np.zeros(len(order), np.int32)
  mask_of = np.zeros(len(order), np.int32)
  toks, nxt, rows, row_of, at = [], [], [], {}, 0
  for i, (tokens, target) in enumerate(edges):
    tokens = np.sort(tokens)
    keys, first = np.unique(class_of[tokens], return_index=True)   # one transition per class
    by_token = np.argsort(edges[i][0], kind="stable")
    targets = target[by_token][first]
    start[i], count[i] = at, keys.size
    at += keys.size
    toks.append(keys.astype(np.int32))
    nxt.append(targets.astype(np.int32))
    ids = tokens.astype(np.int32).tobytes()
    if ids not in row_of:
      bits = np.zeros(words * 32, np.uint8)
      bits[tokens] = 1
      row_of[ids] = len(rows)
      rows.append(np.packbits(bits, bitorder="little").view(np.uint32))
    mask_of[i] = row_of[ids]
  return TokenAutomaton(vocab_size, 0, final, mask_of, np.stack(rows), class_of, start, count,
                        np.concatenate(toks).astype(np.int32), np.concatenate(nxt).astype(np.int32),
                        key)


def _classes(edges, vocab_size: int) -> np.ndarray:
  """`int32[V]`: token classes of an automaton's `edges` (per state: tokens, targets), numbered
  from 0: tokens with the same target from every state (absent: refused) share a class.
  Found by hashing each token's column of targets state by state, then checked exactly."""
  h = np.zeros(vocab_size, np.uint64)
  with np.errstate(over="ignore"):
    for i, (tokens, target) in enumerate(edges):
      mix = (np.uint64(i + 1) * np.uint64(0x9E3779B97F4A7C15)
             ^ (target.astype(np.uint64) + np.uint64(1)) * np.uint64(0xC2B2AE3D27D4EB4F))
      h[tokens] = (h[tokens] ^ mix) * np.uint64(0x100000001B3) + np.uint64(i)
  _, class_of = np.unique(h, return_inverse=True)
  class_of = class_of.astype(np.int32).reshape(-1)
  members = np.bincount(class_of)
  for tokens, target in edges:   # exact: within a state a class has one target, and every
    # token of a class is present where one is (a hash collision would merge two columns)
    if tokens.size == 0:
      continue
    cls = class_of[tokens]
    order = np.argsort(cls, kind="stable")
    cls, tgt = cls[order], target[order]
    same = cls[1:] == cls[:-1]
    present, count = np.unique(cls, return_counts=True)
    if np.any(tgt[1:][same] != tgt[:-1][same]) or np.any(count != members[present]):
      return np.arange(vocab_size, dtype=np.int32)   # a collision: every token its own class
  return class_of


def spec_key(vocab_key: str, regex: str) -> str:
  """The cache key (and `TokenAutomaton.key`) of `regex` over the vocabulary `vocab_key`."""
  return hashlib.sha256(f"{vocab_key}\x00{regex}".encode()).hexdigest()


def _transitions_estimate(index) -> int | None:
  """A lower bound of an outlines-core index's transitions from its serialized size (about 7
  bytes each, at least 8 counted here); None where the library does not serialize so."""
  try:
    blob = index.__reduce__()[1][0]
  except Exception:   # pylint: disable=broad-except  (a library detail: no estimate then)
    return None
  return len(blob) // 8 if isinstance(blob, bytes) else None


# outlines-core index transitions read out at most (about 100 bytes each while read out).
MAX_INDEX_TRANSITIONS = 20_000_000


class AutomatonCache:
  """Compiled automata of one vocabulary, by spec (`compile`): a spec compiles once.

  Thread-safe: fronts compile off their event loop, several at a time.
  """

  def __init__(self, token_bytes, *, max_entries: int = 256,
               max_transitions: int | None = MAX_INDEX_TRANSITIONS):
    self.token_bytes = list(token_bytes)
    # An index clearly larger is refused before its transitions are read out into Python
    # objects (tens of millions take minutes and gigabytes); what is stored is by class.
    self.max_transitions = max_transitions
    self.vocab_size = len(self.token_bytes)
    self.vocab_key = _vocabulary_key(self.token_bytes)
    self.max_entries = max_entries
    self._lock = threading.Lock()
    self._entries: dict[str, TokenAutomaton] = {}
    self._building: dict[str, threading.Event] = {}

  @functools.cached_property
  def _vocabulary(self):
    oc = _optional.require("outlines_core", "structured output")
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(self.token_bytes):
      if b:   # None (special) and empty tokens never advance a text grammar
        by_bytes.setdefault(b, []).append(i)
    # outlines-core wants an end-of-sequence id; one past the vocabulary, dropped from the tables.
    return oc.Vocabulary(self.vocab_size, by_bytes)

  def compile(self, kind: str, value) -> TokenAutomaton:
    """The automaton of `(kind, value)` (see `spec_regex`), compiled once per spec.

    Raises:
      ValueError: the spec is malformed or matches nothing this vocabulary can spell.
    """
    regex = spec_regex(kind, value)
    key = spec_key(self.vocab_key, regex)
    while True:
      with self._lock:
        hit = self._entries.get(key)
        if hit is not None:
          return hit
        waiting = self._building.get(key)
        if waiting is None:
          self._building[key] = threading.Event()
          break
      waiting.wait()   # another thread compiles this spec; its result (or failure) is shared
    try:
      automaton = self._build(regex, key)
    finally:
      with self._lock:
        self._building.pop(key).set()
    with self._lock:
      if len(self._entries) >= self.max_entries:
        self._entries.pop(next(iter(self._entries)))   # the oldest
      self._entries[key] = automaton
    return automaton

  def _build(self, regex: str, key: str) -> TokenAutomaton:
    oc = _optional.require("outlines_core", "structured output")
    try:
      index = oc.Index(regex, self._vocabulary)
    except Exception as e:   # pylint: disable=broad-except  (the library raises its own types)
      raise ValueError(f"the grammar cannot be compiled for this vocabulary: {e}") from e
    if self.max_transitions is not None:
      estimate = _transitions_estimate(index)
      if estimate is not None and estimate > self.max_transitions:
        raise ValueError(f"the grammar compiles to about {estimate:,} token transitions before "
                         f"they are grouped by class; at most {self.max_transitions:,} are read "
                         "(a smaller schema or vocabulary)")
    return from_transitions(index.get_transitions(), index.get_initial_state(),
                            set(index.get_final_states()), self.vocab_size,
                            drop=(self.vocab_size,), key=key)
