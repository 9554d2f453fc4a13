"""`ServerEngine`: generation on vLLM servers (`use_vllm=True`, `vllm_mode="server"`): vLLM's own OpenAI server in
dev mode, as TRL 1.16 uses it (`grpo vllm-serve` starts one with the flags the trainer needs), one or several
(`vllm_server_base_url` may list several: "http://a:8000,http://b:8000", or a list).

- **Generation** goes through `/v1/completions` with token-id prompts, `n` samples per prompt, the sampled tokens'
  ids and processed log-probs (image prompts: vLLM's token-in route, `grpo.rollout.server_vision`). Each process sends
  its own rows, spread over the servers (request i of process p to server (p + i) mod S), up to 64 requests in flight
  at once (vLLM batches them). Sampling means what it means in-process (the same `sampling_kwargs`); each request
  carries a seed drawn from (seed, process, generation, request), so a run's samples depend on the weights it
  pushed and not on the server's other traffic.
- **Replies are checked** before anything is trained on them: `n` choices, the prompt echoed back as sent, token
  ids in the policy's vocabulary, at most `max_tokens` of them, one finite log-prob per token (null: a token vLLM
  did not score, NaN as in colocate mode). A reply that is not so is an error naming the server.
- **Weights** reach every server through vLLM's weight-transfer engine, never in an HTTP body: grpo's `gloo` engine
  on CPUs (`grpo.serve.vllm_plugin`), vLLM's packed NCCL engine on GPUs. The main process connects to each server
  at its first push (the first free port from `vllm_group_port` + the server's index); at each sync every process
  takes part in gathering the policy (sharded policies gather collectively, LoRA sends base + adapter delta:
  `grpo.rollout.weights`), and only then does the main process send, so sending never interleaves with another
  collective; the others wait for the new version's name.
- **Weight versions** are vLLM's (`/weight_info`), named by the run: "<run> #<push>" once a push has loaded,
  "... (loading)" while one does. Before and after each generation every server used is asked for its version: a
  server that holds another one (a stale server, another run's push, a push that failed midway) is an error naming
  what it holds, and nothing sampled there is used. The other processes learn the version from the main one.
- **Failures.** Every request waits as long as the server answers `/health` and no longer than
  `vllm_server_timeout` after it stops (`grpo.rollout.server_client`); a push is bounded by the same timeout. An
  error names the server; the checkpoints are intact, and `train(resume_from_checkpoint=True)` continues once the
  servers are back.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import secrets
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import torch
from accelerate.utils import broadcast_object_list

from grpo.algo.sampling import SamplingSettings
from grpo.base import sigterm
from grpo.base.records import Request, Rollout, expand
from grpo.config import ResolvedConfig
from grpo.models.vision import SUPPRESSED
from grpo.rollout import server_vision
from grpo.rollout.base import assemble
from grpo.rollout.server_client import ServerClient, ServerError
from grpo.rollout.vllm import sampling_kwargs
from grpo.rollout.weights import checkpoint_weights
from grpo.serve import vllm_plugin
from grpo.serve.gloo import free_port, local_address

logger = logging.getLogger("grpo")
API_KEY_ENV = "GRPO_VLLM_API_KEY"
__all__ = ["API_KEY_ENV", "ServerEngine", "ServerError", "ServerSettings", "server_urls"]
_SEED_SPACE = 2**31
_CONCURRENCY = 64  # requests in flight at once per process (vLLM batches them)


def server_urls(given: str | Sequence[str] | None, host: str, port: int) -> list[str]:
    """The servers' URLs: vllm_server_base_url (`given`: one URL, several separated by commas, or a list), else
    http://vllm_server_host:vllm_server_port."""
    if not given:
        return [f"http://{host}:{port}"]
    urls = given.split(",") if isinstance(given, str) else list(given)
    urls = [str(url).strip().rstrip("/") for url in urls if str(url).strip()]
    if not urls or len(set(urls)) != len(urls):
        raise ValueError(f"vllm_server_base_url={given!r}: give one URL per server, each once")
    return urls


@dataclass(frozen=True)
class ServerSettings:
    """What the server engine reads of the config besides sampling: the servers (`server_urls`), how long to wait
    for them (vllm_server_timeout), their key (vllm_server_api_key, else GRPO_VLLM_API_KEY), the first port of the
    weight transfer (vllm_group_port) and the run's name in the weight versions it pushes (run_name, else the
    output directory's name)."""

    urls: tuple[str, ...]
    timeout: float = 240.0
    api_key: str | None = field(default=None, repr=False)
    group_port: int = 51216
    run_name: str = "grpo"

    @classmethod
    def of(cls, config: ResolvedConfig) -> ServerSettings:
        return cls(
            urls=tuple(server_urls(config.vllm_server_base_url, config.vllm_server_host, config.vllm_server_port)),
            timeout=float(config.vllm_server_timeout),
            api_key=config.vllm_server_api_key or os.environ.get(API_KEY_ENV),
            group_port=int(config.vllm_group_port),
            run_name=config.run_name or os.path.basename(str(config.output_dir).rstrip("/\\")) or "grpo",
        )


