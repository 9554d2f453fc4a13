"""`GRPOConfig`: every knob of a GRPO run, under the names TRL users already type.

One flat dataclass (flat, because `HfArgumentParser` and TRL scripts expect one), grouped below by topic.
Defaults follow TRL 1.16's GRPO defaults (shared spec §1); `max_completion_length` is 256, as the product
document says. `__post_init__` derives the generation batch and rejects bad values with a message that names
the field and the fix; combinations the reference only warns about are checked by the trainer, which warns.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Union

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
SCALE_REWARDS = ("group", "batch", "none")


def _help(text: str, default: Any = None, **kw: Any) -> Any:
    if callable(default) and not isinstance(default, type):
        return field(default_factory=default, metadata={"help": text}, **kw)
    return field(default=default, metadata={"help": text}, **kw)


@dataclass
class GRPOConfig:
    # ---- output, logging, checkpoints -----------------------------------------------------------------------
    output_dir: Optional[str] = _help(
        "Where checkpoints, metrics.jsonl and the final model go. None: '<model name>-GRPO'."
    )
    run_name: Optional[str] = _help("Run name shown to trackers.")
    logging_steps: float = _help("Log every N optimizer steps (a float < 1 is a fraction of max_steps).", 10)
    report_to: Union[None, str, list[str]] = _help(
        "Trackers: 'none', 'all', or names such as 'tensorboard', 'wandb', 'trackio'.", "none"
    )
    save_steps: float = _help("Save a checkpoint every N optimizer steps (float < 1: fraction of max_steps).", 500)
    save_strategy: str = _help("'steps' or 'no'.", "steps")
    save_total_limit: Optional[int] = _help(
        "Keep at most this many checkpoints (the newest); None or a value <= 0: keep all (as the HF Trainer)."
    )
    disable_tqdm: bool = _help("Turn the live progress display off.", False)
    log_completions: bool = _help("Print a sample of completions at each logging step.", False)
    num_completions_to_print: Optional[int] = _help("How many completions log_completions prints (None: all).")

    # ---- optimisation -----------------------------------------------------------------------------------------
    learning_rate: float = _help("AdamW learning rate.", 1e-6)
    per_device_train_batch_size: int = _help("Completions per process per micro-step.", 8)
    gradient_accumulation_steps: int = _help("Micro-steps per optimizer step.", 1)
    num_train_epochs: float = _help("Passes over the prompts (ignored when max_steps > 0).", 3.0)
    max_steps: int = _help("Total optimizer steps; -1 derives it from num_train_epochs.", -1)
    lr_scheduler_type: str = _help("transformers scheduler name: linear, cosine, constant, ...", "linear")
    lr_scheduler_kwargs: Optional[Union[dict, str]] = _help("Extra scheduler arguments.")
    warmup_ratio: float = _help("Fraction of max_steps spent warming up.", 0.0)
    warmup_steps: int = _help("Warm-up steps (overrides warmup_ratio when > 0).", 0)
    weight_decay: float = _help("AdamW weight decay.", 0.0)
    adam_beta1: float = _help("AdamW beta1.", 0.9)
    adam_beta2: float = _help("AdamW beta2.", 0.999)
    adam_epsilon: float = _help("AdamW epsilon.", 1e-8)
    max_grad_norm: float = _help("Gradient clipping norm (0 disables).", 1.0)
    seed: int = _help("Seed for sampling prompts, generation and initialisation.", 42)
    bf16: Optional[bool] = _help(
        "bfloat16 compute over float32 master weights. None: on where the hardware "
        "has fast bfloat16 (CUDA with bf16, CPUs with AMX/AVX512-BF16)."
    )
    fp16: bool = _help("float16 mixed precision (CUDA only).", False)
    gradient_checkpointing: bool = _help("Recompute activations in the backward pass to save memory.", True)
    gradient_checkpointing_kwargs: Optional[Union[dict, str]] = _help("Passed to gradient_checkpointing_enable.")
    use_cpu: bool = _help("Train on the CPU even when an accelerator is present.", False)

    # ---- model --------------------------------------------------------------------------------------------------
    model_init_kwargs: Optional[Union[dict, str]] = _help(
        "from_pretrained kwargs when `model` is a string (dtype float32 unless given)."
    )
    trust_remote_code: bool = _help("Allow custom model code from the model repository.", False)
    disable_dropout: bool = _help("Set every dropout probability to 0 in the policy and reference.", False)

    # ---- data and generation -------------------------------------------------------------------------------------
    num_generations: int = _help("Completions per prompt (the group size G).", 8)
    max_completion_length: Optional[int] = _help("Most tokens generated per completion.", 256)
    shuffle_dataset: bool = _help("Shuffle prompts each epoch.", True)
    generation_batch_size: Optional[int] = _help(
        "Completions per generation, all processes together (set this or steps_per_generation)."
    )
    steps_per_generation: Optional[int] = _help(
        "Micro-steps fed by one generation (default: gradient_accumulation_steps)."
    )
    temperature: float = _help("Sampling temperature.", 1.0)
    top_p: float = _help("Nucleus sampling cutoff.", 1.0)
    top_k: int = _help("Keep only the k most likely tokens (0 disables).", 0)
    min_p: Optional[float] = _help("Drop tokens below min_p times the top probability.")
    repetition_penalty: float = _help("Penalty for tokens already present (1.0 disables).", 1.0)
    generation_kwargs: Optional[Union[dict, str]] = _help(
        "Extra generation parameters, applied over the built-in ones."
    )
    chat_template_kwargs: Optional[Union[dict, str]] = _help("Passed to every apply_chat_template call.")
    cache_implementation: Optional[str] = _help("transformers KV-cache implementation for generation.")

    # ---- loss ---------------------------------------------------------------------------------------------------
    beta: float = _help("KL coefficient against a frozen reference model (0: no reference is loaded).", 0.0)
    num_iterations: int = _help("Optimisation passes per generated batch (mu).", 1)
    epsilon: float = _help("Lower clipping range of the policy ratio.", 0.2)
    epsilon_high: Optional[float] = _help("Upper clipping range (None: epsilon). cispo: absolute ratio cap.")
    delta: Optional[float] = _help("Two-sided clipping: cap of the unclipped ratio (INTELLECT-2).")
    importance_sampling_level: str = _help("'token', or 'sequence' (GSPO).", "token")
    loss_type: str = _help("One of: " + ", ".join(LOSS_TYPES) + ".", "dapo")
    scale_rewards: str = _help("'group', 'batch' or 'none' (True = 'group', False = 'none').", "group")
    reward_weights: Optional[list[float]] = _help("One weight per reward function (None: all 1.0).")
    reward_timeout: Optional[float] = _help(
        "Seconds one call of a reward function may take; a call that takes longer stops training with an error "
        "naming the function (None or 0: no limit).",
        600.0,
    )
    multi_objective_aggregation: str = _help(
        "'sum_then_normalize' or 'normalize_then_sum' (GDPO).", "sum_then_normalize"
    )
    mask_truncated_completions: bool = _help("Leave truncated completions out of the loss.", False)
    dynamic_sampling: bool = _help(
        "DAPO dynamic sampling: drop groups whose rewards barely differ (they carry no "
        "policy gradient) and generate more prompts until the batch is full.",
        False,
    )
    dynamic_sampling_std_threshold: float = _help("A group is dropped when its reward std is below this.", 1e-6)
    dynamic_sampling_max_attempts: int = _help(
        "Most generation rounds per batch with dynamic_sampling; a batch still short then trains on the groups it has.",
        4,
    )
    top_entropy_quantile: float = _help("Train only on tokens in this top fraction of entropy.", 1.0)
    use_bias_correction_kl: bool = _help("Multiply the KL term by the importance ratio.", False)
    entropy_coef: float = _help("Entropy bonus coefficient (0 disables).", 0.0)
    sapo_temperature_pos: float = _help("SAPO temperature for positive advantages.", 1.0)
    sapo_temperature_neg: float = _help("SAPO temperature for negative advantages.", 1.05)
    vespo_k_pos: float = _help("VESPO k for non-negative advantages.", 2.0)
    vespo_lambda_pos: float = _help("VESPO lambda for non-negative advantages.", 3.0)
    vespo_k_neg: float = _help("VESPO k for negative advantages.", 3.0)
    vespo_lambda_neg: float = _help("VESPO lambda for negative advantages.", 2.0)
    off_policy_mask_threshold: Optional[float] = _help("Off-policy sequence mask threshold (OPSM); not yet available.")

    # ---- grpo's performance settings (not in TRL) ---------------------------------------------------------------
    lean_linears: bool = _help(
        "bf16 training pass: linear layers keep their float32 weights for backward instead of "
        "bfloat16 copies (autocast's numbers; measured -0.22 GB peak, ~10% slower training "
        "pass on the benchmark), so off by default.",
        False,
    )
    cpu_keep_freed_memory: bool = _help(
        "CPU runs: have glibc keep freed memory for reuse instead of returning it to "
        "the kernel (process-wide; measured ~1-4 s less page-faulting per training "
        "pass on the benchmark, same peak). False keeps the system's policy.",
        True,
    )

    # ---- later features, declared so TRL configs parse (each raises a clear error until it lands) ----------
    use_vllm: bool = _help("Generate with vLLM (not available yet).", False)
    vllm_mode: str = _help("'colocate' or 'server'.", "colocate")
    vllm_gpu_memory_utilization: float = _help("GPU memory fraction for vLLM in colocate mode.", 0.3)
    vllm_importance_sampling_correction: bool = _help("Correct for sampler/trainer mismatch.", True)
    max_tool_calling_iterations: Optional[int] = _help("Most tool-calling rounds per completion.")

    def __post_init__(self) -> None:
        for name in (
            "generation_kwargs",
            "chat_template_kwargs",
            "model_init_kwargs",
            "lr_scheduler_kwargs",
            "gradient_checkpointing_kwargs",
        ):
            value = getattr(self, name)
            if isinstance(value, str):  # command lines pass dicts as JSON
                setattr(self, name, json.loads(value))
        self.scale_rewards = _parse_scale_rewards(self.scale_rewards)
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.output_dir is not None:
            self.output_dir = os.fspath(self.output_dir)
        if self.save_total_limit is not None and self.save_total_limit <= 0:
            self.save_total_limit = None  # the HF Trainer's meaning: no limit
        _check_numbers(self)
        self._derive_generation_batch()
        _validate(self)

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
        return dataclasses.asdict(self)


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
    is inf and inf or NaN turn into NaN weights or zero gradients."""
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


