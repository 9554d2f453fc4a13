"""One vLLM server over HTTP, as server mode's client (`grpo.rollout.remote`) speaks to it: vLLM's own OpenAI server
(`python -m vllm.entrypoints.openai.api_server`, or `grpo vllm-serve`, which starts it) in dev mode
(`VLLM_SERVER_DEV_MODE=1`, for its weight-transfer routes). No vLLM import: JSON over `urllib`.

- **Who it is** (`describe`, when the run starts): dev mode (`/server_info`: else one error naming
  VLLM_SERVER_DEV_MODE), a weight-transfer engine (else one error naming `--weight-transfer-config`), its dtype,
  context length, world size and model name, and that its tokenizer is the policy's (`/tokenize` of a probe text:
  a server of another model or vocabulary is one error naming it).
- **Liveness.** A request may take long (a generation, a push); a dead server must not hang the run: while one is
  in flight `/health` is polled, and a server that has not answered it for `vllm_server_timeout` seconds is an error
  naming its URL and saying how to resume. At start the client waits up to `vllm_server_timeout` for the server.
  A generation also needs progress: vLLM's token counters on `/metrics` (`vllm:prompt_tokens_total`,
  `vllm:generation_tokens_total`) are read every few seconds, and an engine that has produced no token for
  `vllm_server_timeout` while a generation waits is a dead server too, even when `/health` answers (one hostile
  request could once wedge an engine that way). A server whose statistics are off (`--disable-log-stats`) has no
  counters: there only `/health` is read.
- **Keys.** With `vllm_server_api_key` (or GRPO_VLLM_API_KEY) every request carries `Authorization: Bearer <key>`.
- **Weights** (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`, `finish_weight_update`:
  vLLM's `VLLMWeightSyncClient`, which its trainer-side engines drive) and **weight versions** (`version`,
  `set_version`: vLLM's `/weight_info` and `/update_weight_version`).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from grpo.base import sigterm

_POLL_S = 1.0  # how often /health is asked while a request is in flight
_PROGRESS_POLL_S = 3.0  # how often the token counters on /metrics are read while a generation is in flight
_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
# a text whose tokens a server of the policy's tokenizer must give as the policy's tokenizer does
PROBE = "GRPO probe: The quick brown fox jumps over 13 lazy dogs. ¿Qué? 数学 🙂\n\tx = y**2;"


_METRICS_MAX = 8 << 20  # a /metrics page is read up to this many bytes


def token_counters(text: str) -> tuple[float, ...] | None:
    """The sums of vLLM's prompt and generation token counters (over their labels: engines, models) in a
    Prometheus text page; None when the page has neither."""
    sums = dict.fromkeys(_COUNTERS, 0.0)
    seen = False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            try:
                sums[name] += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            seen = True
    return tuple(sums.values()) if seen else None


class ServerError(RuntimeError):
    """A vLLM server is unreachable, refused a request, answered wrongly, or holds another run's weights."""


class _Unreachable(ServerError):
    """The server did not answer at all (refused, reset, timed out)."""