class ServerEngine:
    """Samples on vLLM servers (see the module docstring); `suppressed`: tokens never sampled (a vision-language
    model's image placeholders)."""

    name = "vllm-server"
    samples_elsewhere = True

    def __init__(
        self,
        tokenizer: Any,
        sampling: SamplingSettings,
        settings: ServerSettings,
        stop_ids: list[int],
        accelerator: Any,
        model_config: Any,
        vocab_size: int,
        suppressed: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.accelerator = accelerator
        params = sampling_kwargs(sampling, stop_ids, validate=False)  # checked as a completions request below
        if suppressed:  # never sample an image placeholder (as the training pass scores it)
            params["logit_bias"] = dict.fromkeys(suppressed, SUPPRESSED)
        self.sampling = {k: v for k, v in params.items() if k not in ("max_tokens", "logprobs", "detokenize")}
        _check_generation_kwargs(sampling.generation_kwargs)
        self.max_tokens = sampling.max_completion_length
        self.vocab_size = vocab_size
        self.seed, self.calls = int(sampling.seed), 0
        self.servers = [ServerClient(url, settings.timeout, settings.api_key) for url in settings.urls]
        self.facts = [server.describe(tokenizer) for server in self.servers]
        self.version: str | None = None  # the weight version every server holds (None: none pushed yet)
        self.pushes = 0
        label = settings.run_name[:100]
        run = f"{label} ({socket.gethostname()[:60]} pid {os.getpid()})"
        self.run = "".join(c if c.isprintable() else "?" for c in run)
        self.group_port = settings.group_port
        self.model_facts = vllm_plugin.model_facts(model_config)
        # the main process's trainer-side engine and source per server, connected at its first push
        self.transfers: list[tuple[Any, Any] | None] = [None] * len(self.servers)

    @property
    def info(self) -> dict:
        """The first server's facts (`dtype`, `max_model_len`, `model`, `backend`, `world_size`)."""
        return self.facts[0]

    def _connect(self, index: int) -> tuple[Any, Any]:
        """The main process's trainer-side engine (and its source) for server `index`
        (`vllm_plugin.trainer_engine`), on the first free port from vllm_group_port + index."""
        server, facts = self.servers[index], self.facts[index]
        backend = facts["backend"]
        if backend == "nccl" and not torch.cuda.is_available():
            raise ServerError(
                f"The vLLM server at {server.url} takes weights through vLLM's NCCL engine, which needs a CUDA "
                """device on the trainer's side. On CPUs start it with --weight-transfer-config '{"backend": """
                '"gloo"}\' (grpo vllm-serve picks the backend by device).'
            )
        if backend not in ("gloo", "nccl"):
            raise ServerError(
                f"The vLLM server at {server.url} uses the {backend!r} weight-transfer engine; grpo pushes through "
                """'gloo' (CPUs) or 'nccl' (GPUs): start it with --weight-transfer-config '{"backend": "gloo"}' """
                "(or run grpo vllm-serve, which picks it)."
            )
        host = urlsplit(server.url).hostname or "127.0.0.1"
        wanted = self.group_port + index
        try:
            port = free_port(wanted)
            if port != wanted:
                logger.warning(
                    "vllm_group_port + %d = %d is in use on this machine: the weight transfer to %s listens on %d.",
                    index,
                    wanted,
                    server.url,
                    port,
                )
            server.set_version(f"{self.run} #0 (connecting)")
            return vllm_plugin.trainer_engine(
                backend,
                server,
                master_address=local_address(host),
                master_port=port,
                world_size=facts["world_size"] + 1,
                session=secrets.token_hex(8),
                run=self.run,
                timeout_s=server.timeout,
                model=self.model_facts,
                peer=host,
            )
        except ServerError:
            raise
        except Exception as err:  # the rendezvous (a timeout) or the server's refusal
            raise ServerError(
                f"Connecting the weight transfer to the vLLM server at {server.url} failed (group port from "
                f"vllm_group_port + {index} = {wanted}): {type(err).__name__}: {err}"
            ) from err

    # ---- weights ------------------------------------------------------------------------------------------------

    def sync_weights(self, model: torch.nn.Module, group: Any = None) -> None:
        """Every process calls it (gathering a sharded policy is collective); the main process pushes to every
        server and hands the new version's name to the others, over `group` when given (an async producer's own
        group: the default one is the learner's)."""
        self.pushes += 1
        version = f"{self.run} #{self.pushes}"
        failure = None
        with checkpoint_weights(model) as weights:
            if self.accelerator.is_main_process:
                pairs = list(weights)  # gathered now by every process; sent once the gathering is done
                try:
                    self._push(pairs, version)
                except BaseException as err:
                    failure = err
        shared: list[Any] = [version, None if failure is None else str(failure)]
        if group is not None:
            torch.distributed.broadcast_object_list(shared, src=0, group=group)
        elif self.accelerator.num_processes > 1:
            shared = broadcast_object_list(shared, from_process=0)
        if failure is not None:
            raise failure
        if shared[1] is not None:
            raise ServerError(f"The main process's weight push failed: {shared[1]}")
        self.version = shared[0]

    def _push(self, pairs: list[tuple[str, torch.Tensor]], version: str) -> None:
        """The main process: every server gets the weights (at once), named `version` once they are loaded."""
        connected = [i for i, transfer in enumerate(self.transfers) if transfer is None]
        for index in connected:  # one by one: each takes the first free group port
            self.transfers[index] = self._connect(index)
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(self.servers)) as pool:
            pushes = [
                pool.submit(self._push_one, index, pairs, version, index not in connected)
                for index in range(len(self.servers))
            ]
            for push in pushes:
                push.result()

    def _push_one(self, index: int, pairs: list, version: str, check: bool) -> None:
        """Push to server `index` (connected; `check`: it must still hold this run's last version)."""
        server, facts = self.servers[index], self.facts[index]
        device = getattr(self.accelerator, "device", None)
        if device is not None and torch.device(device).type == "cuda":  # this thread's CUDA device: the policy's
            torch.cuda.set_device(device)
        if check:
            self._expect(server, self.version or "", "before pushing")
        transfer = self.transfers[index]
        assert transfer is not None  # connected by `_push`
        engine, source = transfer
        source.fill(pairs, getattr(torch, facts["dtype"]))
        server.set_version(f"{version} (loading)")
        try:
            engine.send_weights()
        except BaseException as err:
            self.transfers[index] = None  # the group is gone: a later push connects again
            engine.shutdown()
            if isinstance(err, ServerError) or not isinstance(err, Exception):
                raise
            raise ServerError(
                f"Pushing the weights to the vLLM server at {server.url} failed: {type(err).__name__}: {err}. The "
                "checkpoints in output_dir are intact: restart the server and continue with "
                "trainer.train(resume_from_checkpoint=True)."
            ) from err
        finally:
            source.fill([], source.dtype)
        server.set_version(version)
        server.reset_caches()

    def _expect(self, server: ServerClient, version: str, when: str) -> None:
        """The server holds `version`, or this is an error naming what it holds (never sampled from)."""
        held = server.version()
        if held != version:
            raise ServerError(
                f"The vLLM server at {server.url} holds weight version {held!r} {when}, where this run expects "
                f"{version!r}: another run has pushed to it (or connected to it) since, or a push failed midway. "
                "One server serves one run at a time; nothing it sampled is used."
            )

    # ---- generation ---------------------------------------------------------------------------------------------

    def generate(self, requests: Sequence[Request]) -> Rollout:
        sigterm.check()
        if not requests:  # a follow-up turn of a tool loop where this process has no row left
            return Rollout([], [], [], [])
        self.calls += 1
        # request i of process p on server (p + i) mod S
        placed = [(self.accelerator.process_index + i) % len(self.servers) for i in range(len(requests))]
        used = sorted(set(placed))
        if self.version is not None:
            for server in used:
                self._expect(self.servers[server], self.version, "before a generation")
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(_CONCURRENCY, len(requests))) as pool:
            answers = list(pool.map(self._complete, range(len(requests)), requests, placed))
        if self.version is not None:
            for server in used:
                self._expect(self.servers[server], self.version, "after a generation")
        tokens = [ids for samples in answers for ids, _ in samples]
        logps = [lps for samples in answers for _, lps in samples]
        return assemble(expand(requests), tokens, logps, self.stop_ids, self.tokenizer)

    def _complete(self, index: int, request: Request, server_index: int) -> list[tuple[list[int], list[float]]]:
        """The request's `num_samples` samples, checked (`_checked`). Each request is a call of its own, with its
        own seed (one call's prompts share its seed, so equal prompts in it would be sampled alike)."""
        server, facts = self.servers[server_index], self.facts[server_index]
        prompt, n = list(request.prompt.ids), request.num_samples
        max_tokens = min(request.max_tokens or self.max_tokens, facts["max_model_len"] - len(prompt))
        if max_tokens < 1:
            raise ServerError(
                f"A prompt of {len(prompt)} tokens leaves no room for a completion in the context of the vLLM server "
                f"at {server.url} (max_model_len {facts['max_model_len']}): shorten it (max_prompt_length) or start "
                "the server with a larger --max-model-len."
            )
        seed = hash((self.seed, self.accelerator.process_index, self.calls, index)) % _SEED_SPACE
        params = self._params(n, max_tokens, seed)
        if request.prompt.images:
            choices = server_vision.generate(server, facts["model"], request.prompt, self.tokenizer, params)
            return self._checked(server, choices, prompt, n, max_tokens, "/inference/v1/generate")
        payload = {"model": facts["model"], "prompt": prompt, **params}
        payload.update(return_token_ids=True, return_tokens_as_token_ids=True)
        answer = server.while_alive("POST", "/v1/completions", payload, progress=True)
        choices = answer.get("choices") if isinstance(answer, dict) else None
        return self._checked(server, choices, prompt, n, max_tokens, "/v1/completions")

    def _params(self, n: int, max_tokens: int, seed: int) -> dict:
        return {**self.sampling, "seed": seed, "n": n, "max_tokens": max_tokens, "logprobs": 0}

    def _checked(
        self, server: ServerClient, choices: Any, prompt: list[int], n: int, max_tokens: int, route: str
    ) -> list[tuple[list[int], list[float]]]:
        """The choices' (token ids, log-probs), `n` of them in order, once they are what was asked for (else a
        ServerError naming the server: nothing of the reply is used)."""

        def bad(what: str) -> ServerError:
            return ServerError(
                f"The vLLM server at {server.url} answered {route} with {what}; nothing of it is used. Is it a "
                "server of the policy's model (same tokenizer and vocabulary)?"
            )

        if not isinstance(choices, list) or len(choices) != n:
            raise bad(f"{len(choices) if isinstance(choices, list) else 'no list of'} choices for {n} samples")
        out = []
        for position, choice in enumerate(sorted(choices, key=_index)):
            if not isinstance(choice, dict) or _index(choice) != position:
                raise bad(f"choices numbered other than 0..{len(choices) - 1}")
            if choice.get("prompt_token_ids") not in (None, prompt):
                raise bad(f"another prompt than was sent for choice {position}")
            ids = choice.get("token_ids")
            if not isinstance(ids, list) or not all(_is_token(t, self.vocab_size) for t in ids):
                raise bad(f"token ids outside the policy's vocabulary [0, {self.vocab_size}) in choice {position}")
            if len(ids) > max_tokens:
                raise bad(f"{len(ids)} tokens in choice {position}, which allowed {max_tokens}")
            logps = _token_logprobs(choice.get("logprobs"))
            if logps is None or len(logps) != len(ids):
                raise bad(f"log-probs that are not one per token in choice {position}")
            wrong = next((lp for lp in logps if not (lp is None or _log_probability(lp))), None)
            if wrong is not None:
                raise bad(
                    f"a sampled token's log-prob of {repr(wrong)[:40]} in choice {position}, which no "
                    "log-probability is (a finite number at most 0)"
                )
            out.append((ids, [math.nan if lp is None else float(lp) for lp in logps]))
        return out