def _validate(c: GRPOConfig) -> None:
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
    _require(c.learning_rate >= 0, "learning_rate", "must be >= 0")
    _require(
        c.reward_timeout is None or c.reward_timeout >= 0,
        "reward_timeout",
        "must be >= 0 seconds (0 or None: no limit)",
    )
    _require(
        c.max_steps != 0 and (c.max_steps > 0 or c.num_train_epochs > 0),
        "max_steps",
        "is 0 (or num_train_epochs is 0): nothing would be trained; set max_steps > 0 or num_train_epochs > 0",
    )
    _require(c.logging_steps > 0 and c.save_steps > 0, "logging_steps", "and save_steps must be > 0")
    _require(c.save_strategy in ("steps", "no"), "save_strategy", "must be 'steps' or 'no'")
    _require(not (c.bf16 and c.fp16), "bf16", "and fp16 are both set; choose one precision")
    _require(
        c.sapo_temperature_pos > 0 and c.sapo_temperature_neg > 0,
        "sapo_temperature_pos",
        "and sapo_temperature_neg must be > 0",
    )
    _require(c.vllm_mode in ("colocate", "server"), "vllm_mode", "must be 'colocate' or 'server'")
    _require(
        c.reward_weights is None or len(c.reward_weights) > 0,
        "reward_weights",
        "is empty; give one weight per reward function or None",
    )
    _require(
        c.off_policy_mask_threshold is None, "off_policy_mask_threshold", "(OPSM) is not available yet; leave it None"
    )


