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
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from grpo.base import secrets
from grpo.config import compat
from grpo.config.grpo_fields import (
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
from grpo.config.validation import check_numbers, require, validate

__all__ = ["GRPOConfig", "LOSS_TYPES", "ResolvedConfig", "warn_odd_combinations"]

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
        check_numbers(self)
        self._derive_generation_batch()
        validate(self)

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
            require(0 <= self.warmup_ratio < 1, "warmup_ratio", "must be in [0, 1)")
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
        require(per_step > 0, "per_device_train_batch_size", "must be at least 1")
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
    """Combinations the reference accepts with a warning (shared spec §1.7), pointing at the GRPOTrainer(...) call
    (through `grpo.assembly.assemble`)."""
    if a.loss_type == "luspo" and a.importance_sampling_level != "sequence":
        warnings.warn("loss_type='luspo' is meant for importance_sampling_level='sequence'.", stacklevel=4)
    if a.loss_type == "vespo" and a.importance_sampling_level != "token":
        warnings.warn(
            "loss_type='vespo' computes its own sequence weight; use importance_sampling_level='token'.", stacklevel=4
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
            f"delta={a.delta} is not above 1 + epsilon_high; it will also cap the clipped branch.", stacklevel=4
        )


if TYPE_CHECKING:
    from transformers.trainer_pt_utils import AcceleratorConfig

    class ResolvedConfig(GRPOConfig):
        """A GRPOConfig after `__post_init__` and `resolve_args`, as the type checker should see it: the fields
        that the command line lets be None or text are resolved (their checks are `_check`'s)."""

        output_dir: str
        generation_batch_size: int
        steps_per_generation: int
        max_completion_length: int
        pad_to_multiple_of: int | None
        epsilon_high: float
        debug: str
        disable_tqdm: bool
        # __post_init__ makes the command line's dict or JSON text transformers' object; the field's own type is the
        # command line's (HfArgumentParser parses by it)
        accelerator_config: AcceleratorConfig  # type: ignore[assignment]
        generation_kwargs: dict | None
        chat_template_kwargs: dict | None
        model_init_kwargs: dict | None
        lr_scheduler_kwargs: dict | None
        gradient_checkpointing_kwargs: dict | None
        activation_checkpointing_kwargs: dict | None
        transformers_continuous_batching_config: dict | None
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
