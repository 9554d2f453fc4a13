"""`ServerEngine`: generation on a `grpo vllm-serve` server (`use_vllm=True`, `vllm_mode="server"`), over HTTP.

The server (`grpo.serve.server`) hosts vLLM in its own process; this client never imports vLLM. Protocol: JSON
`POST /generate`, raw safetensors `POST /update_weights` with an `X-Weight-Version` header, `GET /health` and
`GET /weight_version`; every route but /health carries `Authorization: Bearer <key>` when a key is set
(`vllm_server_api_key`, or the environment variable GRPO_VLLM_API_KEY).

- **Weights.** Before the first generation after an optimizer step every process takes part in gathering the
  policy's weights (`grpo.rollout.weights`: sharded models gather collectively, LoRA sends base + delta); the main
  process sends them, in the server's dtype, as one safetensors body naming this run (`X-Run`: run_name or the
  output_dir's name, host and pid); the server numbers the push and answers with its version, which the main
  process hands to the others. Every generation names that version and the run: a server that holds other weights
  (a stale one, or one another run has pushed to since) answers 409, an error here, so it is never sampled from.
- **Replies are checked** before anything is trained on them: one list of `n` samples per request, token ids in
  the server's vocabulary, at most `max_tokens` of them, one log-prob (a number or null) per token, the version
  asked for. A reply that is not so is an error naming the server, never an IndexError or a reward function's
  "wrong number of values".
- **Liveness.** A generation may take long; a dead server must not hang the run. While a request is in flight the
  client polls `/health`; a server that has not answered it for `vllm_server_timeout` seconds is an error that
  names the URL and says how to resume. At start the client waits up to `vllm_server_timeout` for the server.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any, TypeGuard

import torch
from accelerate.utils import broadcast_object_list
from safetensors.torch import save

from grpo.base import sigterm
from grpo.models.vision import encode_image
from grpo.rollout.base import Request, Rollout, assemble, expand
from grpo.rollout.vllm import check_expanded, multimodal_input
from grpo.rollout.weights import checkpoint_weights

API_KEY_ENV = "GRPO_VLLM_API_KEY"
_POLL_S = 1.0  # how often /health is asked while waiting


class ServerError(RuntimeError):
    """The generation server is unreachable, refused a request, or is not at the expected weight version."""


def server_url(args: Any) -> str:
    return (args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}").rstrip("/")


class ServerEngine:
    """Samples on a `grpo vllm-serve` server (see the module docstring)."""

    name = "vllm-server"
    samples_elsewhere = True

    def __init__(self, tokenizer: Any, args: Any, stop_ids: list[int], accelerator: Any, sampling: dict) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.accelerator = accelerator
        self.url = server_url(args)
        self.timeout = float(args.vllm_server_timeout)
        self.key = args.vllm_server_api_key or os.environ.get(API_KEY_ENV)
        self.sampling = sampling
        self.max_tokens = args.max_completion_length
        self.info = self._wait_until_up()
        self.vocab_size = int(self.info.get("vocab_size") or len(tokenizer))
        self.version: int | None = None  # the server's number of this run's last push (None: none yet)
        label = (args.run_name or os.path.basename(str(args.output_dir).rstrip("/\\")) or "grpo")[:100]
        run = f"{label} ({socket.gethostname()[:60]} pid {os.getpid()})"  # the server's X-Run: printable
        self.run = "".join(c if c.isprintable() else "?" for c in run)

    # ---- HTTP ---------------------------------------------------------------------------------------------------

    def _request(self, path: str, body: bytes | None = None, headers: dict | None = None, timeout: float | None = None):
        request = urllib.request.Request(self.url + path, data=body, method="POST" if body is not None else "GET")
        for name, value in (headers or {}).items():
            request.add_header(name, value)
        if self.key and path != "/health":
            request.add_header("Authorization", f"Bearer {self.key}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:500]
            hint = " (set vllm_server_api_key or GRPO_VLLM_API_KEY to the server's key)" if err.code == 401 else ""
            raise ServerError(f"The vLLM server at {self.url} refused {path} ({err.code}): {detail}{hint}") from err

    def _healthy(self) -> dict | None:
        try:
            return self._request("/health", timeout=min(self.timeout, 10.0))
        except (OSError, ServerError, ValueError):
            return None

    def _wait_until_up(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            info = self._healthy()
            if info is not None:
                return info
            if time.monotonic() > deadline:
                raise ServerError(
                    f"No vLLM server answered at {self.url} within vllm_server_timeout={self.timeout:g} s. Start one "
                    "with `grpo vllm-serve --model <the policy's model>` (set vllm_server_host/vllm_server_port or "
                    "vllm_server_base_url to its address), or set vllm_mode='colocate'."
                )
            time.sleep(_POLL_S)

    def _while_alive(self, path: str, body: bytes, headers: dict) -> dict:
        """The request's answer; an error if the server stops answering /health for vllm_server_timeout meanwhile
        (a slow answer from a live server is waited for)."""
        result: dict[str, Any] = {}

        def call() -> None:
            try:
                result["value"] = self._request(path, body, headers)
            except BaseException as err:  # handed to the waiting thread
                result["error"] = err

        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        last_seen = time.monotonic()
        while worker.is_alive():
            worker.join(_POLL_S)
            sigterm.check()
            if worker.is_alive():
                if self._healthy() is not None:
                    last_seen = time.monotonic()
                elif time.monotonic() - last_seen > self.timeout:
                    raise self._gone(path)
        if "error" in result:
            if isinstance(result["error"], ServerError):
                raise result["error"]
            raise self._gone(path) from result["error"]
        return result["value"]

    def _gone(self, path: str) -> ServerError:
        return ServerError(
            f"The vLLM server at {self.url} stopped answering during {path} (no /health answer for "
            f"vllm_server_timeout={self.timeout:g} s). The checkpoints in output_dir are intact: start the server "
            "again and continue with trainer.train(resume_from_checkpoint=True)."
        )

    # ---- the engine interface -----------------------------------------------------------------------------------

    def sync_weights(self, model: torch.nn.Module, group: Any = None) -> None:
        """Every process calls it (gathering a sharded policy is collective); the main process pushes and hands
        the server's number of the push to the others, over `group` when given (an async producer's own group:
        the default one is the learner's)."""
        dtype = getattr(torch, self.info.get("dtype", "float32"))
        main = self.accelerator.is_main_process
        with checkpoint_weights(model) as weights:
            tensors = {name: t.to("cpu", dtype).contiguous() for name, t in weights} if main else {}
        version = None
        if main:
            headers = {"Content-Type": "application/octet-stream", "X-Run": self.run}
            answer = self._while_alive("/update_weights", save(tensors), headers)
            version = answer.get("weight_version") if isinstance(answer, dict) else None
            if not _is_int(version) or version < 1 or answer.get("run") != self.run:
                raise ServerError(
                    f"The vLLM server at {self.url} answered the push with {str(answer)[:200]}, not this run's new "
                    "weight version: is it a `grpo vllm-serve` of this grpo version?"
                )
        if group is not None:
            shared: list[Any] = [version, self.run]
            torch.distributed.broadcast_object_list(shared, src=0, group=group)
            version, self.run = shared
        elif self.accelerator.num_processes > 1:  # the others wait here until the server has loaded the push
            version, self.run = broadcast_object_list([version, self.run], from_process=0)  # the main's name
        self.version = version

    def _request_of(self, request: Request) -> dict:
        """One request as JSON; an image prompt as its unexpanded ids and its images (`multimodal_input`)."""
        vllm_input = multimodal_input(request.prompt, self.tokenizer)
        out = {
            "prompt_ids": vllm_input["prompt_token_ids"],
            "n": request.num_samples,
            "max_tokens": request.max_tokens or self.max_tokens,
        }
        if "multi_modal_data" in vllm_input:
            out["images"] = [encode_image(image) for image in vllm_input["multi_modal_data"]["image"]]
        return out

    def generate(self, requests: Sequence[Request]) -> Rollout:
        sigterm.check()
        if not requests:  # a follow-up turn of a tool loop where this process has no row left
            return Rollout([], [], [], [])
        sent = [self._request_of(r) for r in requests]
        payload = {
            "requests": sent,
            "sampling": self.sampling,
            "weight_version": self.version,
            "run": self.run if self.version is not None else None,
        }
        answer = self._while_alive("/generate", json.dumps(payload).encode(), {"Content-Type": "application/json"})
        tokens, logps = self._checked(answer, sent)
        for request, expanded in zip(requests, answer.get("prompt_ids") or [None] * len(requests)):
            check_expanded(request.prompt, expanded)
        return assemble(expand(requests), tokens, logps, self.stop_ids, self.tokenizer)

    def _checked(self, answer: Any, sent: list[dict]) -> tuple[list[list[int]], list[list[float]]]:
        """The reply's token ids and log-probs, per sample, once it is what was asked for (else a ServerError)."""

        def bad(what: str) -> ServerError:
            return ServerError(
                f"The vLLM server at {self.url} answered /generate with {what}; nothing of it is used. Is it a "
                "`grpo vllm-serve` of the policy's model (same tokenizer and vocabulary) and of this grpo version?"
            )

        if not isinstance(answer, dict) or not isinstance(answer.get("outputs"), list):
            raise bad("no 'outputs' list")
        if self.version is not None and answer.get("weight_version") != self.version:
            raise bad(f"weight version {answer.get('weight_version')!r} where this run's is {self.version}")
        if len(answer["outputs"]) != len(sent):
            raise bad(f"{len(answer['outputs'])} outputs for {len(sent)} requests")
        tokens, logps = [], []
        for i, (request, samples) in enumerate(zip(sent, answer["outputs"])):
            if not isinstance(samples, list) or len(samples) != request["n"]:
                count = len(samples) if isinstance(samples, list) else "no list of"
                raise bad(f"{count} samples for request {i}, which asked for {request['n']}")
            for sample in samples:
                ids = sample.get("token_ids") if isinstance(sample, dict) else None
                lps = sample.get("logprobs") if isinstance(sample, dict) else None
                if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t < self.vocab_size for t in ids):
                    raise bad(f"token ids outside the vocabulary [0, {self.vocab_size}) in request {i}")
                if len(ids) > request["max_tokens"]:
                    raise bad(f"{len(ids)} tokens in request {i}, which allowed {request['max_tokens']}")
                if not isinstance(lps, list) or len(lps) != len(ids):
                    raise bad(f"log-probs that are not one per token in request {i}")
                if not all(lp is None or (isinstance(lp, (int, float)) and not isinstance(lp, bool)) for lp in lps):
                    raise bad(f"log-probs that are neither numbers nor null in request {i}")
                tokens.append(ids)
                logps.append([math.nan if lp is None else float(lp) for lp in lps])
        return tokens, logps


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
