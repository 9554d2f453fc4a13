"""Loading the policy, its tokenizer and the frozen reference model; what a model can do (its forward's keywords,
checkpointing) and how to reach it inside wrappers; hardware questions (fast bfloat16?)."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    PreTrainedModel,
    ProcessorMixin,
)
from transformers.models.auto.auto_factory import _BaseAutoModelClass

from grpo.config import ResolvedConfig


class ModelLoadError(OSError):
    """A model or tokenizer could not be loaded; the message names the id and what to do."""


def model_name(model: Any) -> str:
    """The last path segment of a model id or directory (for default output directories)."""
    path = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return (os.path.basename(os.path.normpath(path)) if path else "") or type(model).__name__


def _resolve_dtype(kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(kwargs)
    dtype = kwargs.pop("torch_dtype", None) or kwargs.get("dtype") or "float32"
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    kwargs["dtype"] = dtype
    return kwargs


class ModelCodeError(ModelLoadError, ValueError):
    """The model's repository holds custom code and trust_remote_code is off (a ValueError, as transformers and TRL
    raise it; a ModelLoadError too)."""


def _load_error(kind: str, model_id: str, err: Exception) -> ModelLoadError:
    reason = str(err).splitlines()[0][:200].rstrip(".") if str(err) else type(err).__name__
    if isinstance(err, ValueError) and "custom code" in str(err):
        return ModelCodeError(
            f"Could not load the {kind} '{model_id}': it contains custom code, which runs only with "
            "trust_remote_code=True (GRPOConfig(trust_remote_code=True)); read that code first if you do not know it."
        )
    return ModelLoadError(
        f"Could not load the {kind} '{model_id}': {reason}. Pass the path of a local model "
        "directory, or a Hub id on a machine that can reach the Hub."
    )


def _missing_directory(model_id: str) -> str | None:
    """For an id that can only be a local path (it starts with '.', '/' or '~', has more than one '/', or its
    first segment is a local directory) and does not exist: what to say. None for ids that may be Hub ids."""
    if os.path.isdir(model_id):
        return None
    first = model_id.split("/")[0]
    if model_id.startswith((".", "/", "~")) or model_id.count("/") > 1 or (first != model_id and os.path.isdir(first)):
        return f"no such directory ({os.path.abspath(os.path.expanduser(model_id))}); check the path"
    return None


def _local_only(auto_class: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """from_pretrained keywords that keep the call off the network. transformers' auto model classes look for a PEFT
    adapter config with their own keywords (`adapter_kwargs`), which do not inherit local_files_only: without it
    a missing id costs ~23 s of retried requests offline."""
    local = dict(kwargs, local_files_only=True)
    if issubclass(auto_class, _BaseAutoModelClass):
        local["adapter_kwargs"] = dict(kwargs.get("adapter_kwargs") or {}, local_files_only=True)
    return local


def _hub_reachable(timeout: float = 3.0) -> bool:
    """One quick TCP connect to the Hub endpoint, so an offline machine fails in seconds rather than after the
    hub client's retries (half a minute of noisy logs)."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
        return True
    except OSError:
        return False


def load_causal_lm(
    model_id: str, init_kwargs: dict[str, Any] | None, trust_remote_code: bool, device: torch.device | None = None
) -> PreTrainedModel:
    """The model `model_id` names: a causal LM, or for a vision-language model's config (one with a vision_config)
    its image-text-to-text model. For a run on `device` (None: the CPU): a CPU run's weights are copied out of the
    file's memory map (`own_memory`); an accelerator run's are not, since placement copies them there anyway."""
    config = from_pretrained_checked(AutoConfig, "model", model_id, trust_remote_code=trust_remote_code)
    auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    model = load_pretrained(auto, "model", model_id, init_kwargs, trust_remote_code)
    return own_memory(model) if device is None or device.type == "cpu" else model


def layer_configs(config: Any) -> list[Any]:
    """Each layer's config of a (text) `config`, in layer order: its own where the layers differ (transformers'
    per-layer configs: Gemma 4's global layers have wider heads, and the config refuses to say one head size), else
    `config` (`num_hidden_layers` times, 32 where it does not say)."""
    if getattr(config, "is_heterogeneous", False):
        return list(config.per_layer_config)
    return [config] * (getattr(config, "num_hidden_layers", None) or 32)