class ServerClient:
    """One server at `url` (`timeout`: vllm_server_timeout; `key`: its API key or None)."""

    def __init__(self, url: str, timeout: float, key: str | None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.key = key
        self.answered = 0.0  # when /health last answered (the requests in flight share one poll a second)
        self.lock = threading.Lock()
        # the engine's token counters (None: not read yet; (): the server has none), when they were last read and
        # when they last moved (shared by the generations in flight)
        self.counters: tuple[float, ...] | None = None
        self.counted = 0.0
        self.progressed = 0.0

    # ---- HTTP ---------------------------------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        """The decoded JSON answer of one request (`body` sent as JSON); a refusal is a ServerError naming it."""
        raw = self._send(method, path, body, timeout)
        try:
            return json.loads(raw) if raw else None
        except ValueError as err:
            raise ServerError(f"The vLLM server at {self.url} answered {path} with something that is not JSON") from err

    def _send(self, method: str, path: str, body: Any, timeout: float | None, limit: int = -1) -> bytes:
        """The raw answer (at most `limit` bytes; -1: all) of one request, with the key; a refusal or an unreachable
        server is a ServerError naming it."""
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        request = urllib.request.Request(self.url + path, data=data, method=method)
        if body is not None:
            request.add_header("Content-Type", "application/json")
        if self.key:
            request.add_header("Authorization", f"Bearer {self.key}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.read(limit)
        except urllib.error.HTTPError as err:
            raise self._refused(path, err) from err
        except OSError as err:  # refused, reset, timed out: the server is not there (any more)
            reason = getattr(err, "reason", err)
            raise _Unreachable(
                f"The vLLM server at {self.url} cannot be reached ({path}: {reason}). If it stopped, the checkpoints "
                "in output_dir are intact: start it again and continue with trainer.train(resume_from_checkpoint=True)."
            ) from err

    def _refused(self, path: str, err: urllib.error.HTTPError) -> ServerError:
        detail = err.read().decode(errors="replace")[:600]
        hint = ""
        if err.code == 401:
            hint = " (set vllm_server_api_key, or GRPO_VLLM_API_KEY, to the server's key)"
        elif err.code == 403:
            hint = " (the server refuses this request's Host or Origin: address it by 127.0.0.1, or give it a key)"
        return ServerError(f"The vLLM server at {self.url} refused {path} ({err.code}): {detail}{hint}")

    def healthy(self) -> bool:
        with self.lock:
            if time.monotonic() - self.answered < _POLL_S:
                return True
            try:
                self.request("GET", "/health", timeout=min(self.timeout, 10.0))
            except (OSError, ServerError, ValueError):
                return False
            self.answered = time.monotonic()
            return True

    def still_for(self, start: float) -> float | None:
        """For how many seconds (since `start`) the engine's token counters have been seen standing still, read at
        most every few seconds; None when the server has no counters (its statistics are off) or /metrics cannot
        be read."""
        with self.lock:
            now = time.monotonic()
            if self.counters != () and now - self.counted >= min(_PROGRESS_POLL_S, self.timeout / 3):
                self.counted = now
                counters = self._read_counters()
                if counters is None:
                    self.counters = ()
                elif counters != self.counters:
                    self.counters, self.progressed = counters, now
            if not self.counters:
                return None
            return self.counted - max(start, self.progressed)

    def _read_counters(self) -> tuple[float, ...] | None:
        try:
            text = self.request_text("/metrics", timeout=min(self.timeout, 10.0))
        except (OSError, ServerError, ValueError):
            return None
        return token_counters(text)

    def request_text(self, path: str, timeout: float) -> str:
        """The body of a GET as text (/metrics is Prometheus' text format, not JSON), at most _METRICS_MAX bytes."""
        return self._send("GET", path, None, timeout, _METRICS_MAX).decode("utf-8", errors="replace")

    def wait_until_up(self) -> None:
        deadline = time.monotonic() + self.timeout
        while not self.healthy():
            if time.monotonic() > deadline:
                raise ServerError(
                    f"No vLLM server answered at {self.url} within vllm_server_timeout={self.timeout:g} s. Start one "
                    "with `grpo vllm-serve --model <the policy's model>` (set vllm_server_host/vllm_server_port or "
                    "vllm_server_base_url to its address), or set vllm_mode='colocate'."
                )
            sigterm.check()
            time.sleep(_POLL_S)

    def while_alive(self, method: str, path: str, body: Any = None, progress: bool = False) -> Any:
        """The request's answer, waited for as long as the server answers /health: one that has not for
        vllm_server_timeout meanwhile is an error (a slow answer from a live server is waited for). `progress` (a
        generation): an engine whose token counters have not moved for vllm_server_timeout is an error too."""
        result: dict[str, Any] = {}
        start = time.monotonic()

        def call() -> None:
            try:
                result["value"] = self.request(method, path, body)
            except BaseException as err:  # handed to the waiting thread
                result["error"] = err

        worker = threading.Thread(target=call, daemon=True, name="grpo-server-request")
        worker.start()
        last_seen = time.monotonic()
        while worker.is_alive():
            worker.join(_POLL_S)
            sigterm.check()
            if worker.is_alive():
                if self.healthy():
                    last_seen = time.monotonic()
                elif time.monotonic() - last_seen > self.timeout:
                    raise self.gone(path)
                still = self.still_for(start) if progress else None
                if still is not None and still > self.timeout:
                    raise self.stalled(path)
        if "error" in result:
            error = result["error"]
            if isinstance(error, ServerError) and not isinstance(error, _Unreachable):
                raise error
            raise self.gone(path) from error
        return result["value"]

    def gone(self, path: str) -> ServerError:
        return ServerError(
            f"The vLLM server at {self.url} stopped answering during {path} (no /health answer for "
            f"vllm_server_timeout={self.timeout:g} s, or the connection broke). The checkpoints in output_dir are "
            "intact: start the server again and continue with trainer.train(resume_from_checkpoint=True)."
        )

    def stalled(self, path: str) -> ServerError:
        return ServerError(
            f"The vLLM server at {self.url} answers /health, but its engine has produced no token for "
            f"vllm_server_timeout={self.timeout:g} s while {path} waited (vllm:prompt_tokens_total and "
            "vllm:generation_tokens_total on its /metrics stood still): its engine is stuck. Restart the server; the "
            "checkpoints in output_dir are intact: continue with trainer.train(resume_from_checkpoint=True). (A "
            "server that is merely slow needs a larger vllm_server_timeout.)"
        )

    # ---- what the server is -------------------------------------------------------------------------------------

    def describe(self, tokenizer: Any) -> dict:
        """The server's facts (`model`, `dtype`, `max_model_len`, `backend`, `world_size`), checked as the module
        docstring says."""
        self.wait_until_up()
        try:
            info = self.request("GET", "/server_info?config_format=json", timeout=self.timeout)
        except ServerError as err:
            if "(404)" in str(err):
                raise ServerError(
                    f"The vLLM server at {self.url} does not serve its development routes, which push the policy's "
                    "weights to it: start it with VLLM_SERVER_DEV_MODE=1 in its environment (grpo vllm-serve does)."
                ) from None
            raise
        config = (info or {}).get("vllm_config") or {}
        transfer = config.get("weight_transfer_config")
        if not transfer:
            raise ServerError(
                f"The vLLM server at {self.url} has no weight-transfer engine, which the trainer pushes the policy's "
                """weights through: start it with --weight-transfer-config '{"backend": "gloo"}' on a CPU ("nccl" """
                "on GPUs), as grpo vllm-serve does."
            )
        model = config.get("model_config") or {}
        name = str(model.get("served_model_name") or model.get("model"))
        facts = {
            "model": name,
            "dtype": str(model.get("dtype", "float32")).removeprefix("torch."),
            "max_model_len": int(model.get("max_model_len") or 0),
            "backend": str(transfer.get("backend")),
            "world_size": int(self.request("GET", "/get_world_size", timeout=self.timeout)["world_size"]),
        }
        self._check_tokenizer(tokenizer, name)
        return facts

    def _check_tokenizer(self, tokenizer: Any, model: str) -> None:
        text_tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        mine = list(text_tokenizer(PROBE, add_special_tokens=False)["input_ids"])
        body = {"model": model, "prompt": PROBE, "add_special_tokens": False}
        theirs = (self.request("POST", "/tokenize", body, timeout=self.timeout) or {}).get("tokens")
        if theirs != mine:
            raise ServerError(
                f"The vLLM server at {self.url} serves {model}, whose tokenizer splits text differently from the "
                f"policy's ({theirs[:8] if isinstance(theirs, list) else theirs} where the policy's gives {mine[:8]}): "
                "it serves another model or vocabulary. Start it with the policy's model."
            )

    # ---- weights: vLLM's VLLMWeightSyncClient, and weight versions -----------------------------------------------

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.while_alive("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.while_alive("POST", "/start_weight_update", {})

    def update_weights(self, update_info: Any) -> None:
        self.while_alive("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {} if weight_version is None else {"weight_version": weight_version}
        self.while_alive("POST", "/finish_weight_update", body)

    def version(self) -> str:
        """The weight version the server holds (vLLM's `/weight_info`)."""
        answer = self.request("GET", "/weight_info", timeout=self.timeout)
        return str((answer or {}).get("weight_version"))

    def set_version(self, version: str) -> None:
        self.request("POST", "/update_weight_version", {"new_version": version}, timeout=self.timeout)

    def reset_caches(self) -> None:
        """Drop what the server computed with its old weights: the prefix cache and the image encoder's."""
        self.request("POST", "/reset_prefix_cache", timeout=self.timeout)
        self.request("POST", "/reset_encoder_cache", timeout=self.timeout)
