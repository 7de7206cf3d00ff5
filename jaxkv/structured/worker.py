"""Grammar compiles in a child process, so a cold compile never stalls the serving threads.

Reading an outlines-core index out into Python objects holds the GIL for as long as it takes
(hundreds of milliseconds for a schema at a large vocabulary, minutes for the largest), and
the engine's driver thread and the HTTP event loop need the GIL every step. A server
therefore compiles in one child process (`ProcessCompiler`), cached by spec in the parent;
a compile past its timeout is killed with the child (the next compile starts a fresh one).

Run as `python -m jaxkv.structured.worker READ_FD WRITE_FD` by `ProcessCompiler` only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

from jaxkv.structured.automaton import (MAX_INDEX_TRANSITIONS, AutomatonCache, TokenAutomaton,
                                        _vocabulary_key, spec_key, spec_regex)


class CompileTimeout(TimeoutError):
  """A grammar that did not compile within the compiler's timeout (the compile was killed)."""


class ProcessCompiler:
  """`AutomatonCache.compile` run in a child process, cached here by spec.

  Args:
    token_bytes: the bytes of every token id of the model's vocabulary (`vocab.token_bytes`,
      padded with None to the model's vocabulary size).
    max_transitions: the most index transitions read out (see `AutomatonCache`).
    timeout: seconds one compile may take (waiting for an earlier compile excluded).
    max_entries: compiled automata kept (the oldest goes first).

  Thread-safe: compiles are serialised through the one child; a spec already cached or
  refused by `spec_regex` (a malformed schema, say) never reaches it.
  """

  def __init__(self, token_bytes, *, max_transitions: int | None = MAX_INDEX_TRANSITIONS,
               timeout: float = 60.0, max_entries: int = 256):
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
      raise ValueError(f"timeout={timeout!r} must be a number of seconds > 0")
    self.token_bytes = list(token_bytes)
    self.vocab_size = len(self.token_bytes)
    self.max_transitions, self.timeout, self.max_entries = max_transitions, timeout, max_entries
    self._vocab_key = _vocabulary_key(self.token_bytes)
    self._entries: dict[str, TokenAutomaton] = {}
    self._lock = threading.Lock()      # the child: one compile at a time
    self._cache_lock = threading.Lock()
    self._child: tuple[subprocess.Popen, Connection, Connection] | None = None
    self.compiles = 0   # specs compiled by the child (cache misses that reached it)

  def compile(self, kind: str, value) -> TokenAutomaton:
    """The automaton of `(kind, value)` (`spec_regex`'s kinds).

    Raises:
      ValueError: the spec is malformed, matches nothing, or does not fit the pool.
      CompileTimeout: it did not compile within `timeout` seconds.
    """
    regex = spec_regex(kind, value)
    key = spec_key(self._vocab_key, regex)
    with self._cache_lock:
      hit = self._entries.get(key)
    if hit is not None:
      return hit
    with self._lock:
      with self._cache_lock:
        hit = self._entries.get(key)   # compiled while this thread waited
      if hit is not None:
        return hit
      automaton = self._remote(regex, key)
      self.compiles += 1
    with self._cache_lock:
      if len(self._entries) >= self.max_entries:
        self._entries.pop(next(iter(self._entries)))
      self._entries[key] = automaton
    return automaton

  def _remote(self, regex: str, key: str) -> TokenAutomaton:
    _, send, receive = self._start()
    send.send((regex, key))
    if not receive.poll(self.timeout):
      self.close()
      raise CompileTimeout(f"the grammar did not compile within {self.timeout:g} s")
    try:
      status, result = receive.recv()
    except (EOFError, OSError) as e:
      self.close()
      raise RuntimeError("the grammar compiler process ended unexpectedly") from e
    if status == "error":
      raise ValueError(result)
    return result

  def _start(self):
    if self._child is not None and self._child[0].poll() is None:
      return self._child
    self.close()
    to_child, from_parent = os.pipe()
    to_parent, from_child = os.pipe()
    env = dict(os.environ, JAX_PLATFORMS="cpu")   # the child never touches an accelerator
    proc = subprocess.Popen([sys.executable, "-m", "jaxkv.structured.worker", str(to_child),
                             str(from_child)], pass_fds=(to_child, from_child), env=env,
                            stdin=subprocess.DEVNULL)
    os.close(to_child)
    os.close(from_child)
    send, receive = Connection(from_parent, readable=False), Connection(to_parent, writable=False)
    send.send((self.token_bytes, self.max_transitions))
    self._child = (proc, send, receive)
    return self._child

  def close(self) -> None:
    """Ends the child (a later compile starts a new one)."""
    if self._child is None:
      return
    proc, send, receive = self._child
    self._child = None
    proc.kill()
    proc.wait()
    send.close()
    receive.close()

  def __del__(self):
    try:
      self.close()
    except Exception:   # pylint: disable=broad-except  (interpreter shutdown)
      pass


def _serve(receive: Connection, send: Connection) -> None:
  token_bytes, max_transitions = receive.recv()
  cache = AutomatonCache(token_bytes, max_entries=1, max_transitions=max_transitions)
  while True:
    try:
      regex, key = receive.recv()
    except EOFError:
      return
    try:
      send.send(("ok", cache._build(regex, key)))   # pylint: disable=protected-access
    except ValueError as e:
      send.send(("error", str(e)))


if __name__ == "__main__":
  _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