def attention_shapes(config: Any) -> list[tuple[int, int, int]] | None:
    """(query heads, key-value heads, head dim) of each of a (text) `config`'s `layer_configs`; None where one does
    not give its heads and hidden size."""
    shapes = []
    for layer in layer_configs(config):
        heads, hidden = getattr(layer, "num_attention_heads", None), getattr(layer, "hidden_size", None)
        if not isinstance(heads, int) or not isinstance(hidden, int):
            return None
        kv_heads = getattr(layer, "num_key_value_heads", None) or heads
        shapes.append((heads, kv_heads, getattr(layer, "head_dim", None) or hidden // heads))
    return shapes


def is_vision_language(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def load_processing_class(model_id: str, config: Any, trust_remote_code: bool) -> Any:
    """A vision-language model's processor (`AutoProcessor`), else its tokenizer; prepared (`prepare_tokenizer`)."""
    if not is_vision_language(config):
        return load_tokenizer(model_id, trust_remote_code)
    failure = ""
    try:
        processor = from_pretrained_checked(AutoProcessor, "processor", model_id, trust_remote_code=trust_remote_code)
    # transformers' torchvision-less video processor mapping lacks what it looks up (Qwen2-VL's family: "Can't load
    # video processor", or an AttributeError); a processor module that imports torchvision cannot be imported (Gemma
    # 4's)
    except (AttributeError, ImportError) as err:
        processor, failure = None, f" ({type(err).__name__}: {err})"
    except ModelLoadError as err:
        if importlib.util.find_spec("torchvision") is not None or "load video processor" not in str(err):
            raise
        processor = None
    if not isinstance(processor, ProcessorMixin):  # AutoProcessor falls back to the tokenizer when it cannot
        why = (
            "its processor needs torchvision (for its image or video processor), which is not installed"
            if importlib.util.find_spec("torchvision") is None
            else f"AutoProcessor could not build its processor{failure}"
        )
        raise ModelLoadError(
            f"'{model_id}' is a vision-language model, but {why}. Install the torchvision build that matches your "
            "torch, or pass processing_class= a processor you built."
        )
    prepare_tokenizer(processor)
    return processor


def own_memory(model: PreTrainedModel) -> PreTrainedModel:
    """Copy CPU weights that still live in the checkpoint file's memory map into the process's own memory.
    Otherwise the first optimizer step pays a copy-on-write page fault per page as it writes every weight
    (measured: 3.6 s instead of 0.2 s for a 135M model's first AdamW step; the copy takes 0.4 s)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.device.type == "cpu" and param.requires_grad:
                param.data = param.data.clone()
    return model


def load_pretrained(
    auto_class: Any, kind: str, model_id: str, init_kwargs: dict[str, Any] | None, trust_remote_code: bool, **extra: Any
) -> PreTrainedModel:
    """`auto_class.from_pretrained` with `from_pretrained_checked`'s errors, `init_kwargs`' dtype resolved."""
    kwargs = _resolve_dtype(init_kwargs or {})
    kwargs.setdefault("trust_remote_code", trust_remote_code)
    kwargs.update(extra)
    return from_pretrained_checked(auto_class, kind, model_id, **kwargs)


def from_pretrained_checked(auto_class: Any, kind: str, model_id: str, **kwargs: Any) -> Any:
    """`auto_class.from_pretrained(model_id)` that fails at once with one clear `ModelLoadError`: "no such
    directory" for ids that can only be paths, the local cache tried before the network, and an unreachable Hub
    found with one quick connection instead of the hub client's retries."""
    missing_path = _missing_directory(model_id)
    if missing_path is not None:
        raise ModelLoadError(f"Could not load the {kind} '{model_id}': {missing_path}.")
    try:
        if not os.path.isdir(model_id):
            try:  # already in the local cache: no network needed
                return auto_class.from_pretrained(model_id, **_local_only(auto_class, kwargs))
            except OSError:
                if not _hub_reachable():
                    raise OSError(
                        "the Hugging Face Hub is unreachable from this machine and the model is not in the local cache"
                    ) from None
        return auto_class.from_pretrained(model_id, **kwargs)
    except (OSError, ValueError) as err:
        raise _load_error(kind, model_id, err) from None


def load_tokenizer(model_id: str, trust_remote_code: bool) -> Any:
    return prepare_tokenizer(
        from_pretrained_checked(AutoTokenizer, "tokenizer", model_id, trust_remote_code=trust_remote_code)
    )


def prepare_tokenizer(tokenizer: Any) -> Any:
    """Left padding (prompts are right-aligned for generation) and a pad token (EOS when the model has none)."""
    if isinstance(tokenizer, ProcessorMixin) or not hasattr(tokenizer, "pad_token_id"):  # pad with its tokenizer
        tokenizer = tokenizer.tokenizer
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"The tokenizer ({type(tokenizer).__name__}) has neither a pad token nor an EOS token: generation "
                "needs one to pad prompts and another to end completions. Give it both, e.g. "
                "tokenizer.add_special_tokens({'pad_token': '<pad>', 'eos_token': '</s>'}) and "
                "model.resize_token_embeddings(len(tokenizer)), then pass it as processing_class."
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _dropout_probabilities(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, str, str, float]]:
    """Each place `model` drops out in training, as (module, attribute, kind, probability): its dropout modules
    (LoRA's `lora_dropout` among them) and the float `*dropout*` attributes its layers pass to functional dropout in
    forward (transformers' `attention_dropout` of every Llama-style attention, Seed-OSS's `residual_dropout`), which
    no Dropout module holds."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):  # Dropout, Dropout1d-3d, AlphaDropout, ...
            parts = name.split(".")  # LoRA's: ...q_proj.lora_dropout.default
            kind = next((part for part in reversed(parts) if "drop" in part), parts[-1] or type(module).__name__)
            yield module, "p", kind, float(module.p)
        for attribute, value in list(vars(module).items()):
            if "dropout" in attribute and isinstance(value, float):
                yield module, attribute, attribute, value


def active_dropout(model: torch.nn.Module) -> dict[str, float]:
    """The dropout `model` trains with: each kind's largest probability, those above 0 only."""
    found: dict[str, float] = {}
    for _, _, kind, p in _dropout_probabilities(model):
        if p > 0:
            found[kind] = max(found.get(kind, 0.0), p)
    return found


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout probability of `model` to 0: its Dropout modules' and the functional ones its layers hold
    (TRL's `disable_dropout_in_model` sets the modules' only, so a model's attention dropout stayed on there)."""
    for module, attribute, _, p in list(_dropout_probabilities(model)):
        if p > 0:
            setattr(module, attribute, 0.0)


def reference_model(
    policy: PreTrainedModel,
    model_id: str | None,
    init_kwargs: dict[str, Any] | None,
    trust_remote_code: bool,
    device: torch.device | None = None,
) -> PreTrainedModel:
    """A frozen copy of the initial policy: reloaded from its id, or deep-copied when given as an object."""
    ref = load_causal_lm(model_id, init_kwargs, trust_remote_code, device) if model_id else copy.deepcopy(policy)
    ref.eval()
    ref.requires_grad_(False)
    return ref


# oneDNN instruction-set caps (ONEDNN_MAX_CPU_ISA) below AVX512_CORE_BF16: its bfloat16 matmuls are emulated there
_ONEDNN_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


def fast_bf16_available(device: torch.device) -> bool:
    """Whether bfloat16 compute is native and pays off here: CUDA GPUs of compute capability 8.0 or more (Ampere on;
    older ones only emulate it, which `torch.cuda.is_bf16_supported()` counts by default), and CPUs with AMX or
    AVX512-BF16 units, unless oneDNN, which runs the CPU's bfloat16 matmuls, is capped below them
    (ONEDNN_MAX_CPU_ISA). AVX512-BF16 without AMX was measured faster end to end than float32
    (`bench/RESULTS.md`)."""
    if device.type == "cuda":
        if torch.version.hip:  # ROCm: capabilities are not NVIDIA's numbering; torch answers for the GPU
            return torch.cuda.is_bf16_supported()
        index = device.index if device.index is not None else torch.cuda.current_device()
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return native and torch.cuda.get_device_capability(index) >= (8, 0)
    if device.type != "cpu":
        return False
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).upper()
    if cap in _ONEDNN_WITHOUT_BF16:
        return False
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo's first `flags` line; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def cpu_isa() -> str:
    """The widest vector/matrix instruction set PyTorch's CPU kernels use here (for reports)."""
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:
        return "unknown"


def generation_eos(model: Any) -> Any:
    """The model's generation config's EOS id(s), if any."""
    return getattr(getattr(model, "generation_config", None), "eos_token_id", None)


def unwrap(model: Any, keep_peft: bool = False) -> Any:
    """The transformers model inside DDP/DeepSpeed (`.module`) and PEFT wrappers; with `keep_peft`, the PEFT model
    itself."""
    while hasattr(model, "module"):
        model = model.module
    if keep_peft:
        return model
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def enable_checkpointing(model: Any, args: ResolvedConfig, fsdp_plugin: Any = None) -> None:
    """`gradient_checkpointing` (`activation_checkpointing`, which the config resolved into it) with its kwargs,
    as transformers 5.24's Trainer applies them: `every_n_layers` and `offload` are options of the model's
    method, every other key goes to torch.utils.checkpoint.checkpoint (default: use_reentrant=False). Under
    FSDP whose plugin checkpoints the layers itself (`fsdp_activation_checkpointing`), both at once would
    checkpoint twice: refused, as the HF Trainer does; with grpo's off, the plugin's does the work."""
    plugin_checkpoints = bool(getattr(fsdp_plugin, "activation_checkpointing", False))
    if plugin_checkpoints and args.gradient_checkpointing:
        raise ValueError(
            "GRPOConfig.gradient_checkpointing (activation_checkpointing) and the FSDP plugin's "
            "activation_checkpointing are both on, which would checkpoint every layer twice. Set "
            "gradient_checkpointing=False to use FSDP's, or turn fsdp_activation_checkpointing off in the "
            "accelerate config."
        )
    if not args.gradient_checkpointing:
        return
    kwargs = dict(args.gradient_checkpointing_kwargs or {})
    options = {"every_n_layers": kwargs.pop("every_n_layers", 1), "offload": kwargs.pop("offload", False)}
    kwargs = kwargs or {"use_reentrant": False}  # transformers 5's default; older ones would use reentrant
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **options)


def set_use_cache(models: list[Any], use_cache: bool) -> None:
    """`GRPOConfig.use_cache`, set as the HF Trainer sets it: the models' `config.use_cache`, which their training
    forwards read (a KV cache there is only kept, never read; generation passes its own)."""
    for model in models:
        config = getattr(unwrap(model), "config", None) if model is not None else None
        if config is not None:
            config.use_cache = use_cache


def recomputes_activations(model: torch.nn.Module) -> bool:
    """Whether activation checkpointing is on, transformers' or the FSDP plugin's (its checkpoint wrappers around
    the layers): backward then re-runs the forward."""
    model = unwrap(model)
    if any(isinstance(m, CheckpointWrapper) for m in model.modules()):
        return True
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # the first: transformers >= 5.2x
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _forward_parameters(model: Any) -> Any:
    """The keyword parameters of the transformers model's own forward, looking through DDP and PEFT wrappers
    (which pass keywords on)."""
    return inspect.signature(unwrap(model).forward).parameters


def accepts_logits_to_keep(model: Any) -> bool:
    """Whether the model's forward can skip computing logits for positions we do not need."""
    try:
        return "logits_to_keep" in _forward_parameters(model)
    except (TypeError, ValueError, AttributeError):
        return False


def cache_argument(model: Any) -> str:
    """The forward keyword that takes a KV cache: `cache` (transformers >= 5.2x) or `past_key_values`."""
    try:
        return "cache" if "cache" in _forward_parameters(model) else "past_key_values"
    except (TypeError, ValueError, AttributeError):
        return "past_key_values"


# Layer kinds (config.layer_types, or Jamba's layers_block_type) that carry state across tokens besides keys and
# values, and the parameters of state-space and RNN layers (Mamba's A_log, RWKV's time_decay, Griffin's
# recurrent_param). transformers marks such models with a private `_is_stateful`, which 5.25 removed: all three
# signals are read, so none depends on it.
RECURRENT_LAYERS = {"linear_attention", "recurrent", "mamba", "conv", "hybrid"}
RECURRENT_PARAMETERS = {"A_log", "time_decay", "recurrent_param"}
RECURRENT_MODULES = ("Mamba", "xLSTM", "Rwkv", "GatedDeltaNet")


def keeps_recurrent_state(model: Any) -> bool:
    """Whether some layer of `model` keeps state across tokens besides its keys and values (Mamba, linear
    attention, RWKV, xLSTM, Griffin's recurrent blocks)."""
    if getattr(model, "_is_stateful", False):
        return True
    config = getattr(model, "config", None)
    kinds = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    if isinstance(kinds, (list, tuple)) and RECURRENT_LAYERS & {str(k) for k in kinds}:
        return True
    if any(name.rsplit(".", 1)[-1] in RECURRENT_PARAMETERS for name, _ in model.named_parameters()):
        return True
    return any(any(part in type(m).__name__ for part in RECURRENT_MODULES) for m in model.modules())


@contextlib.contextmanager
def swapped_forwards(forwards: list[tuple[torch.nn.Module, Callable[..., Any]]]) -> Iterator[None]:
    """Within the context each module's forward is the given function (its hooks still run around it); after it,
    the class's forward again. How the fast paths give modules other arithmetic without copying the model."""
    for module, forward in forwards:
        module.forward = forward
    try:
        yield
    finally:
        for module, _ in forwards:
            del module.forward
