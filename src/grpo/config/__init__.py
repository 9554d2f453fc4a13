"""`GRPOConfig`: every field of TRL 1.16's `GRPOConfig` (its `TrainingArguments` fields included), under the same
names and with 1.16's defaults, plus grpo's own settings.

One flat dataclass to its users (`HfArgumentParser` and TRL scripts expect one), assembled from the themed field
groups of `training.py` and `grpo_fields.py`. What grpo does with each field is listed in `trl_1_16_fields.md`:
most work as in TRL; a few differ on purpose (`max_completion_length` is 256, as the product document says; `bf16=None`
depends on the hardware); the rest refuse or warn about a non-default value (`compat`). `__post_init__` resolves
derived values as 1.16 does and rejects bad values with a message that names the field and the fix; combinations the
reference only warns about are checked by the trainer, which warns.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import math
import os
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from transformers.training_args import OptimizerNames

from grpo.base import secrets
from grpo.config import compat
from grpo.config.grpo_fields import (
    IS_MODES,
    LOSS_TYPES,
    CompletionLogFields,
    GenerationFields,
    GrpoOnlyFields,
    LossFields,
    ModelFields,
    VLLMFields,
)
from grpo.config.training import (
    CheckpointFields,
    DistributedFields,
    EvaluationFields,
    HubFields,
    LoggingFields,
    OptimizationFields,
    OutputFields,
    PrecisionFields,
)

__all__ = ["GRPOConfig", "LOSS_TYPES", "ResolvedConfig", "reject_later_features", "warn_odd_combinations"]

SCALE_REWARDS = ("group", "batch", "none")
SAVE_STRATEGIES = ("no", "steps", "epoch", "best")
LOGGING_STRATEGIES = ("no", "steps", "epoch")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical", "passive")
TOKENS_SEEN = ("no", "all", "non_padding")
JSON_FIELDS = (
    "generation_kwargs",
    "chat_template_kwargs",
    "model_init_kwargs",
    "lr_scheduler_kwargs",
    "gradient_checkpointing_kwargs",
    "activation_checkpointing_kwargs",
    "transformers_continuous_batching_config",
)


@dataclass
class GRPOConfig(
    GrpoOnlyFields,
    CompletionLogFields,
    LossFields,
    VLLMFields,
    GenerationFields,
    ModelFields,
    HubFields,
    DistributedFields,
    EvaluationFields,
    CheckpointFields,
    LoggingFields,
    PrecisionFields,
    OptimizationFields,
    OutputFields,
):
    """Every knob of a GRPO run; see the module docstring and `trl_1_16_fields.md`."""

    def __post_init__(self) -> None:
        for name in JSON_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str):  # command lines pass dicts as JSON
                setattr(self, name, compat.json_dict(name, value))
        self.scale_rewards = _parse_scale_rewards(self.scale_rewards)
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.output_dir is not None:
            self.output_dir = os.fspath(self.output_dir)
        if self.save_total_limit is not None and self.save_total_limit <= 0:
            self.save_total_limit = None  # the HF Trainer's meaning: no limit
        self._resolve_as_trl()
        compat.check_unsupported(self)
        self.accelerator_config = compat.accelerator_config(self.accelerator_config)
        _check_numbers(self)
        self._derive_generation_batch()
        _validate(self)

    def _resolve_as_trl(self) -> None:
        """Derived values, resolved as TRL 1.16 on transformers 5.24 resolves them."""
        if isinstance(self.pad_to_multiple_of, str):
            text = self.pad_to_multiple_of.lower()
            # "auto": 128 on Neuron (which compiles once per shape), none elsewhere; grpo does not run on Neuron
            self.pad_to_multiple_of = None if text in ("auto", "none", "null") else int(text)
        self.include_num_input_tokens_seen = _parse_tokens_seen(self.include_num_input_tokens_seen)
        if self.debug is None or self.debug == []:  # HfArgumentParser passes a list field's absence as None
            self.debug = ""
        if self.torch_compile_backend is not None or self.torch_compile_mode is not None:
            self.torch_compile = True
        # transformers 5.24: activation_checkpointing(_kwargs) is the name, gradient_checkpointing(_kwargs) its
        # deprecated alias, and a set new name wins; grpo reads the old names, which carry the resolved value
        if self.activation_checkpointing is not None:
            self.gradient_checkpointing = self.activation_checkpointing
        if self.activation_checkpointing_kwargs is not None:
            self.gradient_checkpointing_kwargs = self.activation_checkpointing_kwargs
        if self.disable_tqdm is None:  # transformers: off when logging is quieter than warnings
            self.disable_tqdm = logging.getLogger("grpo").getEffectiveLevel() > logging.WARNING
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if self.warmup_ratio is not None:
            _require(0 <= self.warmup_ratio < 1, "warmup_ratio", "must be in [0, 1)")
            if self.warmup_steps == 0:
                self.warmup_steps = self.warmup_ratio
        if self.vllm_importance_sampling_cap is not None:
            warnings.warn(
                "vllm_importance_sampling_cap is deprecated (as in TRL 1.16): use vllm_importance_sampling_clip_max; "
                "its value is copied there.",
                FutureWarning,
                stacklevel=4,
            )
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        if self.auto_find_batch_size:
            raise ValueError(
                "GRPOConfig.auto_find_batch_size is not supported (as in TRL 1.16): halving the batch on "
                "out-of-memory would split the groups of num_generations completions that advantages compare. Set "
                "it to False and lower per_device_train_batch_size instead."
            )

    @property
    def world_size(self) -> int:
        return int(os.environ.get("WORLD_SIZE", "1"))

    def _derive_generation_batch(self) -> None:
        per_step = self.per_device_train_batch_size * self.world_size
        _require(per_step > 0, "per_device_train_batch_size", "must be at least 1")
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError(
                "generation_batch_size and steps_per_generation cannot both be set: "
                "set one of them (the other is derived)."
            )
        if self.generation_batch_size is None:
            if self.steps_per_generation is None:
                self.steps_per_generation = self.gradient_accumulation_steps
            self.generation_batch_size = per_step * self.steps_per_generation
        elif self.generation_batch_size % per_step != 0:
            raise ValueError(
                f"generation_batch_size ({self.generation_batch_size}) must be a multiple of "
                f"per_device_train_batch_size x processes ({per_step})."
            )
        else:
            self.steps_per_generation = self.generation_batch_size // per_step

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict, secrets redacted at every depth (`grpo.base.secrets`): what checkpoints, trackers, the
        report and the model card save. The config itself keeps the real values."""
        return secrets.redact(dataclasses.asdict(self))

    def __repr__(self) -> str:  # redacted as to_dict (the HF TrainingArguments' repr hides its *_token fields too)
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"

    __str__ = __repr__