def _check_generation_kwargs(extra: Mapping[str, Any]) -> None:
    """generation_kwargs travel in each /v1/completions request: a key the route does not take would be dropped by
    the server with a log line, so it is an error here (as is one grpo sets itself)."""
    own = {"n", "logprobs", "max_tokens", "prompt", "model", "stream", "echo", "prompt_logprobs"}
    own |= {"return_token_ids", "return_tokens_as_token_ids", "stop_token_ids"}
    taken = sorted(set(extra) & own)
    if taken:
        raise ValueError(
            f"generation_kwargs sets {taken}, which grpo's server engine sets itself (one sample per row with its "
            "log-prob, stopping at EOS and the end of turn): remove it."
        )
    if not extra:
        return
    known = vllm_plugin.completion_fields()
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError(
            f"generation_kwargs has {unknown}, which vLLM's /v1/completions does not take (server mode samples on "
            f"a vLLM server). Its parameters: {', '.join(sorted(known))}."
        )


def _index(choice: Any) -> int:
    index = choice.get("index") if isinstance(choice, dict) else None
    return index if isinstance(index, int) and not isinstance(index, bool) else -1


def _token_logprobs(logprobs: Any) -> list | None:
    """The sampled tokens' log-probs of a choice: /v1/completions' `token_logprobs`, or the `content` entries'."""
    if not isinstance(logprobs, dict):
        return None
    if isinstance(logprobs.get("token_logprobs"), list):
        return logprobs["token_logprobs"]
    if isinstance(logprobs.get("content"), list):
        return [entry.get("logprob") if isinstance(entry, dict) else "?" for entry in logprobs["content"]]
    return None


def _is_token(value: Any, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def _log_probability(value: Any) -> bool:
    """Whether `value` can be a sampled token's log-prob: a finite number, at most 0 (+Infinity, -Infinity, NaN and
    positive numbers are impossible: a -Infinity would silently zero the sequence's importance weight)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value <= 0
