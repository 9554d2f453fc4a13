"""The fields TRL 1.16's `GRPOConfig` adds to `TrainingArguments`, with 1.16's defaults (except
`max_completion_length`, shared spec §1), and grpo's own settings (marked "grpo only" in `trl_1_16_fields.md`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from grpo.config.fields import help_field as _help

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# vllm_importance_sampling_mode values (TRL 1.16)
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass
class ModelFields:
    model_init_kwargs: Optional[Union[dict, str]] = _help(
        "from_pretrained kwargs when `model` is a string (dtype float32 unless given)."
    )
    trust_remote_code: bool = _help("Allow custom model code from the model repository.", False)
    router_aux_loss_coef: Optional[float] = _help(
        "Mixture-of-experts models: weight of the router's load-balancing loss (None: the model config's own)."
    )
    disable_dropout: bool = _help(
        "Set every dropout probability of the policy to 0: its Dropout modules (LoRA's included) and the ones its "
        "layers pass to functional dropout (attention_dropout, ...).",
        False,
    )
    cast_lm_head_to_fp32: bool = _help("Keep the output projection's weights in float32 and project in float32.", False)


@dataclass
class GenerationFields:
    num_generations: int = _help("Completions per prompt (the group size G).", 8)
    num_generations_eval: Optional[int] = _help("Completions per prompt in evaluation (None: num_generations).")
    max_completion_length: Optional[int] = _help("Most tokens generated per completion.", 256)
    ds3_gather_for_generation: bool = _help("DeepSpeed ZeRO-3: gather the full weights for generation.", True)
    shuffle_dataset: bool = _help("Shuffle prompts each epoch.", True)
    pad_to_multiple_of: Union[int, str, None] = _help(
        "Pad training sequences to a multiple of this many tokens ('auto': 128 on Neuron, else none).", "auto"
    )
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
    generation_kwargs: Optional[Union[dict, str]] = _help(
        "Extra generation parameters, applied over the built-in ones."
    )
    chat_template_kwargs: Optional[Union[dict, str]] = _help("Passed to every apply_chat_template call.")
    repetition_penalty: float = _help("Penalty for tokens already present (1.0 disables).", 1.0)
    cache_implementation: Optional[str] = _help("transformers KV-cache implementation for generation.")
    use_transformers_continuous_batching: bool = _help("Generate with transformers' continuous batching.", False)
    transformers_continuous_batching_config: Optional[Union[dict, str]] = _help("Its settings.")
    use_transformers_paged: bool = _help("Deprecated name of use_transformers_continuous_batching.", False)


@dataclass
class VLLMFields:
    use_vllm: bool = _help("Generate with vLLM.", False)
    vllm_mode: str = _help("'colocate' or 'server'.", "colocate")
    vllm_model_impl: str = _help("vLLM model implementation: 'vllm' or 'transformers'.", "vllm")
    vllm_enable_sleep_mode: bool = _help("Colocate: free vLLM's memory during the training pass.", False)
    vllm_structured_outputs_regex: Optional[str] = _help("Constrain completions to a regular expression.")
    vllm_server_base_url: Optional[str] = _help(
        "Server mode: the server's URL (overrides host and port); several servers comma-separated (or a list)."
    )
    vllm_server_host: str = _help("Server mode: the server's address.", "0.0.0.0")
    vllm_server_port: int = _help("Server mode: the server's port.", 8000)
    vllm_server_timeout: float = _help("Server mode: seconds to wait for the server.", 240.0)
    vllm_group_port: int = _help(
        "Server mode: the port the weight-transfer group of server i starts from (+ i).", 51216
    )
    vllm_gpu_memory_utilization: float = _help("Colocate: GPU memory fraction for vLLM.", 0.3)
    vllm_max_model_length: Optional[int] = _help("Colocate: vLLM's context length (None: the model's).")
    vllm_tensor_parallel_size: int = _help(
        "Colocate: vLLM tensor-parallel size; each group of this many training processes shares one engine.", 1
    )
    vllm_importance_sampling_correction: bool = _help("Correct for sampler/trainer mismatch.", True)
    vllm_importance_sampling_mode: str = _help(
        "token_truncate, token_mask, sequence_truncate or sequence_mask.", "sequence_mask"
    )
    vllm_importance_sampling_clip_max: Optional[float] = _help("Upper bound of the correction ratio.", 3.0)
    vllm_importance_sampling_clip_min: Optional[float] = _help("Lower bound of the correction ratio.")
    vllm_importance_sampling_cap: Optional[float] = _help("Deprecated name of vllm_importance_sampling_clip_max.")


@dataclass
class LossFields:
    beta: float = _help("KL coefficient against a frozen reference model (0: no reference is loaded).", 0.0)
    num_iterations: int = _help("Optimisation passes per generated batch (mu).", 1)
    epsilon: float = _help("Lower clipping range of the policy ratio.", 0.2)
    delta: Optional[float] = _help("Two-sided clipping: cap of the unclipped ratio (INTELLECT-2).")
    epsilon_high: Optional[float] = _help("Upper clipping range (None: epsilon). cispo: absolute ratio cap.")
    sapo_temperature_neg: float = _help("SAPO temperature for negative advantages.", 1.05)
    sapo_temperature_pos: float = _help("SAPO temperature for positive advantages.", 1.0)
    vespo_k_pos: float = _help("VESPO k for non-negative advantages.", 2.0)
    vespo_lambda_pos: float = _help("VESPO lambda for non-negative advantages.", 3.0)
    vespo_k_neg: float = _help("VESPO k for negative advantages.", 3.0)
    vespo_lambda_neg: float = _help("VESPO lambda for negative advantages.", 2.0)
    importance_sampling_level: str = _help("'token', or 'sequence' (GSPO).", "token")
    reward_weights: Optional[list[float]] = _help("One weight per reward function (None: all 1.0).")
    multi_objective_aggregation: str = _help(
        "'sum_then_normalize' or 'normalize_then_sum' (GDPO).", "sum_then_normalize"
    )
    scale_rewards: str = _help("'group', 'batch' or 'none' (True = 'group', False = 'none').", "group")
    loss_type: str = _help("One of: " + ", ".join(LOSS_TYPES) + ".", "dapo")
    mask_truncated_completions: bool = _help("Leave truncated completions out of the loss.", False)
    sync_ref_model: bool = _help("TR-DPO: every ref_model_sync_steps steps, mix the policy into the reference.", False)
    ref_model_mixup_alpha: float = _help("TR-DPO: ref <- alpha * policy + (1 - alpha) * ref.", 0.6)
    ref_model_sync_steps: int = _help("TR-DPO: steps between reference updates.", 512)
    top_entropy_quantile: float = _help("Train only on tokens in this top fraction of entropy.", 1.0)
    entropy_coef: float = _help("Entropy bonus coefficient (0 disables; the start value when adaptive).", 0.0)
    use_adaptive_entropy: bool = _help("Adjust entropy_coef each step to hold the entropy near entropy_target.", False)
    entropy_coef_min: float = _help("Adaptive entropy: lowest coefficient.", 0.0)
    entropy_coef_max: float = _help("Adaptive entropy: highest coefficient.", 1.0)
    entropy_coef_delta: float = _help("Adaptive entropy: change of the coefficient per step.", 0.005)
    entropy_target: float = _help("Adaptive entropy: the entropy (nats per token) to hold.", 0.2)
    max_tool_calling_iterations: Optional[int] = _help("Most tool-calling rounds per completion (None: no limit).")
    off_policy_mask_threshold: Optional[float] = _help("Off-policy sequence mask threshold (OPSM, DeepSeek-V3.2).")
    use_bias_correction_kl: bool = _help("Multiply the per-token KL term by the (detached) policy ratio.", True)


@dataclass
class CompletionLogFields:
    log_completions: bool = _help("Print a sample of completions at each logging step.", False)
    log_multimodal: bool = _help("Log the images of multimodal prompts with the completions.", True)
    num_completions_to_print: Optional[int] = _help(
        "How many completions log_completions prints (None: all; 0: none, the files are still written)."
    )
    log_unique_prompts: bool = _help(
        "In the completions table, show each prompt once (its first row); the parquet file keeps every row.", False
    )
    log_completions_hub_repo: Optional[str] = _help("Hub dataset repository the completions are uploaded to.")


@dataclass
class GrpoOnlyFields:
    """Settings TRL does not have."""

    reward_timeout: Optional[float] = _help(
        "Seconds one call of a reward function may take; a call that takes longer stops training with an error "
        "naming the function (None or 0: no limit).",
        600.0,
    )
    tool_call_timeout: Optional[float] = _help(
        "Seconds one tool call may take; a call that takes longer is abandoned and the model gets an error message "
        "(it counts in tools/failure_frequency). None or 0: no limit.",
        60.0,
    )
    run_report: bool = _help(
        "Write <output_dir>/report.html (main process): diagnostics, charts of the metrics, sampled completions, the "
        "configuration and versions; refreshed at logging steps (at most 2 percent of the run's time) and at the end. "
        "False: no page (`grpo report <output_dir>` can still build one from the run's files).",
        True,
    )
    hub_upload_run_files: bool = _help(
        "push_to_hub: also upload the run's own files in output_dir (report.html, run_info.json, metrics.jsonl, the "
        "completions parquet files with the dataset's prompts) beside the model. False: a push sends the model, its "
        "tokenizer or processor and its card (README.md) only. Checkpoint pushes (hub_strategy 'checkpoint', "
        "'all_checkpoints') always send the whole checkpoint.",
        False,
    )
    eval_greedy: bool = _help(
        "Evaluation samples one greedy completion per prompt (temperature 0 / top_k=1) instead of "
        "num_generations_eval sampled ones.",
        False,
    )
    eval_pass_threshold: float = _help(
        "eval_pass@k counts a prompt as passed when one of its k completions has a weighted reward sum at least "
        "this (1.0: a correctness reward's full mark).",
        1.0,
    )
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
    async_generation: bool = _help(
        "Generate while training: a producer thread samples the next generation batches from a snapshot of the "
        "policy max_staleness generations old while the learner trains (`grpo.rounds.asynchronous`); the same "
        "seed gives the same run whatever the timing, and a resume is exact, in-flight rounds included.",
        False,
    )
    max_staleness: int = _help(
        "async_generation: generation round k is sampled with the policy the learner had when it asked for round "
        "k - max_staleness (the first max_staleness rounds: the initial policy); 0 is on-policy (no overlap). "
        "AsyncGRPOConfig's default is TRL's, 4.",
        1,
    )
    async_behaviour_logps: str = _help(
        "async_generation: the behaviour policy's log-probs (the learner's old_logps). 'training': the producer runs "
        "the training pass over each round on its snapshot (exact, one more forward per round); 'sampler': the "
        "engine's own sampling log-probs, as TRL's AsyncGRPOTrainer takes vLLM's (no extra forward; they differ from "
        "the training pass by the engine's rounding, which the sampling/* metrics show).",
        "training",
    )
    weight_sync_steps: int = _help(
        "async_generation: the producer's snapshot takes the learner's weights at the first round asked for after "
        "every weight_sync_steps optimizer steps (1: every step), as TRL's AsyncGRPOConfig.",
        1,
    )
    heartbeat_stale_after_s: float = _help(
        "async_generation: seconds the learner waits on a producer that makes no progress (no token sampled, no "
        "reward or tool call finished) before stopping the run with an error naming what it was doing.",
        300.0,
    )
    packing: str | None = _help(
        "How the training pass lays out a micro-batch. 'padded': each completion a row, padded to the longest, "
        "each prompt once when the model allows (its KV cache shared). 'tree': one token tree per prompt group: "
        "the prompt once and each completion's tokens unpadded, attending through an ancestor mask "
        "(`grpo.learner.tree`; FlexAttention on CUDA); the same numbers, fewer positions computed (an image "
        "prompt's image once per group too). 'auto': each "
        "micro-batch piece as trees where a cost model of tokens and attention pairs puts them below the padded "
        "rows, else padded (rows with rendered turns always as trees). None (the default): 'auto' where the model "
        "trains on the CPU (at least as fast as 'padded' on every workload measured there), 'padded' elsewhere "
        "until measured on a GPU.",
        None,
    )
    turn_context: str = _help(
        "Multi-turn rollouts (tools, environments): what each turn after the first is sampled after. 'appended': "
        "the tokens so far, the model's own earlier turns as it sampled them (TRL 1.16's). 'rendered': the "
        "conversation so far as the chat template renders it, which is what the model meets when deployed where a "
        "template re-renders earlier turns (one that strips earlier reasoning); each turn's tokens are trained "
        "after exactly the context they were sampled under (with packing='tree' in one pass, each rendered history "
        "once). 'auto': 'rendered' when the chat template re-renders an earlier assistant turn once a tool result "
        "follows it (checked once on a sentinel conversation), else 'appended'. A vision-language model's "
        "conversation is rendered by its processor, with the prompt's and the tools' images.",
        "auto",
    )
    lean_linears: bool = _help(
        "bf16 training pass: linear layers keep their float32 weights for backward instead of "
        "bfloat16 copies (autocast's numbers): a lower peak for a slower training pass "
        "(bench/RESULTS.md), so off by default.",
        False,
    )
    cpu_keep_freed_memory: bool = _help(
        "CPU runs: have glibc keep freed memory for reuse instead of returning it to "
        "the kernel (process-wide; far less page-faulting per training pass, the same "
        "peak: bench/RESULTS.md). False keeps the system's policy.",
        True,
    )
    vllm_kv_cache_gib: Optional[float] = _help(
        "use_vllm on a CPU: GiB of RAM for vLLM's KV cache. None: room for every sequence of one generation at "
        "512 prompt tokens + max_completion_length (4x headroom, at least one vllm_max_model_length sequence). "
        "GPUs size it with vllm_gpu_memory_utilization.",
    )
    vllm_server_api_key: Optional[str] = _help(
        "vllm_mode='server': the API key the server was started with (None: the GRPO_VLLM_API_KEY environment "
        "variable, or no key). Sent on every request; never written to saved configs.",
    )
    vllm_enforce_eager: Optional[bool] = _help(
        "use_vllm: run vLLM's model eagerly (True) or compiled (False: CUDA graphs on GPUs, torch.compile on CPUs). "
        "None: eager on a CPU (compiling there costs over a minute at start-up for faster decoding, a gain only for "
        "long runs: bench/RESULTS.md), vLLM's default on GPUs.",
    )
