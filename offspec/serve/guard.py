"""Who may use the server, and how long a connection may hold it: one pure ASGI middleware (it leaves `receive`
alone, so a handler still sees its client disconnect).

- The API key, when the server has one: `Authorization: <scheme> <key>` with the scheme `bearer` in any case and
  the key compared as bytes in constant time, on every route but /health (401). The key is never logged or echoed.
- Without a key on loopback (the default), what a web page the user opens could send is refused: a `Host` that is
  not a loopback name (DNS rebinding, 421), and a POST whose body is not `application/json` (a page may send
  `text/plain` without a preflight, 415).
- A declared body over the cap (413); the body's own read is timed in app.py.
- Every send of an answer must complete within WRITE_TIMEOUT_S: a client that stops reading loses its connection
  (its request is then cancelled, and its row freed).
- One access line a request (method, path, status, seconds; never the body) on the `offspec.access` logger, and
  the status counted for /metrics.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Optional

from offspec.serve.requests import ApiError

MAX_BODY_BYTES = 1 << 20          # a request body larger than this is refused (413)
WRITE_TIMEOUT_S = 30.0            # a send of an answer that takes longer ends the connection
LOOPBACK_HOSTS = (b"localhost", b"127.0.0.1", b"[::1]", b"::1")
access_log = logging.getLogger("offspec.access")


def key_matches(authorization: bytes, key: str) -> bool:
    """`Authorization: Bearer <key>` (the scheme in any case), compared as bytes in constant time."""
    scheme, _, token = authorization.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode("utf-8"))


def loopback_host(host: bytes) -> bool:
    """'localhost', '127.0.0.1:8000', '[::1]:8000' ...: a name that only this machine resolves to itself."""
    if host.startswith(b"["):
        name = host[: host.find(b"]") + 1]
    else:
        name = host.rsplit(b":", 1)[0] if host.count(b":") == 1 else host
    return name.lower() in LOOPBACK_HOSTS


def json_content(content_type: bytes) -> bool:
    return content_type.split(b";")[0].strip().lower() == b"application/json"


class Guard:
    def __init__(self, app, api_key: Optional[str], loopback: bool, service=None, access_log: str = "info"):
        self.app, self.api_key, self.loopback, self.service = app, api_key, loopback, service
        self.access_level = None if access_log == "off" else logging.getLevelName(access_log.upper())

    def refusal(self, scope) -> Optional[ApiError]:
        headers = dict(scope.get("headers", []))
        path = scope.get("path", "")
        scope.setdefault("state", {})["key_ok"] = self.api_key is not None and key_matches(
            headers.get(b"authorization", b""), self.api_key)
        if self.api_key is not None:
            if path != "/health" and not scope["state"]["key_ok"]:
                return ApiError(401, "incorrect or missing API key (Authorization: Bearer <key>)",
                                code="invalid_api_key")
        elif self.loopback:
            if not loopback_host(headers.get(b"host", b"")):
                return ApiError(421, "this server answers requests to localhost only (the Host header names another "
                                "host)", code="misdirected_request")
            if scope.get("method") == "POST" and not json_content(headers.get(b"content-type", b"")):
                return ApiError(415, "the request body must be sent as Content-Type: application/json",
                                code="unsupported_media_type")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), [0]

        async def timed_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await asyncio.wait_for(send(message), WRITE_TIMEOUT_S)     # a stalled reader: TimeoutError ends it

        try:
            err = self.refusal(scope)
            if err is not None:
                from fastapi.responses import JSONResponse
                await JSONResponse(err.body(), status_code=err.status, headers=err.headers)(scope, receive, timed_send)
            else:
                await self.app(scope, receive, timed_send)
        except asyncio.TimeoutError:    # the client stopped reading: uvicorn closes the unfinished response
            access_log.warning("%s %s %s: the client read nothing for %.0f s; its connection is closed",
                               (scope.get("client") or ("-",))[0], scope.get("method"), scope.get("path"),
                               WRITE_TIMEOUT_S)
        finally:
            if self.service is not None:
                self.service.answered(status[0] or 499)
            if self.access_level is not None:
                access_log.log(self.access_level, "%s %s %s %d %.3fs", (scope.get("client") or ("-",))[0],
                               scope.get("method"), scope.get("path"), status[0] or 499, time.perf_counter() - started)
