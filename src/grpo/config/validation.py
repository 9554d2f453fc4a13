"""`GRPOConfig`'s checks: every number finite and within float32, integer fields whole, the optimizer's name, and
each field's range and the combinations that cannot train, each refused with one message naming the field and the
fix (`validate`, run by `GRPOConfig.__post_init__` once derived values are resolved)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from typing import TYPE_CHECKING, Any

from transformers.training_args import OptimizerNames

from grpo.config.grpo_fields import IS_MODES, LOSS_TYPES

if TYPE_CHECKING:
    from grpo.config import GRPOConfig

SCALE_REWARDS = ("group", "batch", "none")
SAVE_STRATEGIES = ("no", "steps", "epoch", "best")
LOGGING_STRATEGIES = ("no", "steps", "epoch")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical", "passive")
TOKENS_SEEN = ("no", "all", "non_padding")


def require(ok: bool, name: str, fix: str) -> None:
    if not ok:
        raise ValueError(f"GRPOConfig.{name} {fix}.")


FLOAT32_MAX = 3.4028234663852886e38

# Fields whose value becomes a part of a path inside output_dir: TensorBoard writes the run under
# <output_dir>/<project>/<run_name> (the other trackers take them as names only)
PATH_NAME_FIELDS = ("project", "run_name")


def check_path_name(name: str, value: Any) -> None:
    """A name used as a path part inside output_dir stays there: one with a '..' part or an absolute path (a YAML
    recipe from elsewhere) is refused, naming the field, before anything is written. '/' nests directories inside
    output_dir, as before; a backslash counts as a separator too (Windows)."""
    if not isinstance(value, str):
        return
    if os.path.isabs(value) or value.startswith(("/", "\\")) or ".." in re.split(r"[/\\]", value):
        raise ValueError(
            f"GRPOConfig.{name} is {value!r}; it names a directory inside output_dir (TensorBoard writes the run "
            "under <output_dir>/<project>/<run_name>), so it may have no '..' part and may not be an absolute path. "
            "Use a plain name such as 'exp-1' (a '/' nests directories inside output_dir)."
        )


def check_numbers(c: GRPOConfig) -> None:
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


def validate(c: GRPOConfig) -> None:
    # resolved by __post_init__ before this runs
    assert c.generation_batch_size is not None and c.steps_per_generation is not None and c.epsilon_high is not None
    assert not isinstance(c.pad_to_multiple_of, str)
    _check_optim(str(c.optim))
    for name in PATH_NAME_FIELDS:
        check_path_name(name, getattr(c, name))
    require(c.loss_type in LOSS_TYPES, "loss_type", f"is {c.loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
    require(
        c.num_generations >= 2,
        "num_generations",
        f"is {c.num_generations}; GRPO compares completions within a group, so it needs at least 2",
    )
    require(
        c.generation_batch_size % c.num_generations == 0,
        "generation_batch_size",
        f"({c.generation_batch_size} = per_device_train_batch_size x processes x steps_per_generation) is "
        f"not divisible by num_generations ({c.num_generations}); make per_device_train_batch_size (or "
        f"generation_batch_size) a multiple of {c.num_generations}, or lower num_generations",
    )
    require(
        c.scale_rewards in SCALE_REWARDS,
        "scale_rewards",
        f"is {c.scale_rewards!r}; use 'group', 'batch' or 'none' (or True/False)",
    )
    require(
        c.importance_sampling_level in ("token", "sequence"),
        "importance_sampling_level",
        f"is {c.importance_sampling_level!r}; use 'token' or 'sequence'",
    )
    require(
        c.multi_objective_aggregation in ("sum_then_normalize", "normalize_then_sum"),
        "multi_objective_aggregation",
        "must be 'sum_then_normalize' or 'normalize_then_sum'",
    )
    require(
        c.max_completion_length is not None and c.max_completion_length >= 1,
        "max_completion_length",
        "must be a positive number of tokens",
    )
    require(c.temperature > 0, "temperature", f"is {c.temperature}; it must be > 0")
    require(0 < c.top_p <= 1, "top_p", f"is {c.top_p}; it must be in (0, 1]")
    require(c.top_k >= 0, "top_k", "must be >= 0 (0 disables it)")
    require(c.min_p is None or 0 <= c.min_p <= 1, "min_p", "must be in [0, 1]")
    require(c.repetition_penalty > 0, "repetition_penalty", "must be > 0")
    require(c.beta >= 0, "beta", f"is {c.beta}; the KL coefficient must be >= 0")
    require(c.epsilon >= 0 and c.epsilon_high >= 0, "epsilon", "and epsilon_high must be >= 0")
    require(0 <= c.top_entropy_quantile <= 1, "top_entropy_quantile", "must be in [0, 1]")
    require(c.num_iterations >= 1, "num_iterations", "must be >= 1")
    require(c.gradient_accumulation_steps >= 1, "gradient_accumulation_steps", "must be >= 1")
    require(c.dynamic_sampling_max_attempts >= 1, "dynamic_sampling_max_attempts", "must be >= 1")
    require(c.dynamic_sampling_std_threshold >= 0, "dynamic_sampling_std_threshold", "must be >= 0")
    require(c.steps_per_generation >= 1, "steps_per_generation", "must be >= 1")
    require(c.max_staleness >= 0, "max_staleness", "must be >= 0 generation rounds")
    require(c.weight_sync_steps >= 1, "weight_sync_steps", "must be >= 1 optimizer steps")
    require(
        c.async_behaviour_logps in ("training", "sampler"),
        "async_behaviour_logps",
        f"is {c.async_behaviour_logps!r}; use 'training' or 'sampler'",
    )
    require(
        c.packing in (None, "padded", "tree", "auto"),
        "packing",
        f"is {c.packing!r}; use 'padded', 'tree', 'auto' or None (the default)",
    )
    require(
        c.turn_context in ("auto", "appended", "rendered"),
        "turn_context",
        f"is {c.turn_context!r}; use 'auto', 'appended' or 'rendered'",
    )
    require(c.heartbeat_stale_after_s > 0, "heartbeat_stale_after_s", "must be > 0 seconds")
    require(c.learning_rate >= 0, "learning_rate", "must be >= 0")
    for name in ("seed", "data_seed"):  # numpy's generator (seeded with every other) takes 32-bit seeds
        value = getattr(c, name)
        require(value is None or 0 <= value < 2**32, name, f"is {value}; a seed is an integer in [0, 2**32 - 1]")
    for name in ("reward_timeout", "tool_call_timeout"):
        value = getattr(c, name)
        require(value is None or value >= 0, name, "must be >= 0 seconds (0 or None: no limit)")
    require(
        c.max_tool_calling_iterations is None or c.max_tool_calling_iterations >= 0,
        "max_tool_calling_iterations",
        "must be >= 0 (None: no limit but max_completion_length)",
    )
    require(
        c.max_steps != 0 and (c.max_steps > 0 or c.num_train_epochs > 0),
        "max_steps",
        "is 0 (or num_train_epochs is 0): nothing would be trained; set max_steps > 0 or num_train_epochs > 0",
    )
    require(c.logging_steps > 0 and c.save_steps > 0, "logging_steps", "and save_steps must be > 0")
    require(
        c.save_strategy in SAVE_STRATEGIES, "save_strategy", f"is {c.save_strategy!r}; use one of {SAVE_STRATEGIES}"
    )
    require(
        c.logging_strategy in LOGGING_STRATEGIES,
        "logging_strategy",
        f"is {c.logging_strategy!r}; use one of {LOGGING_STRATEGIES}",
    )
    require(
        c.metric_for_best_model is not None or c.save_strategy != "best",
        "metric_for_best_model",
        "must name a logged metric (e.g. 'reward') when save_strategy='best'",
    )
    for name in ("log_level", "log_level_replica"):
        require(getattr(c, name) in LOG_LEVELS, name, f"is {getattr(c, name)!r}; use one of {LOG_LEVELS}")
    require(
        c.include_num_input_tokens_seen in TOKENS_SEEN,
        "include_num_input_tokens_seen",
        "must be 'all' (or True), 'non_padding' or 'no' (or False)",
    )
    require(c.warmup_steps >= 0, "warmup_steps", "must be >= 0 (a value in (0, 1) is a fraction of the steps)")
    require(
        c.pad_to_multiple_of is None or c.pad_to_multiple_of >= 1,
        "pad_to_multiple_of",
        "must be a positive number of tokens, 'auto' or None",
    )
    require(
        c.torch_empty_cache_steps is None or c.torch_empty_cache_steps >= 1,
        "torch_empty_cache_steps",
        "must be >= 1 or None",
    )
    require(0 <= c.ref_model_mixup_alpha <= 1, "ref_model_mixup_alpha", "must be in [0, 1]")
    require(c.ref_model_sync_steps >= 1, "ref_model_sync_steps", "must be >= 1")
    require(
        not (c.sync_ref_model and c.beta == 0.0),
        "sync_ref_model",
        "needs a reference model, and beta=0 loads none; set beta > 0 or sync_ref_model=False",
    )
    require(
        c.entropy_coef_min <= c.entropy_coef_max and c.entropy_coef_delta >= 0,
        "entropy_coef_min",
        "must be <= entropy_coef_max, and entropy_coef_delta >= 0",
    )
    require(c.ddp_timeout > 0, "ddp_timeout", "must be > 0 seconds")
    require(not (c.bf16 and c.fp16), "bf16", "and fp16 are both set; choose one precision")
    require(
        c.sapo_temperature_pos > 0 and c.sapo_temperature_neg > 0,
        "sapo_temperature_pos",
        "and sapo_temperature_neg must be > 0",
    )
    _check_vllm(c)
    require(
        c.reward_weights is None or len(c.reward_weights) > 0,
        "reward_weights",
        "is empty; give one weight per reward function or None",
    )


def _check_vllm(c: GRPOConfig) -> None:
    """The vLLM and importance-sampling fields (shared spec §1.4, §4.2-4.3)."""
    require(c.vllm_server_timeout > 0, "vllm_server_timeout", "must be > 0 seconds")
    require(0 < c.vllm_server_port < 65536, "vllm_server_port", "must be a TCP port (1-65535)")
    require(c.vllm_mode in ("colocate", "server"), "vllm_mode", f"is {c.vllm_mode!r}; use 'colocate' or 'server'")
    require(
        c.vllm_importance_sampling_mode in IS_MODES,
        "vllm_importance_sampling_mode",
        f"is {c.vllm_importance_sampling_mode!r}; use one of {', '.join(IS_MODES)}",
    )
    low, high = c.vllm_importance_sampling_clip_min, c.vllm_importance_sampling_clip_max
    require(low is None or 0 <= low < math.inf, "vllm_importance_sampling_clip_min", "must be >= 0 (or None)")
    require(high is None or high > 0, "vllm_importance_sampling_clip_max", "must be > 0 (or None: unbounded)")
    require(
        low is None or high is None or low <= high,
        "vllm_importance_sampling_clip_min",
        f"({low}) is above vllm_importance_sampling_clip_max ({high})",
    )
    require(
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
    require(threshold is None or not math.isnan(threshold), "off_policy_mask_threshold", "is NaN; give a number")
    require(0 < c.vllm_gpu_memory_utilization <= 1, "vllm_gpu_memory_utilization", "must be in (0, 1]")
    require(c.vllm_max_model_length is None or c.vllm_max_model_length > 1, "vllm_max_model_length", "must be > 1")
    require(c.vllm_tensor_parallel_size >= 1, "vllm_tensor_parallel_size", "must be >= 1 (processes per engine)")
    gib = c.vllm_kv_cache_gib
    require(gib is None or 0 < gib < math.inf, "vllm_kv_cache_gib", "must be a positive number of GiB (or None)")