def _parse_tokens_seen(value: Any) -> str:
    if isinstance(value, bool):
        return "all" if value else "no"
    text = str(value).lower()
    return {"true": "all", "false": "no"}.get(text, text)


def _parse_scale_rewards(value: Any) -> str:
    if isinstance(value, bool):
        return "group" if value else "none"
    text = str(value).lower()
    return {"true": "group", "false": "none"}.get(text, text)


def _require(ok: bool, name: str, fix: str) -> None:
    if not ok:
        raise ValueError(f"GRPOConfig.{name} {fix}.")


FLOAT32_MAX = 3.4028234663852886e38


def _check_numbers(c: GRPOConfig) -> None:
    """Every number in the config is finite and float32-representable: training computes in float32, where 1e39
    is inf and inf or NaN turn into NaN weights or zero gradients. A field typed int (a count, a seed: `int` or
    `Optional[int]`, as in TRL / TrainingArguments) given a float takes it when whole (2.0 is 2, as a YAML or JSON
    file may write it) and refuses a fraction; float fields keep theirs (save_steps=0.25 is a ratio of the run)."""
    for f in dataclasses.fields(c):
        value = getattr(c, f.name)
        for number in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                continue
            if not math.isfinite(number) or abs(number) > FLOAT32_MAX:
                raise ValueError(
                    f"GRPOConfig.{f.name} is {value!r}; it must be a finite number within float32's range "
                    "(|x| <= 3.4e38), since training computes in float32, where it would be inf or NaN."
                )
        if isinstance(value, float) and _integer_typed(f.type):
            if not value.is_integer():
                raise ValueError(f"GRPOConfig.{f.name} is {value!r}; it must be a whole number (an int).")
            setattr(c, f.name, int(value))


