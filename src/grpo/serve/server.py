"""`grpo vllm-serve`: a generation server hosting vLLM's engine in its own process, with grpo's own routes and checks.

    grpo vllm-serve --model Qwen/Qwen2.5-0.5B-Instruct --port 8000             # 127.0.0.1, no key needed
    GRPO_VLLM_API_KEY=... grpo vllm-serve --model ./ckpt --host 0.0.0.0       # another address: a key is required

vLLM's own server is not used: its weight-update routes are unauthenticated and its weight transfer needs
NCCL/CUDA. Here weights travel as one safetensors body over HTTP and load through vLLM's in-place reload
(`grpo.rollout.vllm_reload.load_weights`, as the colocate engine's `sync_weights` does).

Protocol (JSON bodies unless said; with a key, `Authorization: Bearer <key>` on every route but /health):
- `GET /health` -> `{"status": "ok", "model", "dtype", "max_model_len", "vocab_size", "weight_version", "run"}`
  (never needs the key).
- `GET /weight_version` -> `{"weight_version": int, "run": str | null}`.
- `POST /generate` `{"requests": [{"prompt_ids": [int, ...], "n": int = 1, "max_tokens": int}, ...],
  "sampling": {SamplingParams keywords, as grpo.rollout.vllm.sampling_kwargs returns them}, "weight_version": int
  | null, "run": str | null}` -> `{"weight_version": int, "outputs": [[{"token_ids": [...], "logprobs": [...]},
  ... n], ... requests]}`. Log-probs are vLLM's processed ones of the sampled tokens, null where vLLM had none. A
  given `weight_version` (or `run`) that is not the server's -> 409 naming the run whose weights it holds: a stale
  server, or one another run has pushed to since, is never sampled from silently. The server sets `n`,
  `logprobs=0`, `detokenize=False`, `output_kind` and `prompt_logprobs` itself (`logprobs` and `detokenize` may be
  sent with those values); `max_tokens` is capped to what the context leaves after the prompt.
- `POST /update_weights`, body: raw safetensors bytes (`application/octet-stream`), header `X-Run: <the pushing
  run's name>` -> `{"weight_version": int, "run": str}`. Versions belong to the server: each accepted push gets the
  next number (1, 2, ...), whoever sends it, so two runs on one server never share a version. The tensors must be
  exactly the checkpoint's (names and shapes, read from the model directory at start) and finite; they are checked
  before anything is loaded, so a refused update leaves the old weights and version. A load that fails midway
  leaves the weights unknown: the version becomes -1.
- Errors: `{"error": str}` with 400 (bad input), 401 (key), 403 (a web page's request, or a keyless server
  addressed by a non-loopback Host: `grpo.serve.server_http`), 404 (route), 405 (method), 409 (version), 411 (no
  Content-Length), 413 (body over `--max-request-bytes` for /generate, over the model's float32 size + 10% for
  /update_weights; refused before the body is read), 415 (Content-Type), 500 (anything unexpected). No request
  stops the server.

Security defaults: binds 127.0.0.1; binding any other (non-loopback) address needs an API key (`--api-key` or
GRPO_VLLM_API_KEY), else the command refuses to start (exit status 2); with a key every route but /health checks it
(`hmac.compare_digest`), on loopback too; without one only loopback Host names are answered (DNS rebinding), and
requests from web pages (an Origin header) never are, unless `--allowed-hosts` names them. Engine calls are
serialized by one lock; the threaded HTTP server keeps /health answering during a generation.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import math
import os
import sys
import tempfile
import threading
from typing import Any, TypeGuard

import torch

from grpo.models import vision
from grpo.rollout.vllm import in_process_environment, samples, sampling_params
from grpo.rollout.vllm_reload import load_weights, quiet_expected_reload_warnings
from grpo.serve.server_http import Access, AppServer, Handler, RequestError, is_loopback

logger = logging.getLogger("grpo")

KEY_ENV = "GRPO_VLLM_API_KEY"
# SamplingParams fields the server sets itself, with the values a client may still send (sampling_kwargs sends them)
_SERVER_SET = {"n": None, "logprobs": 0, "detokenize": False, "output_kind": None, "prompt_logprobs": None}
_MAX_RUN_NAME = 200


def build_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The flags of `grpo vllm-serve` (TRL's `trl vllm-serve` names where TRL has the setting)."""
    p = argparse.ArgumentParser(
        prog="grpo vllm-serve", add_help=add_help, description="Serve generation from vLLM for grpo's trainer."
    )
    p.add_argument("--model", required=True, help="model directory (or hub id) with its tokenizer")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (not loopback: needs an API key)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="shards of the model, each in a process of its own"
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV-cache size on a CPU (GiB)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / compilation (always on CPUs)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--api-key", default=None, help=f"required bearer key (default: ${KEY_ENV})")
    p.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated Host names (and page origins) answered besides loopback ones; '*': any",
    )
    p.add_argument("--max-request-bytes", type=int, default=16 * 2**20, help="largest /generate body")
    p.add_argument(
        "--max-sequences", type=int, default=4096, help="most completions (sum of n) one /generate may ask for"
    )
    p.add_argument("--seed", type=int, default=0)
    return p


