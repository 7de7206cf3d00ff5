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


@contextlib.contextmanager
def serving_process(*flags: str):
  """`python -m jaxkv.cli serve *flags` on a free localhost port, on the CPU, until it answers
  `/v1/models`; yields `(proc, port, client)` (an `openai.OpenAI` for it). The process is
  killed if the block leaves it running."""
  import os, subprocess, sys   # pylint: disable=g-import-not-at-top,multiple-imports
  import openai   # pylint: disable=g-import-not-at-top
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  port = sock.getsockname()[1]
  sock.close()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen([sys.executable, "-m", "jaxkv.cli", "serve", *flags, "--port", str(port)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
  client = None
  try:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120,
                           max_retries=0)
    deadline = time.monotonic() + 600   # the warm-up compiles on a loaded CPU first
    while True:
      assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
      try:
        client.models.list()
        break
      except openai.APIConnectionError:
        time.sleep(0.5)
    yield proc, port, client
  finally:
    if client is not None:   # its pooled connections: a later test would see them unclosed
      client.close()
    if proc.poll() is None:
      proc.kill()
