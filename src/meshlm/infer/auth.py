"""The API key of `meshlm serve`.

Responsible for: checking a request's `Authorization: Bearer KEY` header (the scheme matched without regard to
case, as RFC 7235 says; the key compared in constant time; a missing or malformed header is a 401, never an
error of the server); reading a key from a file (`--api-key-file`: its first line, so that `ps` never shows
it); and the warning for a server that other machines can reach without a key.
Not responsible for: TLS (put a proxy in front), users, scopes or rate limits.
"""

from __future__ import annotations

import hmac
import ipaddress
from pathlib import Path

from meshlm.infer.requests import APIError


def bearer_token(authorization: str) -> bytes | None:
    """The credentials of an `Authorization: Bearer <token>` header as sent (bytes), or None when the header
    is missing, of another scheme, or carries no token."""
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip(" \t")
    if scheme.lower() != "bearer" or not token:
        return None
    # ASGI servers decode header bytes as latin-1: this gives back the bytes the client sent.
    return token.encode("latin-1", errors="replace")


class APIKey:
    """`check(request)` raises a 401 APIError unless the request carries the key (or no key is set)."""

    def __init__(self, key: str | None):
        # The key's UTF-8 bytes are what a client sends; surrogateescape keeps a command line's raw bytes.
        self.expected = None if key is None else key.encode("utf-8", errors="surrogateescape")

    @property
    def required(self) -> bool:
        return self.expected is not None

    def allows(self, authorization: str) -> bool:
        if self.expected is None:
            return True
        sent = bearer_token(authorization)
        return sent is not None and hmac.compare_digest(sent, self.expected)

    def check(self, request) -> None:
        if not self.allows(request.headers.get("authorization", "")):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key", type_="authentication_error")


def read_key_file(path: str | Path) -> str:
    """The key in the first line of `path`, stripped; ValueError naming the file when it is missing or empty."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            key = f.readline().strip()
    except FileNotFoundError:
        raise ValueError(f"--api-key-file {str(path)!r}: no such file") from None
    except OSError as e:
        raise ValueError(f"--api-key-file {str(path)!r} cannot be read: {e.strerror or e}") from None
    if not key:
        raise ValueError(f"--api-key-file {str(path)!r}: its first line is empty; put the key there")
    return key


def api_key_of(api_key: str | None, api_key_file: str | None) -> str | None:
    """The key of `--api-key` / `--api-key-file` (at most one of them), or None."""
    if api_key is not None and api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if api_key_file is not None:
        return read_key_file(api_key_file)
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key is empty; give a key (or none to serve without one)")
    return api_key


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server to this machine (127.x, ::1, localhost)."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a hostname, or "" (every address)
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The startup warning for a server that other machines can reach and that requires no key, else None."""
    if api_key is not None or is_loopback(host):
        return None
    return (f"meshlm serve: warning: listening on {host or 'every address'}, reachable from other machines, "
            "without an API key: anyone who can connect can use the model (give --api-key-file PATH, or "
            "--host 127.0.0.1)")