def startup_refusal(args: argparse.Namespace, key: str | None) -> str | None:
    """Why the server must not start with these flags (None when it may), decided before vLLM is imported."""
    if not is_loopback(args.host) and not key:
        return (
            f"grpo vllm-serve: refusing to bind {args.host} without an API key: anyone who can reach it could "
            f"replace the model's weights. Pass --api-key KEY or set the environment variable {KEY_ENV} (clients "
            "then send 'Authorization: Bearer KEY'), or bind 127.0.0.1 (the default)."
        )
    if args.tensor_parallel_size < 1:
        return "grpo vllm-serve: --tensor-parallel-size must be at least 1 (the number of shards of the model)."
    if args.max_request_bytes < 1:
        return "grpo vllm-serve: --max-request-bytes must be positive."
    return None


def serve(args: argparse.Namespace) -> int:
    """Start the engine and serve until interrupted; returns the exit status (2: refused flags)."""
    key = args.api_key or os.environ.get(KEY_ENV) or None
    refusal = startup_refusal(args, key)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    httpd = AppServer((args.host, args.port), Handler)  # bound now: a busy port fails before the load
    httpd.daemon_threads = True
    httpd.access = Access(args.allowed_hosts, keyed=key is not None)
    httpd.app = Server(args, key)
    print(f"grpo vllm-serve: serving {args.model} on http://{args.host}:{httpd.server_address[1]}", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
    return 0


class Server:
    """The engine, its weight version and the checks of every route (HTTP-free: `Handler` adapts it)."""

    def __init__(self, args: argparse.Namespace, key: str | None) -> None:
        self.key = key.encode() if key else None
        self.model = args.model
        self.max_request_bytes = args.max_request_bytes
        self.lock = threading.Lock()
        self.weight_version = 0  # the server's own numbering: every accepted push gets the next number
        self.pushes = 0
        self.run: str | None = None  # the run whose push the weights are (None: the checkpoint's own)
        self.llm = _start_engine(args)
        self.parallel = args.tensor_parallel_size
        config = self.llm.llm_engine.vllm_config.model_config
        self.dtype = config.dtype
        self.max_model_len = config.max_model_len
        self.vocab_size = config.get_vocab_size()
        self.max_sequences = args.max_sequences
        self.tied = bool(getattr(config.hf_config, "tie_word_embeddings", False))
        self.shapes = checkpoint_shapes(_checkpoint_dir(args.model))
        numel = sum(math.prod(shape) for shape in self.shapes.values())
        self.max_weight_bytes = int(numel * 4 * 1.1) + 2**20  # float32 + 10%, and room for the header

    def health(self) -> dict:
        dtype = str(self.dtype).removeprefix("torch.")
        return dict(
            status="ok",
            model=self.model,
            dtype=dtype,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            **self.version_info(),
        )

    def version_info(self) -> dict:
        return {"weight_version": self.weight_version, "run": self.run}

    def authorized(self, header: str | None) -> bool:
        if self.key is None:
            return True
        scheme, _, given = (header or "").partition(" ")
        return scheme == "Bearer" and hmac.compare_digest(given.strip().encode(), self.key)

    def body_limit(self, path: str) -> int:
        return self.max_weight_bytes if path == "/update_weights" else self.max_request_bytes

    def generate(self, body: bytes) -> dict:
        payload = _json(body)
        if not isinstance(payload, dict):
            raise RequestError(400, "the body must be a JSON object with 'requests'")
        unknown = set(payload) - {"requests", "sampling", "weight_version", "run"}
        if unknown:
            raise RequestError(400, f"unknown fields {sorted(unknown)}: expected requests, sampling, weight_version")
        version, run = payload.get("weight_version"), payload.get("run")
        if version is not None and not _is_int(version):
            raise RequestError(400, "weight_version must be an integer or null")
        if run is not None and not isinstance(run, str):
            raise RequestError(400, "run must be a string or null")
        sampling = self._sampling(payload.get("sampling", {}))
        requests = payload.get("requests")
        if not isinstance(requests, list) or not requests:
            raise RequestError(400, "'requests' must be a non-empty list")
        inputs, params, sequences = [], [], 0
        for i, request in enumerate(requests):
            prompt, n, max_tokens = self._request(i, request, sampling)
            sequences += n
            if sequences > self.max_sequences:
                raise RequestError(
                    413, f"the request asks for more than --max-sequences={self.max_sequences} completions"
                )
            inputs.append(self._input(i, request, prompt))
            params.append(_params(sampling, n, max_tokens, i))
        with self.lock:
            self._check_version(version, run)
            outputs = self.llm.generate(inputs, params, use_tqdm=False)
            served = self.weight_version
        answer = {"weight_version": served, "outputs": [_samples(output) for output in outputs]}
        if any("multi_modal_data" in x for x in inputs):  # the image prompts as vLLM expanded them, to check
            answer["prompt_ids"] = [
                list(out.prompt_token_ids) if "multi_modal_data" in x else None for x, out in zip(inputs, outputs)
            ]
        return answer

    def _check_version(self, version: int | None, run: str | None) -> None:
        """A request for weights the server does not hold is refused (409): never sampled from silently."""
        if version is None or (version == self.weight_version and run in (None, self.run)):
            return
        holder = f"pushed by run {self.run!r}" if self.run else "the checkpoint's own"
        asker = f" (run {run!r})" if run else ""
        other = " Another run pushed its weights since: one server serves one run at a time." if self.run != run else ""
        raise RequestError(
            409,
            f"the server holds weight version {self.weight_version} ({holder}), the request{asker} asks for "
            f"version {version}.{other}",
        )

    @staticmethod
    def _input(i: int, request: dict, prompt: list[int]) -> dict:
        """vLLM's input: the token ids, and an image prompt's images (base64 PNG, `grpo.models.vision.encode_image`)."""
        images = request.get("images")
        if images is None:
            return {"prompt_token_ids": prompt}
        if not isinstance(images, list) or not images:
            raise RequestError(400, f"requests[{i}].images must be a non-empty list of base64-encoded images")
        try:
            decoded = [vision.decode_image(image, f"requests[{i}].images[{j}]") for j, image in enumerate(images)]
        except ValueError as err:
            raise RequestError(400, str(err)) from None
        return {"prompt_token_ids": prompt, "multi_modal_data": {"image": decoded}}

    def _sampling(self, sampling: Any) -> dict:
        from vllm import SamplingParams

        if not isinstance(sampling, dict):
            raise RequestError(400, "'sampling' must be an object of SamplingParams keywords")
        known = {name for name in SamplingParams.__struct_fields__ if not name.startswith("_")}
        for name, value in sampling.items():
            if name in _SERVER_SET:
                if value != _SERVER_SET[name] or type(value) is not type(_SERVER_SET[name]):
                    raise RequestError(400, f"sampling sets {name!r}, which the server sets itself")
            elif name not in known:
                raise RequestError(400, f"sampling has {name!r}, which is not a parameter of vLLM's SamplingParams")
        out = {k: v for k, v in sampling.items() if k not in _SERVER_SET}
        if "logit_bias" in out:  # JSON object keys are strings: vLLM wants token ids
            bias = out["logit_bias"]
            try:
                out["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
            except (AttributeError, TypeError, ValueError):
                raise RequestError(400, "sampling's logit_bias must map token ids to numbers") from None
        return out

    def _request(self, i: int, request: Any, sampling: dict) -> tuple[list[int], int, int]:
        if not isinstance(request, dict) or set(request) - {"prompt_ids", "n", "max_tokens", "images"}:
            raise RequestError(400, f"requests[{i}] must be an object with prompt_ids, n, max_tokens (and images)")
        prompt = request.get("prompt_ids")
        if not isinstance(prompt, list) or not prompt or not all(_is_int(t) for t in prompt):
            raise RequestError(400, f"requests[{i}].prompt_ids must be a non-empty list of integers")
        if not all(0 <= t < self.vocab_size for t in prompt):
            raise RequestError(400, f"requests[{i}].prompt_ids has ids outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise RequestError(400, f"requests[{i}]: {len(prompt)} prompt tokens, max_model_len={self.max_model_len}")
        n = request.get("n", 1)
        max_tokens = request.get("max_tokens", sampling.get("max_tokens"))
        if not _is_int(n) or n < 1:
            raise RequestError(400, f"requests[{i}].n must be an integer >= 1")
        if not _is_int(max_tokens) or max_tokens < 1:
            raise RequestError(400, f"requests[{i}].max_tokens must be an integer >= 1")
        return prompt, n, min(max_tokens, self.max_model_len - len(prompt))

    def update_weights(self, body: bytes, headers: Any) -> dict:
        """Load a push; the server numbers it (the next of its own versions) and records the run it names."""
        run = headers.get("X-Run")
        if not run or len(run) > _MAX_RUN_NAME or not run.isprintable():
            raise RequestError(
                400, f"a push must name its run: an X-Run header of 1-{_MAX_RUN_NAME} printable characters"
            )
        if headers.get("X-Weight-Version") is not None:
            raise RequestError(400, "the server numbers weight versions itself: send X-Run, not X-Weight-Version")
        weights = self._checked_weights(body)
        with self.lock:
            self.pushes += 1
            version = self.pushes
            self.weight_version, self.run = -1, run  # unknown weights until the load completes
            if self.parallel > 1:  # the shards' processes read the checked body from a private file
                with tempfile.TemporaryDirectory(prefix="grpo-weights-") as directory:
                    path = os.path.join(directory, "model.safetensors")
                    with open(path, "wb") as f:
                        f.write(body)
                    load_weights(self.llm, path, self.dtype, self.tied)
            else:
                load_weights(self.llm, weights.items(), self.dtype, self.tied)
            self.weight_version = version
        return {"weight_version": version, "run": run}

    def _checked_weights(self, body: bytes) -> dict:
        from safetensors.torch import load

        if not self.shapes:
            raise RequestError(400, f"{self.model} has no safetensors checkpoint to check updates against")
        try:
            weights = load(body)
        except Exception as err:
            raise RequestError(400, f"the body is not a safetensors file: {err}") from None
        if self.tied and "lm_head.weight" in weights and "lm_head.weight" not in self.shapes:
            weights.pop("lm_head.weight")  # the tied head is the embedding's: vLLM ignores it
        unknown = sorted(set(weights) - set(self.shapes))
        missing = sorted(set(self.shapes) - set(weights))
        if unknown or missing:
            raise RequestError(400, f"not the checkpoint's tensors: unknown {unknown[:5]}, missing {missing[:5]}")
        for name, tensor in weights.items():
            if tuple(tensor.shape) != self.shapes[name]:
                expected = list(self.shapes[name])
                raise RequestError(400, f"{name} has shape {list(tensor.shape)}, the model's is {expected}")
            if not tensor.is_floating_point():
                raise RequestError(400, f"{name} is {tensor.dtype}, not a floating-point tensor")
            if not bool(torch.isfinite(tensor).all()):
                raise RequestError(400, f"{name} has NaN or infinite values: a diverged policy is not loaded")
        return weights


def _start_engine(args: argparse.Namespace) -> Any:
    # vLLM's own thread binding stays (the process is its own), but for shards: one share of the CPUs each
    reason = in_process_environment(colocate=False, parallel=args.tensor_parallel_size)
    if reason is not None:
        raise SystemExit(f"grpo vllm-serve: {reason}")
    import vllm
    from vllm.platforms import current_platform

    cpu = current_platform.is_cpu()
    kwargs = dict(
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        logprobs_mode="processed_logprobs",
        seed=args.seed,
        trust_remote_code=args.trust_remote_code,
        enforce_eager=args.enforce_eager or cpu,  # on CPUs torch.compile costs minutes at start-up
    )
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    if cpu:
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
        kwargs["max_num_batched_tokens"] = max(4096, args.max_model_len or 0)
    quiet_expected_reload_warnings()
    return vllm.LLM(model=args.model, load_format="auto", **kwargs)


def _checkpoint_dir(model: str) -> str | None:
    """The local directory of the model's safetensors (a hub id: vLLM's download in the cache), None if none."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, allow_patterns=["*.safetensors", "*.json"])
    except Exception as err:
        logger.warning("No local checkpoint for %s (%s): /update_weights will refuse updates.", model, err)
        return None


def checkpoint_shapes(directory: str | None) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of the checkpoint's safetensors files, read from their headers (no tensor is loaded)."""
    from safetensors import safe_open

    if directory is None:
        return {}
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    shapes = {}
    for file in files:
        with safe_open(os.path.join(directory, file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _params(sampling: dict, n: int, max_tokens: int, i: int) -> Any:
    params = {**sampling, "logprobs": 0, "detokenize": False}
    try:
        if params.get("structured_outputs") is not None and not isinstance(params["structured_outputs"], dict):
            raise TypeError("structured_outputs must be an object such as {'regex': ...}")
        return sampling_params(params, n, max_tokens)
    except (ValueError, TypeError) as err:
        raise RequestError(400, f"requests[{i}]: invalid sampling parameters: {err}") from None


def _samples(output: Any) -> list[dict]:
    """The output's samples as JSON: NaN log-probs (tokens vLLM did not score) as null."""
    return [
        {"token_ids": ids, "logprobs": [None if math.isnan(lp) else lp for lp in logps]}
        for ids, logps in samples(output)
    ]


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _json(body: bytes) -> Any:
    def no_constants(name: str):
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(body, parse_constant=no_constants)
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(400, f"the body is not valid JSON: {err}") from None
