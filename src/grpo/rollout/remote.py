"""`ServerEngine`: generation on a `grpo vllm-serve` server (`use_vllm=True`, `vllm_mode="server"`), over HTTP.

The server (`grpo.server`) hosts vLLM in its own process; this client never imports vLLM. Protocol: JSON
`POST /generate`, raw safetensors `POST /update_weights` with an `X-Weight-Version` header, `GET /health` and
`GET /weight_version`; every route but /health carries `Authorization: Bearer <key>` when a key is set
(`vllm_server_api_key`, or the environment variable GRPO_VLLM_API_KEY).

- **Weights.** Before the first generation after an optimizer step every process takes part in gathering the
  policy's weights (`grpo.rollout.weights`: sharded models gather collectively, LoRA sends base + delta); the main
  process sends them, in the server's dtype, as one safetensors body with the next weight version, and checks the
  version the server reports back; the other processes wait until the server reports that version. Every
  generation names the version it expects: a server that has another one answers 409, an error here, so a stale
  server is never sampled from.
- **Liveness.** A generation may take long; a dead server must not hang the run. While a request is in flight the
  client polls `/health`; a server that has not answered it for `vllm_server_timeout` seconds is an error that
  names the URL and says how to resume. At start the client waits up to `vllm_server_timeout` for the server.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import torch
from safetensors.torch import save

from grpo import preemption
from grpo.rollout.base import Request, Rollout, assemble, expand
from grpo.rollout.vllm import check_expanded, multimodal_input
from grpo.rollout.weights import checkpoint_weights
from grpo.vision import encode_image

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
        self.version: int | None = None  # the weight version this run last pushed (None: none yet)

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
            preemption.check()
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

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Every process calls it (gathering a sharded policy is collective); the main process pushes."""
        version = (self.version if self.version is not None else int(self.info.get("weight_version", 0))) + 1
        dtype = getattr(torch, self.info.get("dtype", "float32"))
        main = self.accelerator.is_main_process
        with checkpoint_weights(model) as weights:
            tensors = {name: t.to("cpu", dtype).contiguous() for name, t in weights} if main else {}
        if main:
            body = save(tensors)
            headers = {"Content-Type": "application/octet-stream", "X-Weight-Version": str(version)}
            answer = self._while_alive("/update_weights", body, headers)
            if answer.get("weight_version") != version:
                raise ServerError(
                    f"The vLLM server at {self.url} reports weight version {answer.get('weight_version')} after "
                    f"the push of version {version}: its weights are not the policy's."
                )
        self.version = version
        self.accelerator.wait_for_everyone()
        if not main:
            self._wait_for_version(version)

    def _wait_for_version(self, version: int) -> None:
        deadline = time.monotonic() + self.timeout
        while self._request("/weight_version", timeout=self.timeout).get("weight_version") != version:
            if time.monotonic() > deadline:
                raise ServerError(f"The vLLM server at {self.url} did not reach weight version {version}.")
            time.sleep(0.05)

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
        preemption.check()
        if not requests:  # a follow-up turn of a tool loop where this process has no row left
            return Rollout([], [], [], [])
        payload = {
            "requests": [self._request_of(r) for r in requests],
            "sampling": self.sampling,
            "weight_version": self.version,
        }
        answer = self._while_alive("/generate", json.dumps(payload).encode(), {"Content-Type": "application/json"})
        for request, expanded in zip(requests, answer.get("prompt_ids") or [None] * len(requests)):
            check_expanded(request.prompt, expanded)
        tokens, logps = [], []
        for samples in answer["outputs"]:
            for sample in samples:
                tokens.append(list(sample["token_ids"]))
                logps.append([math.nan if lp is None else float(lp) for lp in sample["logprobs"]])
        return assemble(expand(requests), tokens, logps, self.stop_ids, self.tokenizer)