def _integer_typed(annotation: Any) -> bool:
    """Whether a field's annotation (a string: `from __future__ import annotations`) admits int but not float."""
    names = set(re.findall(r"\w+", str(annotation)))
    return "int" in names and "float" not in names


# Optimizers whose training step is not a plain optimizer.step() after backward (LOMO fuses the update into
# backward, schedule-free ones need train()/eval() switches), that need per-module targets (GaLore, APOLLO), or
# hardware grpo does not run on (XLA, NPU).
UNSUPPORTED_OPTIMIZERS = re.compile(r"lomo|galore|apollo|schedule_free|xla|npu")


def _check_optim(name: str) -> None:
    if name not in {o.value for o in OptimizerNames}:
        near = difflib.get_close_matches(name, [o.value for o in OptimizerNames], n=1)
        raise ValueError(
            f"GRPOConfig.optim={name!r} is not an optimizer name"
            + (f"; did you mean {near[0]!r}?" if near else "; use adamw_torch_fused, adamw_torch, sgd, adafactor, ...")
        )
    if UNSUPPORTED_OPTIMIZERS.search(name):
        raise ValueError(
            f"GRPOConfig.optim={name!r} is not supported by grpo: its update is not a plain optimizer step after "
            "backward, or it needs hardware or per-module targets grpo does not provide. Use adamw_torch_fused, "
            "adamw_torch, sgd, adagrad, rmsprop, adafactor or a bitsandbytes optimizer (adamw_8bit, ...)."
        )


