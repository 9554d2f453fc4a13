"""`Guard`: the protections a vLLM server needs to be safe to run for training, as an ASGI middleware that vLLM's
own `--middleware grpo.serve.guard.Guard` option installs (`grpo vllm-serve` passes it).

What vLLM 0.32's server does and does not do (measured with real requests, `tests/with_vllm/test_server.py`):
- `--api-key` (or VLLM_API_KEY) guards only `/v1`, `/v2`, `/inference` and `/cohere`. Dev mode
  (VLLM_SERVER_DEV_MODE=1, which weight transfer needs) opens `/update_weights`, `/collective_rpc` (a call of any
  method on every worker), `/sleep`, `/pause`, `/server_info` (the server's environment) and more, none of them
  guarded by the key.
- CORS is off by default, which keeps a web page from *reading* answers, not from sending requests: a page's
  plain POST to `/pause` or `/reset_prefix_cache` (no body) runs. Bodies must be JSON (FastAPI refuses other
  content types), so a page's form cannot post weights.
- No `Host` check: a page whose domain an attacker points at 127.0.0.1 (DNS rebinding) reaches a server bound to
  loopback as a same-origin site, and may read its answers and post JSON.

The guard closes these, before any route runs:
- with a key (the server's `--api-key` or VLLM_API_KEY; `grpo vllm-serve` takes it from `--api-key` or
  GRPO_VLLM_API_KEY), every route but `/health` and `/ping` needs `Authorization: Bearer <key>` (compared in
  constant time), the dev routes included (401);
- a request with an `Origin` header (a web page's: grpo's client never sends one) is refused (403) unless its host
  is allowed (GRPO_VLLM_ALLOWED_HOSTS, comma-separated, `grpo vllm-serve --allowed-hosts`; `*`: any);
- without a key, only requests addressed to a loopback name (`Host:` localhost, 127.x.x.x, [::1], or 0.0.0.0 and
  [::], which clients use to reach this machine) or an allowed host are answered (403): DNS rebinding.

Sampling parameters: vLLM's server validates them itself before they reach the engine (out-of-range seeds, token
ids in `logit_bias`, `allowed_token_ids`, `stop_token_ids` or the prompt, negative `top_k` or `temperature`,
`min_p` above 1, `min_tokens` past `max_tokens`, bad structured-output patterns: each a 400, and the engine serves
on; `tests/with_vllm/test_server.py` sends each). Two holes were measured, and the guard closes them with a 400: a
lone UTF-16 surrogate (`"\\ud800"`, valid JSON) anywhere in a JSON body (a 500 in `bad_words`), and, on
`/inference/v1/generate`, `max_tokens` past the context (`/v1/completions` refuses it; this route took it and
generated to the end of the context).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

ALLOWED_HOSTS_ENV = "GRPO_VLLM_ALLOWED_HOSTS"
OPEN_ROUTES = ("/health", "/ping")  # answered without the key (a load balancer's, the trainer's liveness checks)

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate (paired or not)
_BODY_MAX = 1 << 30  # a body is read for the surrogate check up to this size (larger ones are vLLM's to refuse)

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


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
    """Who may ask: `keys` (sha256 digests of the API keys; none: keyless) and `allowed` host names (`*`: any)."""

    def __init__(self, keys: list[str], allowed_hosts: str | None) -> None:
        self.keys = [hashlib.sha256(key.encode()).digest() for key in keys if key]
        names = {h.strip().lower() for h in (allowed_hosts or "").split(",") if h.strip()}
        self.star = "*" in names
        self.allowed = names - {"*"}

    def refusal(self, path: str, headers: dict[str, str]) -> tuple[int, str] | None:
        """(status, why) when the request is refused; None when it may go on."""
        origin = headers.get("origin")
        if origin is not None:
            origin_host = (urlsplit(origin).hostname or "") if origin != "null" else ""
            if not (self.star or (origin_host and origin_host in self.allowed)):
                return 403, (
                    f"requests from web pages (Origin: {origin[:100]}) are refused: a page must not drive the server. "
                    "Start it with --allowed-hosts NAME to allow that origin's host."
                )
        host = headers.get("host")
        if host is None:
            return 403, "a Host header is required"
        name = host_name(host)
        reachable = self.star or is_loopback(name) or name in ("0.0.0.0", "[::]") or name in self.allowed
        if not self.keys and not reachable:
            return 403, (
                f"Host {host[:100]!r} is not a loopback name: a server without an API key answers only requests "
                "addressed to localhost, 127.0.0.1 or [::1] (a page whose domain points at this machine must not "
                f"reach it). Address it as http://127.0.0.1:PORT, or start it with --allowed-hosts {name[:100]} (or "
                "an API key)."
            )
        if self.keys and path not in OPEN_ROUTES and not self._authorized(headers.get("authorization")):
            return 401, "missing or wrong API key (send 'Authorization: Bearer KEY')"
        return None

    def _authorized(self, header: str | None) -> bool:
        scheme, _, given = (header or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(given.strip().encode()).digest()
        return any([hmac.compare_digest(digest, key) for key in self.keys])  # every key compared: constant time


class Guard:
    """The ASGI middleware (see the module docstring). vLLM builds it with the app alone; the keys are the server's
    own (`app.state.args.api_key`, VLLM_API_KEY), read at the first request, when the app's state is set."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.access: Access | None = None

    def _access(self, scope: Scope) -> Access:
        if self.access is None:
            args = getattr(getattr(scope.get("app"), "state", None), "args", None)
            keys = list(getattr(args, "api_key", None) or []) or [os.environ.get("VLLM_API_KEY", "")]
            self.access = Access(keys, os.environ.get(ALLOWED_HOSTS_ENV))
        return self.access

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope.get("type") not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")) or "/"
        refused = self._access(scope).refusal(path, headers)
        if refused is None and scope["type"] == "http" and scope.get("method") == "POST":
            body, receive = await _buffered(receive)
            refused = lone_surrogate(body)
            if refused is None and path == "/inference/v1/generate":
                refused = past_the_context(body, _max_model_len(scope))
        if refused is None:
            return await self.app(scope, receive, send)
        status, why = refused
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await _answer(send, status, why)


