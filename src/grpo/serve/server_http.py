"""The HTTP side of `grpo vllm-serve` (`grpo.serve.server`): routing, who may ask, body limits, and one JSON answer per
request whatever happens. The engine and the checks of what is asked live in `grpo.serve.server.Server`.

Who may ask, before any route runs:
- A request that carries an `Origin` header comes from a web page (browsers add it to every cross-origin POST and
  to fetches; grpo's client never sends one): refused (403) unless the origin's host is allowed (below).
- A server without an API key answers only requests addressed to a loopback name (`Host:` localhost, 127.x.x.x,
  [::1], any port; also 0.0.0.0 and [::], which clients use to reach this machine), or to a name given with
  `--allowed-hosts`: a web page whose domain an attacker re-points at 127.0.0.1 (DNS rebinding) sends its own
  domain as Host and is refused (403). With a key the key decides (a page
  cannot send it), and `--allowed-hosts '*'` turns the Host check off.
- Bodies must say what they are: `Content-Type: application/json` for /generate, `application/octet-stream` for
  /update_weights (415 otherwise), so a page's form or "simple" request cannot post one.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from grpo.serve.server import Server

logger = logging.getLogger("grpo")

_SOCKET_TIMEOUT_S = 120  # a client that announces a body and never sends it frees its thread after this
_LINGER_S, _LINGER_BYTES = 5.0, 256 * 2**20  # how much of a refused body is read before the connection closes
_CONTENT_TYPES = {"/generate": "application/json", "/update_weights": "application/octet-stream"}


class RequestError(Exception):
    """A request the server refuses: answered with `status` and the message, the server keeps serving."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, no port) names this machine's loopback interface."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The host of a `Host:` header value (`name`, `name:port`, `[v6]:port`), lower-cased."""
    value = value.strip().lower()
    if value.startswith("[") and "]" in value:
        end = value.index("]") + 1
        rest = value[end:]
        return value[:end] if rest == "" or (rest[0] == ":" and rest[1:].isdigit()) else value
    name, colon, port = value.rpartition(":")
    return name if colon and value.count(":") == 1 and port.isdigit() else value


class Access:
    """Which requests may reach the routes: `allowed` extra host names, `None` for any; `keyed` servers skip the
    Host check unless hosts were named (the key decides)."""

    def __init__(self, allowed_hosts: str | None, keyed: bool) -> None:
        names = {h.strip().lower() for h in (allowed_hosts or "").split(",") if h.strip()}
        self.star = "*" in names
        self.any_host = self.star or (keyed and not names)
        self.allowed = names - {"*"}

    def _host_ok(self, host: str) -> bool:
        # 0.0.0.0 / [::] reach this machine too (TRL's default vllm_server_host is 0.0.0.0); a page that fetches
        # such an address directly carries an Origin, refused above
        return self.any_host or is_loopback(host) or host in ("0.0.0.0", "[::]") or host in self.allowed

    def refusal(self, host: str | None, origin: str | None) -> str | None:
        """Why the request is refused (None: it may go on)."""
        if origin is not None:
            origin_host = (urlsplit(origin).hostname or "") if origin != "null" else ""
            if not (self.star or (origin_host and origin_host in self.allowed)):
                return (
                    f"requests from web pages (Origin: {origin[:100]}) are refused: a page must not drive the "
                    "server. Start it with --allowed-hosts NAME to allow that origin's host."
                )
        if host is None:
            return "a Host header is required"
        name = host_name(host)
        if not self._host_ok(name):
            return (
                f"Host {host[:100]!r} is not a loopback name: a server without an API key answers only requests "
                "addressed to localhost, 127.0.0.1 or [::1] (a page whose domain points at this machine must not "
                "reach it). Address it as http://127.0.0.1:PORT, or start it with --allowed-hosts "
                f"{name[:100]} (or an API key)."
            )
        return None


class AppServer(ThreadingHTTPServer):
    """The HTTP server that `Handler` answers for: `app` is the `grpo.serve.server.Server`, `access` who may ask."""

    app: Server
    access: Access


class Handler(BaseHTTPRequestHandler):
    """HTTP for `grpo.serve.server.Server` (`self.server.app`) with `self.server.access` deciding who may ask."""

    server: AppServer
    timeout = _SOCKET_TIMEOUT_S
    routes = {"/health": "GET", "/weight_version": "GET", "/generate": "POST", "/update_weights": "POST"}

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def _handle(self, method: str) -> None:
        self.body_read = False
        try:
            status, answer = 200, self._route(method)
        except RequestError as err:
            status, answer = err.status, {"error": str(err)}
        except Exception as err:  # never let one request take the server down
            logger.exception("grpo vllm-serve: %s %s failed", method, self.path)
            status, answer = 500, {"error": f"{type(err).__name__}: {err}"}
        self._send(status, answer)

    def _route(self, method: str) -> dict:
        app = self.server.app
        refusal = self.server.access.refusal(self.headers.get("Host"), self.headers.get("Origin"))
        if refusal is not None:
            raise RequestError(403, refusal)
        path = self.path.split("?", 1)[0]
        if path not in self.routes:
            raise RequestError(404, f"no route {path}; routes: {', '.join(self.routes)}")
        if self.routes[path] != method:
            raise RequestError(405, f"{path} takes {self.routes[path]}")
        if path == "/health":
            return app.health()
        if not app.authorized(self.headers.get("Authorization")):
            raise RequestError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')")
        if path == "/weight_version":
            return app.version_info()
        body = self._body(path, app.body_limit(path))
        if path == "/generate":
            return app.generate(body)
        return app.update_weights(body, self.headers)

    def _body(self, path: str, limit: int) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError(411, "a Content-Length header is required")
        try:
            size = int(length)
        except ValueError:
            raise RequestError(400, f"bad Content-Length {length!r}") from None
        if size < 0:
            raise RequestError(400, f"bad Content-Length {length!r}")
        if size > limit:
            raise RequestError(413, f"the body has {size} bytes; this route takes at most {limit}")
        given = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if given != _CONTENT_TYPES[path]:
            raise RequestError(415, f"{path} takes Content-Type: {_CONTENT_TYPES[path]}, not {given or 'none'!r}")
        body = self.rfile.read(size)
        self.body_read = True
        if len(body) != size:
            raise RequestError(400, f"the body ended after {len(body)} of {size} bytes")
        return body

    def _send(self, status: int, answer: dict) -> None:
        data = json.dumps(answer).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status >= 400:
                self.send_header("Connection", "close")  # an unread body must not be parsed as the next request
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)
            if status >= 400 and not self.body_read and self.command == "POST":
                self._linger()
        except OSError:  # the client went away
            self.close_connection = True

    def _linger(self) -> None:
        """Read (and drop) some of a refused body before closing: closing with unread bytes resets the connection,
        and the client, still sending, would see the reset instead of the answer. Bounded in bytes and time."""
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_WR)
        self.connection.settimeout(1.0)
        deadline, drained = time.monotonic() + _LINGER_S, 0
        while drained < _LINGER_BYTES and time.monotonic() < deadline:
            chunk = self.rfile.read1(2**16)
            if not chunk:
                break
            drained += len(chunk)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)
