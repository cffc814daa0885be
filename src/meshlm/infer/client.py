"""The client side of `meshlm serve` that a script starting a server needs: waiting until it is ready.

Responsible for: `wait_until_healthy`, which polls a server's GET /health until it answers 200 (the model
is loaded and, on tp x cp ranks, every rank is up), and gives up with `ServerNotReady` once a deadline
passes or the server's process has exited. Standard library only: no extra is needed to wait.
Not responsible for: starting or stopping servers, or sending requests (any OpenAI client, httpx).
"""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.request


class ServerNotReady(RuntimeError):
    """The server did not answer /health with 200 in time, or its process exited first."""


def wait_until_healthy(url: str, *, timeout_s: float, proc=None, poll_s: float = 0.1) -> None:
    """Return once GET `url`/health answers 200. `url`: the server's base URL (http://host:port);
    `proc`: its `subprocess.Popen`, if this process started it (a server that exits stops the wait at
    once); `poll_s`: the pause between tries. Raises `ServerNotReady` after `timeout_s` seconds."""
    health = url.rstrip("/") + "/health"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(health, timeout=1) as response:
                if response.status == 200:
                    return
        except urllib.error.HTTPError as e:  # 503: up, but not healthy (yet)
            e.close()
        except (OSError, http.client.HTTPException):  # not listening yet, or hung up
            pass
        if proc is not None and proc.poll() is not None:
            raise ServerNotReady(f"the server exited (code {proc.returncode}) before {health} answered")
        if time.monotonic() > deadline:
            raise ServerNotReady(f"{health} did not answer 200 within {timeout_s} s")
        time.sleep(poll_s)