def lone_surrogate(body: bytes) -> tuple[int, str] | None:
    """(400, why) when a JSON body holds a string with an unpaired UTF-16 surrogate (which no UTF-8 text can hold:
    vLLM's tokenizers fail on it, with a 500 in one place); None otherwise, or when the body is not JSON."""
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        value = json.loads(body)
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return 400, "the request holds a lone UTF-16 surrogate (such as \\ud800), which is not text: remove it"
    except (ValueError, RecursionError):
        return None  # not JSON: vLLM's own parser answers
    return None


def past_the_context(body: bytes, max_model_len: int | None) -> tuple[int, str] | None:
    """(400, why) when a token-in generation asks for more tokens than the context holds after its prompt."""
    if max_model_len is None:
        return None
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return None
    sampling = request.get("sampling_params") if isinstance(request, dict) else None
    prompt = request.get("token_ids") if isinstance(request, dict) else None
    asked = sampling.get("max_tokens") if isinstance(sampling, dict) else None
    if isinstance(asked, int) and isinstance(prompt, list) and len(prompt) + asked > max_model_len:
        return 400, (
            f"max_tokens={asked} after a prompt of {len(prompt)} tokens is past the context of {max_model_len} "
            "tokens: ask for fewer"
        )
    return None


def _max_model_len(scope: Scope) -> int | None:
    config = getattr(getattr(scope.get("app"), "state", None), "vllm_config", None)
    value = getattr(getattr(config, "model_config", None), "max_model_len", None)
    return value if isinstance(value, int) else None


async def _buffered(receive: Callable) -> tuple[bytes, Callable]:
    """The request's body (up to _BODY_MAX bytes read), and a `receive` that hands the same messages on."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message.get("type") != "http.request":
            break
        size += len(message.get("body", b""))
        if not message.get("more_body") or size > _BODY_MAX:
            break
    body = b"".join(m.get("body", b"") for m in messages if m.get("type") == "http.request")

    async def replay() -> Any:
        return messages.pop(0) if messages else await receive()

    return (body if size <= _BODY_MAX else b""), replay


async def _answer(send: Callable, status: int, why: str) -> None:
    body = json.dumps({"error": why}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
