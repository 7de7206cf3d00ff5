"""A running server for tests: uvicorn in a thread on a free localhost port, always stopped."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn


@contextlib.contextmanager
def running(app, *, lifespan: str = "off"):
  """Serves `app` on 127.0.0.1 while the block runs; yields its base URL."""
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  config = uvicorn.Config(app, log_level="warning", lifespan=lifespan, timeout_graceful_shutdown=2)
  srv = uvicorn.Server(config)
  thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  deadline = time.monotonic() + 30
  while not srv.started:
    assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
    time.sleep(0.05)
  try:
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
  finally:
    srv.should_exit = True
    thread.join(timeout=20)
    sock.close()
  assert not thread.is_alive(), "the server did not stop"