def _reject_unknown_kwargs(init):
    """Turn dataclass's bare 'unexpected keyword' TypeError into one that names the nearest valid field."""
    names = [f.name for f in dataclasses.fields(GRPOConfig)]

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        for key in kwargs:
            if key not in names:
                near = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
                hint = f"; did you mean {near[0]!r}?" if near else "; see GRPOConfig's fields for valid names"
                raise TypeError(f"GRPOConfig got an unknown argument {key!r}{hint}")
        init(self, *args, **kwargs)

    return checked_init


GRPOConfig.__init__ = _reject_unknown_kwargs(GRPOConfig.__init__)


def warn_odd_combinations(a: GRPOConfig) -> None:
    """Combinations the reference accepts with a warning (shared spec §1.7)."""
    if a.loss_type == "luspo" and a.importance_sampling_level != "sequence":
        warnings.warn("loss_type='luspo' is meant for importance_sampling_level='sequence'.", stacklevel=3)
    if a.loss_type == "vespo" and a.importance_sampling_level != "token":
        warnings.warn(
            "loss_type='vespo' computes its own sequence weight; use importance_sampling_level='token'.", stacklevel=3
        )
    if a.importance_sampling_level == "sequence" and a.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        warnings.warn(
            f"importance_sampling_level='sequence' with loss_type='{a.loss_type}' weights each sequence "
            "by its completion length; GSPO normalizes per sequence (loss_type='grpo').",
            stacklevel=3,
        )
    if a.delta is not None and a.delta <= 1 + a.epsilon_high:
        warnings.warn(
            f"delta={a.delta} is not above 1 + epsilon_high; it will also cap the clipped branch.", stacklevel=3
        )


def reject_later_features(args: GRPOConfig, tools: Any, rollout_func: Any, eval_dataset: Any, callbacks: Any) -> None:
    """Features of the product document that later issues bring: an error (or, where ignoring is harmless, a
    warning) that says so."""

    def not_yet(feature: str, issue: str) -> ValueError:
        return ValueError(f"{feature} is not available yet in grpo ({issue}); remove it to train without it.")

    if args.use_vllm:
        raise not_yet("use_vllm=True (vLLM generation)", "it comes with the vLLM issue")
    if tools:
        raise not_yet("tools= (tool-calling rollouts)", "it comes with the agent issue")
    if rollout_func is not None:
        raise not_yet("rollout_func", "custom rollouts come with the agent issue")
    if eval_dataset is not None:
        warnings.warn("eval_dataset is ignored: evaluation during training is not available yet in grpo.", stacklevel=3)
    if callbacks:
        warnings.warn("callbacks are ignored: grpo does not run transformers callbacks.", stacklevel=3)
