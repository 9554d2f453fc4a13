"""The fields a TRL 1.16 `GRPOConfig` inherits from `transformers.TrainingArguments` (transformers 5.24), with
TRL's defaults. What each does in grpo, or why it does nothing here, is in `trl_1_16_fields.md`; a value grpo
cannot honour is refused or warned about by `grpo.config.compat`, never silently dropped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from grpo.config.fields import help_field as _help


@dataclass
class OutputFields:
    output_dir: Optional[str] = _help(
        "Where checkpoints, metrics.jsonl and the final model go. None: '<model name>-GRPO'."
    )
    resume_from_checkpoint: Optional[str] = _help(
        "A checkpoint to resume from when train() is called without one ('true': the newest in output_dir)."
    )


@dataclass
class OptimizationFields:
    per_device_train_batch_size: int = _help("Completions per process per micro-step.", 8)
    gradient_accumulation_steps: int = _help("Micro-steps per optimizer step.", 1)
    num_train_epochs: float = _help("Passes over the prompts (ignored when max_steps > 0).", 3.0)
    max_steps: int = _help("Total optimizer steps; -1 derives it from num_train_epochs.", -1)
    learning_rate: float = _help("Initial learning rate.", 1e-6)
    lr_scheduler_type: str = _help("transformers scheduler name: linear, cosine, constant, ...", "linear")
    lr_scheduler_kwargs: Optional[Union[dict, str]] = _help("Extra scheduler arguments, e.g. {'num_cycles': 1}.")
    warmup_steps: float = _help("Warm-up steps; a value in (0, 1) is a fraction of the total steps.", 0)
    warmup_ratio: Optional[float] = _help(
        "Older transformers' name for a fractional warm-up (warmup_steps < 1 is the same); None: unused.", None
    )
    optim: str = _help(
        "Optimizer: adamw_torch, adamw_torch_fused, sgd, adagrad, rmsprop, adafactor, or a bitsandbytes one "
        "(adamw_8bit, paged_adamw_8bit, paged_adamw_32bit, lion_8bit, ...).",
        "adamw_torch_fused",
    )
    optim_args: Optional[str] = _help("Extra optimizer arguments as 'key=value,key=value'.")
    optim_target_modules: Union[None, str, list[str]] = _help("Modules for GaLore/APOLLO-style optimizers.")
    weight_decay: float = _help("Weight decay (not applied to biases and norms).", 0.0)
    adam_beta1: float = _help("Adam beta1.", 0.9)
    adam_beta2: float = _help("Adam beta2.", 0.999)
    adam_epsilon: float = _help("Adam epsilon.", 1e-8)
    max_grad_norm: float = _help("Gradient clipping norm (0 disables).", 1.0)
    average_tokens_across_devices: bool = _help(
        "Normalise the loss by the tokens of every process (dapo/cispo/vespo), not each process's own.", True
    )
    label_smoothing_factor: float = _help("Supervised-learning label smoothing; GRPO has no labels.", 0.0)
    neftune_noise_alpha: Optional[float] = _help("NEFTune embedding noise (a supervised fine-tuning technique).")
    auto_find_batch_size: bool = _help("Halve the batch on out-of-memory (GRPO cannot: groups must stay whole).", False)
    seed: int = _help("Seed for initialisation, generation and (unless data_seed) the prompt order.", 42)
    data_seed: Optional[int] = _help("Seed of the prompt order only (None: seed).")
    full_determinism: bool = _help("Seed and switch torch to deterministic algorithms (slower).", False)


@dataclass
class PrecisionFields:
    bf16: Optional[bool] = _help(
        "bfloat16 compute over float32 master weights. None: on where bfloat16 is native and fast (CUDA GPUs of "
        "compute capability 8.0 or more, CPUs with AMX or AVX512-BF16)."
    )
    fp16: bool = _help("float16 mixed precision with loss scaling (GPUs; on a CPU it warns and runs float32).", False)
    bf16_full_eval: bool = _help("Evaluate in bfloat16.", False)
    fp16_full_eval: bool = _help("Evaluate in float16.", False)
    tf32: Optional[bool] = _help("TF32 matmuls on NVIDIA Ampere+ GPUs (None: torch's default; on with torch_compile).")
    gradient_checkpointing: bool = _help("Recompute activations in the backward pass to save memory.", True)
    gradient_checkpointing_kwargs: Optional[Union[dict, str]] = _help(
        "use_reentrant (default False) and other torch.utils.checkpoint keywords, every_n_layers, offload."
    )
    activation_checkpointing: Optional[bool] = _help(
        "transformers 5.24's name of gradient_checkpointing: set, it wins (None: gradient_checkpointing decides)."
    )
    activation_checkpointing_kwargs: Optional[Union[dict, str]] = _help(
        "transformers 5.24's name of gradient_checkpointing_kwargs: set, it wins."
    )
    torch_compile: bool = _help("Compile the policy's training forward (its decoder stack) with torch.compile.", False)
    torch_compile_backend: Optional[str] = _help("torch.compile backend (None: inductor); setting it turns it on.")
    torch_compile_mode: Optional[str] = _help("torch.compile mode (setting it turns torch_compile on).")
    use_liger_kernel: bool = _help("Patch layers with Liger's Triton kernels (deprecated in TRL).", False)
    liger_kernel_config: Optional[dict] = _help("Which Liger kernels to apply.")
    use_cache: bool = _help("The models' config.use_cache in training forwards (generation always caches).", False)
    torch_empty_cache_steps: Optional[int] = _help(
        "Every N optimizer steps return cached allocator memory (CUDA: empty_cache; CPU: glibc malloc_trim)."
    )
    use_cpu: bool = _help("Train on the CPU even when an accelerator is present.", False)


@dataclass
class LoggingFields:
    logging_strategy: str = _help(
        "'steps' (every logging_steps), 'epoch' (each epoch's end) or 'no' (no metrics rows); 'steps' and 'epoch' "
        "also log the last step.",
        "steps",
    )
    logging_steps: float = _help("Log every N optimizer steps (a float < 1 is a fraction of max_steps).", 10)
    logging_first_step: bool = _help("Also log the first step (whatever logging_strategy says).", False)
    log_on_each_node: bool = _help(
        "Multi-node runs: each node's first process takes log_level (the others log_level_replica); False: only "
        "the run's first process does.",
        True,
    )
    logging_nan_inf_filter: bool = _help(
        "HF: leave NaN/inf losses out of the logged mean. grpo stops at a non-finite loss, so it has no effect.", True
    )
    # str, not TRL's `str | bool`: HfArgumentParser turns that into a bool flag, which refuses "non_padding"
    include_num_input_tokens_seen: str = _help(
        "Log num_input_tokens_seen, the prompt + completion tokens of the generated rows trained on: 'all' (or "
        "True: the padded training batch), 'non_padding' (TRL's num_tokens), or 'no' (False).",
        "no",
    )
    log_level: str = _help(
        "Level of the 'grpo' logger and transformers' logging on main processes: debug..critical; passive: as is.",
        "passive",
    )
    log_level_replica: str = _help("The same on the other processes.", "warning")
    disable_tqdm: Optional[bool] = _help(
        "Turn the live progress display off (None: off when the 'grpo' logger is quieter than warning)."
    )
    report_to: Union[None, str, list[str]] = _help(
        "Trackers: 'none', 'all', or names such as 'tensorboard', 'wandb', 'trackio'.", "none"
    )
    run_name: Optional[str] = _help(
        "The run's name in trackers (TensorBoard: <output_dir>/<project>/<run_name>). None: each tracker names it "
        "(TensorBoard: <month><day>_<time>_<host>)."
    )
    project: str = _help(
        "The trackers' project the run is logged under (at its default, wandb still reads WANDB_PROJECT).",
        "huggingface",
    )
    trackio_space_id: Optional[str] = _help("trackio: Hugging Face Space that hosts the dashboard.")
    trackio_bucket_id: Optional[str] = _help("trackio: bucket that stores the run.")
    trackio_static_space_id: Optional[str] = _help("trackio: static Space for the dashboard.")
    skip_memory_metrics: bool = _help(
        "HF: False adds each phase's memory use to the metrics. grpo does not measure it, so it has no effect.", True
    )
    debug: Union[str, list[str]] = _help("transformers debug modes (underflow_overflow, tpu_metrics_debug).", "")


@dataclass
class CheckpointFields:
    save_strategy: str = _help("'steps', 'epoch', 'best' (on metric_for_best_model) or 'no'.", "steps")
    save_steps: float = _help("Save every N optimizer steps (float < 1: fraction of max_steps).", 500)
    save_total_limit: Optional[int] = _help(
        "Keep at most this many checkpoints (the newest, and the best one); None or <= 0: keep all."
    )
    save_only_model: bool = _help(
        "Save the model only, not optimizer, schedule and RNG (such a checkpoint cannot resume).", False
    )
    save_on_each_node: bool = _help(
        "Multi-node runs: every node's first process writes checkpoints (no shared disk).", False
    )
    enable_jit_checkpoint: bool = _help(
        "grpo always saves the last complete step on SIGTERM and exits with status 143; True says so.", False
    )
    load_best_model_at_end: bool = _help(
        "At the end, load the best checkpoint's model (needs metric_for_best_model).", False
    )
    metric_for_best_model: Optional[str] = _help(
        "The logged metric that ranks checkpoints (e.g. 'reward', 'loss'; an 'eval_' prefix is accepted)."
    )
    greater_is_better: Optional[bool] = _help(
        "Whether a larger metric is better (None: False for names ending in 'loss')."
    )
    ignore_data_skip: bool = _help(
        "On resume, restart the prompt order at the beginning of the checkpoint's epoch instead of where it was.", False
    )
    restore_callback_states_from_checkpoint: bool = _help("Restore callbacks' states on resume.", False)


@dataclass
class EvaluationFields:
    eval_strategy: str = _help("'no', 'steps' or 'epoch'.", "no")
    eval_steps: Optional[float] = _help("Evaluate every N steps.")
    eval_delay: float = _help("Steps to wait before the first evaluation.", 0)
    per_device_eval_batch_size: int = _help("Completions per process per evaluation batch.", 8)
    prediction_loss_only: bool = _help("Evaluation: return the loss only.", False)
    eval_on_start: bool = _help("Evaluate before the first step.", False)
    eval_do_concat_batches: bool = _help("Concatenate evaluation batches.", True)
    eval_use_gather_object: bool = _help("Gather evaluation objects across processes.", False)
    eval_accumulation_steps: Optional[int] = _help("Move evaluation outputs to the CPU every N steps.")
    include_for_metrics: list[str] = _help("Extra inputs for compute_metrics.", list)
    batch_eval_metrics: bool = _help("Call compute_metrics per batch.", False)
    do_train: bool = _help("A flag for your script (the trainer does not read it).", False)
    do_eval: bool = _help("A flag for your script; with eval_strategy it enables the eval batch check.", False)
    do_predict: bool = _help("A flag for your script (the trainer does not read it).", False)


@dataclass
class HubFields:
    push_to_hub: bool = _help("Upload the model to the Hugging Face Hub.", False)
    hub_token: Optional[str] = _help("Hub token.")
    hub_private_repo: Optional[bool] = _help("Make the Hub repository private.")
    hub_model_id: Optional[str] = _help("Hub repository name.")
    hub_strategy: str = _help("When to upload: every_save, end, checkpoint, all_checkpoints.", "every_save")
    hub_always_push: bool = _help("Upload even while a previous upload runs.", False)
    hub_revision: Optional[str] = _help("Hub branch to upload to.")


@dataclass
class DistributedFields:
    local_rank: int = _help("Set by launchers; grpo reads LOCAL_RANK from the environment.", -1)
    ddp_find_unused_parameters: Optional[bool] = _help("DDP find_unused_parameters (None: DDP's default, off).")
    ddp_bucket_cap_mb: Optional[int] = _help("DDP gradient bucket size.")
    ddp_broadcast_buffers: Optional[bool] = _help("DDP broadcast_buffers.")
    ddp_static_graph: Optional[bool] = _help("DDP static_graph.")
    ddp_backend: Optional[str] = _help("Process-group backend: nccl, gloo, ... (None: accelerate's choice).")
    ddp_timeout: int = _help("Process-group timeout in seconds.", 1800)
    fsdp: Optional[str] = _help("FSDP options ('full_shard auto_wrap', ...); usually set by accelerate config.")
    fsdp_config: Optional[Union[dict, str]] = _help("FSDP settings.")
    deepspeed: Optional[Union[dict, str]] = _help("DeepSpeed config (a dict or a JSON file path).")
    accelerator_config: Optional[Union[dict, str]] = _help("accelerate Accelerator options.")
    parallelism_config: Optional[Union[dict, str]] = _help("accelerate ParallelismConfig (tensor/context parallelism).")
    dataloader_drop_last: bool = _help("Drop the last incomplete batch.", False)
    dataloader_num_workers: int = _help("Data-loading worker processes.", 0)
    dataloader_pin_memory: bool = _help("Pin data-loader memory.", True)
    dataloader_persistent_workers: bool = _help("Keep data-loader workers alive.", False)
    dataloader_prefetch_factor: Optional[int] = _help("Batches prefetched per worker.")
    dataloader_multiprocessing_context: Optional[str] = _help("Worker start method.")
    dataloader_in_order: bool = _help("Yield batches in order.", True)
    remove_unused_columns: Optional[bool] = _help(
        "True: reward functions get only the prompt (and image) columns, not the dataset's other columns.", False
    )
    label_names: Optional[list[str]] = _help("Label columns (supervised learning).")
    train_sampling_strategy: str = _help("Sampler: 'random', 'sequential', 'group_by_length'.", "random")
    length_column_name: str = _help("Column with lengths for group_by_length.", "length")