def _validate(c: GRPOConfig) -> None:
    # resolved by __post_init__ before this runs
    assert c.generation_batch_size is not None and c.steps_per_generation is not None and c.epsilon_high is not None
    assert not isinstance(c.pad_to_multiple_of, str)
    _check_optim(str(c.optim))
    _require(c.loss_type in LOSS_TYPES, "loss_type", f"is {c.loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
    _require(
        c.num_generations >= 2,
        "num_generations",
        f"is {c.num_generations}; GRPO compares completions within a group, so it needs at least 2",
    )
    _require(
        c.generation_batch_size % c.num_generations == 0,
        "generation_batch_size",
        f"({c.generation_batch_size} = per_device_train_batch_size x processes x steps_per_generation) is "
        f"not divisible by num_generations ({c.num_generations}); make per_device_train_batch_size (or "
        f"generation_batch_size) a multiple of {c.num_generations}, or lower num_generations",
    )
    _require(
        c.scale_rewards in SCALE_REWARDS,
        "scale_rewards",
        f"is {c.scale_rewards!r}; use 'group', 'batch' or 'none' (or True/False)",
    )
    _require(
        c.importance_sampling_level in ("token", "sequence"),
        "importance_sampling_level",
        f"is {c.importance_sampling_level!r}; use 'token' or 'sequence'",
    )
    _require(
        c.multi_objective_aggregation in ("sum_then_normalize", "normalize_then_sum"),
        "multi_objective_aggregation",
        "must be 'sum_then_normalize' or 'normalize_then_sum'",
    )
    _require(
        c.max_completion_length is not None and c.max_completion_length >= 1,
        "max_completion_length",
        "must be a positive number of tokens",
    )
    _require(c.temperature > 0, "temperature", f"is {c.temperature}; it must be > 0")
    _require(0 < c.top_p <= 1, "top_p", f"is {c.top_p}; it must be in (0, 1]")
    _require(c.top_k >= 0, "top_k", "must be >= 0 (0 disables it)")
    _require(c.min_p is None or 0 <= c.min_p <= 1, "min_p", "must be in [0, 1]")
    _require(c.repetition_penalty > 0, "repetition_penalty", "must be > 0")
    _require(c.beta >= 0, "beta", f"is {c.beta}; the KL coefficient must be >= 0")
    _require(c.epsilon >= 0 and c.epsilon_high >= 0, "epsilon", "and epsilon_high must be >= 0")
    _require(0 <= c.top_entropy_quantile <= 1, "top_entropy_quantile", "must be in [0, 1]")
    _require(c.num_iterations >= 1, "num_iterations", "must be >= 1")
    _require(c.gradient_accumulation_steps >= 1, "gradient_accumulation_steps", "must be >= 1")
    _require(c.dynamic_sampling_max_attempts >= 1, "dynamic_sampling_max_attempts", "must be >= 1")
    _require(c.dynamic_sampling_std_threshold >= 0, "dynamic_sampling_std_threshold", "must be >= 0")
    _require(c.steps_per_generation >= 1, "steps_per_generation", "must be >= 1")
    _require(c.max_staleness >= 0, "max_staleness", "must be >= 0 generation rounds")
    _require(c.weight_sync_steps >= 1, "weight_sync_steps", "must be >= 1 optimizer steps")
    _require(
        c.async_behaviour_logps in ("training", "sampler"),
        "async_behaviour_logps",
        f"is {c.async_behaviour_logps!r}; use 'training' or 'sampler'",
    )
    _require(c.packing in ("padded", "tree"), "packing", f"is {c.packing!r}; use 'padded' or 'tree'")
    _require(c.heartbeat_stale_after_s > 0, "heartbeat_stale_after_s", "must be > 0 seconds")
    _require(c.learning_rate >= 0, "learning_rate", "must be >= 0")
    for name in ("seed", "data_seed"):  # numpy's generator (seeded with every other) takes 32-bit seeds
        value = getattr(c, name)
        _require(value is None or 0 <= value < 2**32, name, f"is {value}; a seed is an integer in [0, 2**32 - 1]")
    for name in ("reward_timeout", "tool_call_timeout"):
        value = getattr(c, name)
        _require(value is None or value >= 0, name, "must be >= 0 seconds (0 or None: no limit)")
    _require(
        c.max_tool_calling_iterations is None or c.max_tool_calling_iterations >= 0,
        "max_tool_calling_iterations",
        "must be >= 0 (None: no limit but max_completion_length)",
    )
    _require(
        c.max_steps != 0 and (c.max_steps > 0 or c.num_train_epochs > 0),
        "max_steps",
        "is 0 (or num_train_epochs is 0): nothing would be trained; set max_steps > 0 or num_train_epochs > 0",
    )
    _require(c.logging_steps > 0 and c.save_steps > 0, "logging_steps", "and save_steps must be > 0")
    _require(
        c.save_strategy in SAVE_STRATEGIES, "save_strategy", f"is {c.save_strategy!r}; use one of {SAVE_STRATEGIES}"
    )
    _require(
        c.logging_strategy in LOGGING_STRATEGIES,
        "logging_strategy",
        f"is {c.logging_strategy!r}; use one of {LOGGING_STRATEGIES}",
    )
    _require(
        c.metric_for_best_model is not None or c.save_strategy != "best",
        "metric_for_best_model",
        "must name a logged metric (e.g. 'reward') when save_strategy='best'",
    )
    for name in ("log_level", "log_level_replica"):
        _require(getattr(c, name) in LOG_LEVELS, name, f"is {getattr(c, name)!r}; use one of {LOG_LEVELS}")
    _require(
        c.include_num_input_tokens_seen in TOKENS_SEEN,
        "include_num_input_tokens_seen",
        "must be 'all' (or True), 'non_padding' or 'no' (or False)",
    )
    _require(c.warmup_steps >= 0, "warmup_steps", "must be >= 0 (a value in (0, 1) is a fraction of the steps)")
    _require(
        c.pad_to_multiple_of is None or c.pad_to_multiple_of >= 1,
        "pad_to_multiple_of",
        "must be a positive number of tokens, 'auto' or None",
    )
    _require(
        c.torch_empty_cache_steps is None or c.torch_empty_cache_steps >= 1,
        "torch_empty_cache_steps",
        "must be >= 1 or None",
    )
    _require(0 <= c.ref_model_mixup_alpha <= 1, "ref_model_mixup_alpha", "must be in [0, 1]")
    _require(c.ref_model_sync_steps >= 1, "ref_model_sync_steps", "must be >= 1")
    _require(
        not (c.sync_ref_model and c.beta == 0.0),
        "sync_ref_model",
        "needs a reference model, and beta=0 loads none; set beta > 0 or sync_ref_model=False",
    )
    _require(
        c.entropy_coef_min <= c.entropy_coef_max and c.entropy_coef_delta >= 0,
        "entropy_coef_min",
        "must be <= entropy_coef_max, and entropy_coef_delta >= 0",
    )
    _require(c.ddp_timeout > 0, "ddp_timeout", "must be > 0 seconds")
    _require(not (c.bf16 and c.fp16), "bf16", "and fp16 are both set; choose one precision")
    _require(
        c.sapo_temperature_pos > 0 and c.sapo_temperature_neg > 0,
        "sapo_temperature_pos",
        "and sapo_temperature_neg must be > 0",
    )
    _check_vllm(c)
    _require(
        c.reward_weights is None or len(c.reward_weights) > 0,
        "reward_weights",
        "is empty; give one weight per reward function or None",
    )


def _check_vllm(c: GRPOConfig) -> None:
    """The vLLM and importance-sampling fields (shared spec §1.4, §4.2-4.3)."""
    _require(c.vllm_server_timeout > 0, "vllm_server_timeout", "must be > 0 seconds")
    _require(0 < c.vllm_server_port < 65536, "vllm_server_port", "must be a TCP port (1-65535)")
    _require(c.vllm_mode in ("colocate", "server"), "vllm_mode", f"is {c.vllm_mode!r}; use 'colocate' or 'server'")
    _require(
        c.vllm_importance_sampling_mode in IS_MODES,
        "vllm_importance_sampling_mode",
        f"is {c.vllm_importance_sampling_mode!r}; use one of {', '.join(IS_MODES)}",
    )
    low, high = c.vllm_importance_sampling_clip_min, c.vllm_importance_sampling_clip_max
    _require(low is None or 0 <= low < math.inf, "vllm_importance_sampling_clip_min", "must be >= 0 (or None)")
    _require(high is None or high > 0, "vllm_importance_sampling_clip_max", "must be > 0 (or None: unbounded)")
    _require(
        low is None or high is None or low <= high,
        "vllm_importance_sampling_clip_min",
        f"({low}) is above vllm_importance_sampling_clip_max ({high})",
    )
    _require(
        not (
            c.use_vllm
            and c.loss_type == "vespo"
            and c.vllm_importance_sampling_correction
            and not c.vllm_importance_sampling_mode.startswith("token")
        ),
        "vllm_importance_sampling_mode",
        f"is {c.vllm_importance_sampling_mode!r}, but loss_type='vespo' folds the correction into its per-token "
        "weights (TRL 1.16): use 'token_truncate' or 'token_mask'",
    )
    threshold = c.off_policy_mask_threshold
    _require(threshold is None or not math.isnan(threshold), "off_policy_mask_threshold", "is NaN; give a number")
    _require(0 < c.vllm_gpu_memory_utilization <= 1, "vllm_gpu_memory_utilization", "must be in (0, 1]")
    _require(c.vllm_max_model_length is None or c.vllm_max_model_length > 1, "vllm_max_model_length", "must be > 1")
    _require(c.vllm_tensor_parallel_size >= 1, "vllm_tensor_parallel_size", "must be >= 1 (processes per engine)")
    gib = c.vllm_kv_cache_gib
    _require(gib is None or 0 < gib < math.inf, "vllm_kv_cache_gib", "must be a positive number of GiB (or None)")


def _reject_unknown_kwargs(init, config=None):
    """Turn dataclass's bare 'unexpected keyword' TypeError into one that names the nearest valid field."""
    config = config or GRPOConfig
    names = [f.name for f in dataclasses.fields(config)]

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        for key in kwargs:
            if key not in names:
                near = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
                hint = f"; did you mean {near[0]!r}?" if near else f"; see {config.__name__}'s fields for valid names"
                raise TypeError(f"{config.__name__} got an unknown argument {key!r}{hint}")
        init(self, *args, **kwargs)

    return checked_init


# wraps the dataclass-made __init__ (its signature unchanged), which mypy does not let a method be assigned
GRPOConfig.__init__ = _reject_unknown_kwargs(GRPOConfig.__init__)  # type: ignore[method-assign]


def warn_odd_combinations(a: GRPOConfig) -> None:
    """Combinations the reference accepts with a warning (shared spec §1.7)."""
    if a.loss_type == "luspo" and a.importance_sampling_level != "sequence":
        warnings.warn("loss_type='luspo' is meant for importance_sampling_level='sequence'.", stacklevel=3)
    if a.loss_type == "vespo" and a.importance_sampling_level != "token":
        warnings.warn(
            "loss_type='vespo' computes its own sequence weight; use importance_sampling_level='token'.", stacklevel=3
        )
    if a.importance_sampling_level == "sequence" and a.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        logging.getLogger("grpo").warning(  # logged, as TRL logs it (its users' tests read it with caplog)
            "importance_sampling_level='sequence' with loss_type='%s' weights each sequence by its completion "
            "length; GSPO normalizes per sequence (loss_type='grpo').",
            a.loss_type,
        )
    assert a.epsilon_high is not None  # __post_init__: epsilon's value by default
    if a.delta is not None and a.delta <= 1 + a.epsilon_high:
        warnings.warn(
            f"delta={a.delta} is not above 1 + epsilon_high; it will also cap the clipped branch.", stacklevel=3
        )


def reject_later_features(args: GRPOConfig, eval_dataset: Any, callbacks: Any) -> None:
    """Trainer arguments of features that later issues bring: a warning that says so (ignoring them is harmless).
    Config fields of those features are refused by the config itself (`compat`)."""
    if eval_dataset is not None:
        warnings.warn("eval_dataset is ignored: evaluation during training is not available yet in grpo.", stacklevel=3)
    if callbacks:
        warnings.warn("callbacks are ignored: grpo does not run transformers callbacks.", stacklevel=3)


if TYPE_CHECKING:

    class ResolvedConfig(GRPOConfig):
        """A GRPOConfig after `__post_init__` and `resolve_args`, as the type checker should see it: the fields
        that the command line lets be None or text are resolved (their checks are `_check`'s)."""

        output_dir: str
        generation_batch_size: int
        steps_per_generation: int
        max_completion_length: int
        pad_to_multiple_of: int | None
        chat_template_kwargs: dict | None
else:
    ResolvedConfig = GRPOConfig


def resolve_args(
    args: GRPOConfig | None, model_name: str, model: Any = None, quantization_config: Any = None
) -> ResolvedConfig:
    """The trainer's config: the given one, or the defaults; output_dir defaults to '<model name>-GRPO' and is made
    absolute (against the working directory at construction); a
    quantization_config (TRL 1.16's trainer argument) joins model_init_kwargs, for a model loaded from its id."""
    args = args or GRPOConfig(output_dir=f"{model_name}-GRPO")
    if args.output_dir is None:
        args.output_dir = f"{model_name}-GRPO"
    # resolved once, here: a reward function or tool that changes the working directory (os.chdir) must not move
    # where checkpoints go, away from the run's lock
    args.output_dir = os.path.abspath(os.path.expanduser(args.output_dir))
    if quantization_config is not None:
        if not isinstance(model, str):
            raise ValueError(
                "quantization_config applies when the trainer loads the model from its id or path; this model is "
                "already loaded: quantize it when you load it, or pass model as a string."
            )
        assert not isinstance(args.model_init_kwargs, str)  # __post_init__ parsed the JSON
        args.model_init_kwargs = {**(args.model_init_kwargs or {}), "quantization_config": quantization_config}
    return cast(ResolvedConfig, args)
