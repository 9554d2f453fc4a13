"""GRPOTrainer: Group Relative Policy Optimization with an explicit loop on accelerate.

    trainer = GRPOTrainer(model="path/to/model", reward_funcs=my_reward, train_dataset=ds, args=GRPOConfig(...))
    trainer.train()

The algorithm as implemented (DeepSeekMath, arXiv:2402.03300, with the loss variants of `grpo.losses`):
every `steps_per_generation * num_iterations` micro-steps, take `generation_batch_size / G` prompts, sample G
completions for each with the current policy, score them with the reward functions, turn the rewards into
group-relative advantages, and compute the old-policy log-probs (only when the batch will be reused off-policy)
and the reference log-probs (only when beta > 0). Then each micro-step takes one slice of that batch and
backpropagates the policy loss; every `gradient_accumulation_steps` micro-steps the optimizer steps. `_step`
below is one optimizer step, top to bottom.

Where grpo departs from the reference (TRL 1.16, shared spec):
- a completion stops at the chat template's end-of-turn token as well as EOS (reference quirk 10);
- a reward of float NaN/inf is an error (None is how a function says "does not apply");
- the prompt order of generation k is a pure function of (seed, k), so resuming needs no sampler state;
- position ids follow the attention mask in the training pass as in generation (the reference lets left
  padding shift positions there);
- generation runs with the model in eval mode (dropout off, KV cache on under gradient checkpointing);
- `bf16=None` turns bfloat16 on only where the hardware computes it fast (the reference: always);
- `dynamic_sampling` (DAPO, which the reference lacks) drops groups without reward spread and draws more prompts;
- async reward functions run while the sync ones do (the reference awaits them after the sync ones).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import set_seed
from transformers import PreTrainedModel, TrainerState

from grpo import checkpoint, data, fast_generation, lean_blocks, lean_linears, lora, runtime, zero
from grpo.advantages import Advantages, compute_advantages
from grpo.batch import TrainBatch, collate, head_is_chunkable, token_logps
from grpo.config import GRPOConfig, reject_later_features, warn_odd_combinations
from grpo.generation import GenerationEngine, TransformersEngine
from grpo.losses import TOKEN_SUM_LOSSES, compute_policy_loss, entropy_bonus, high_entropy_mask, masked_mean_stat
from grpo.metrics import CompletionLog, MetricsLogger, generation_metrics, reduce_stats
from grpo.modeling import (
    disable_dropout,
    load_causal_lm,
    load_tokenizer,
    model_name,
    prepare_tokenizer,
    reference_model,
)
from grpo.preemption import preemption_guard
from grpo.reward_models import load_reward_model
from grpo.scored import Scored, gather_scored, groups_with_spread, local_rows, rows_of_groups
from grpo.scoring import check_reward_funcs, reward_name, score

logger = logging.getLogger("grpo")


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss or gradient); the message names the step and what to try."""


@dataclass
class TrainOutput:
    global_step: int
    training_loss: float
    metrics: dict[str, Any]


class GRPOTrainer:
    """TRL-compatible GRPO trainer. See the module docstring for the algorithm and `GRPOConfig` for options."""

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: Callable | list[Callable],
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        peft_config: Any = None,
        tools: Any = None,
        rollout_func: Any = None,
    ) -> None:
        args = args or GRPOConfig(output_dir=f"{model_name(model)}-GRPO")
        if args.output_dir is None:
            args.output_dir = f"{model_name(model)}-GRPO"
        self.args = args
        reject_later_features(args, tools, rollout_func, eval_dataset, callbacks)
        data.check_dataset(train_dataset)
        self.train_dataset = train_dataset
        warn_odd_combinations(args)

        self.accelerator = runtime.make_accelerator(args)
        if self.accelerator.device.type == "cpu":
            runtime.keep_freed_memory()

        def load_reward_model_entry(entry: Any, tokenizer: Any) -> Callable:
            return load_reward_model(entry, tokenizer, args.model_init_kwargs, args.trust_remote_code,
                                     args.chat_template_kwargs, self.accelerator.device)

        self.reward_funcs = check_reward_funcs(reward_funcs, args.reward_weights, reward_processing_classes,
                                               load_reward_model_entry)
        self.reward_names = [reward_name(f) for f in self.reward_funcs]
        self.reward_weights = torch.tensor(args.reward_weights or [1.0] * len(self.reward_funcs))
        set_seed(args.seed)
        model_id = model if isinstance(model, str) else None
        self.model = load_causal_lm(model, args.model_init_kwargs, args.trust_remote_code) if model_id else model
        source = model_id or getattr(self.model.config, "_name_or_path", None)
        self.processing_class = prepare_tokenizer(processing_class) if processing_class is not None \
            else load_tokenizer(source, args.trust_remote_code)
        if args.disable_dropout:
            disable_dropout(self.model)
        self.ref_model = None
        # beta > 0: the reference policy; with LoRA it is the policy with its adapters disabled (no copy)
        self.ref_from_adapters = args.beta != 0.0 and (peft_config is not None or lora.is_peft_model(self.model))
        if args.beta != 0.0 and not self.ref_from_adapters:  # beta == 0: never loaded (shared spec §1.2)
            self.ref_model = reference_model(self.model, model_id, args.model_init_kwargs, args.trust_remote_code)
        if args.gradient_checkpointing:
            runtime.enable_checkpointing(self.model, args.gradient_checkpointing_kwargs or {"use_reentrant": False})
        if peft_config is not None:
            self.model = lora.wrap(self.model, peft_config, args.gradient_checkpointing)

        self.state = TrainerState()
        self.max_steps = self._total_steps()
        self.state.max_steps = self.max_steps
        self.optimizer, self.lr_scheduler = optimizers
        self._make_optimizer()
        zero.configure(self.accelerator, args)  # DeepSpeed: its "auto" batch values from this config
        # the schedule is not handed to accelerate: its wrapper steps it once per process per step (it assumes
        # a dataloader split across processes), which would end an N-process run's schedule N times too early
        self.model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
        # Precision is set explicitly around each forward (accelerator.autocast()); drop accelerate's autocast
        # wrapper on forward so that code calling the model outside those regions (evaluation) gets float32.
        self.accelerator.unwrap_model(self.model, keep_fp32_wrapper=False)
        if self.ref_model is not None:
            self.ref_model = zero.prepare_reference(self.accelerator, self.ref_model) \
                or self.accelerator.prepare_model(self.ref_model, evaluation_mode=True)

        tokenizer = self.processing_class
        model_eos = getattr(getattr(self.unwrapped_model, "generation_config", None), "eos_token_id", None)
        self.stop_ids = data.end_of_turn_ids(tokenizer, model_eos)
        self.engine = self._make_engine()
        # prompt shared across a group's rows in the training pass: exact, but needs the KV cache, which
        # gradient checkpointing turns off
        self.share_prefix = isinstance(self.engine, fast_generation.FastEngine) and not args.gradient_checkpointing
        # output head applied a chunk of tokens at a time: the (B, T, V) logits never exist
        self.chunked_head = head_is_chunkable(self.model)
        # bf16, opt-in (GRPO_LEAN_LINEARS=1): the training pass's linears keep their float32 weights for
        # backward, not bfloat16 copies (-0.22 GB peak, ~+10% training-pass time on the benchmark)
        opted = runtime.env_flag("GRPO_LEAN_LINEARS")
        low = torch.bfloat16 if self.accelerator.mixed_precision == "bf16" and opted else None
        self.lean_dtype = low if lean_linears.applies(self.unwrapped_model, low) is None else None
        self.lean_blocks = lean_blocks.chosen(self.model)  # norms and MLPs that keep less for backward
        self._prompt_cache: dict[int, list[int]] = {}
        self._buffer: list[TrainBatch] = []
        self._micro_step = 0
        self._overflows = 0  # fp16 loss-scale overflows in a row
        self._data_position = 0  # prompt blocks drawn so far (more than generations with dynamic sampling)
        self._metrics_window: dict[str, list[float]] = {}
        self.metrics: MetricsLogger | None = None
        self.completion_log = CompletionLog(args, self.reward_names) if args.log_completions else None

    # ---- construction helpers ------------------------------------------------------------------------------------

    def _total_steps(self) -> int:
        a = self.args
        unique = a.generation_batch_size // a.num_generations
        blocks = data.prompts_per_generation(len(self.train_dataset), unique)
        micro_per_epoch = blocks * a.steps_per_generation * a.num_iterations
        self.steps_per_epoch = max(micro_per_epoch // a.gradient_accumulation_steps, 1)
        if a.max_steps > 0:
            return a.max_steps
        return max(math.ceil(a.num_train_epochs * self.steps_per_epoch), 1)

    def _make_optimizer(self) -> None:
        if self.optimizer is None:
            self.optimizer = runtime.default_optimizer(self.model, self.args)
        if self.lr_scheduler is None:
            self.lr_scheduler = runtime.default_scheduler(self.optimizer, self.args, self.max_steps)

    def _make_engine(self) -> GenerationEngine:
        """The fast engine where it applies, else the plain `model.generate` path; says which and why."""
        model, tok = self.unwrapped_model, self.processing_class
        reason = fast_generation.supports(model, self.args)
        if reason is None:
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.accelerator.mixed_precision)
            return fast_generation.FastEngine(model, self.args, self.stop_ids, tok.pad_token_id,
                                              autocast=self.accelerator.autocast, compute_dtype=dtype)
        logger.info("Generating with the plain transformers path: %s.", reason)
        return TransformersEngine(model, self.args, self.stop_ids, tok.pad_token_id,
                                  autocast=self.accelerator.autocast)

    @property
    def unwrapped_model(self) -> PreTrainedModel:
        return self.accelerator.unwrap_model(self.model)

    # ---- the loop ------------------------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Train to max_steps. `resume_from_checkpoint`: True for the newest checkpoint in output_dir, or a
        checkpoint path; the run then continues exactly where that checkpoint left it. SIGTERM (preemption)
        saves a checkpoint at the end of the current step and exits the process with status 0."""
        a = self.args
        self.metrics = MetricsLogger(a.output_dir, self.accelerator, self.max_steps, not a.disable_tqdm)
        if resume_from_checkpoint:
            path = checkpoint.resolve(resume_from_checkpoint, a.output_dir)
            checkpoint.load(self, path)
            self.metrics.resume(self.state.global_step, self._metrics_window)
            logger.info("Resumed from %s at step %d.", path, self.state.global_step)
        self.model.train()
        total_loss = 0.0
        with self.metrics, preemption_guard() as preempted:
            while self.state.global_step < self.max_steps:
                total_loss += self._step()
                if runtime.any_process(self.accelerator, preempted.is_set()):
                    self._save_and_exit_on_preemption()
        runtime.end_training(self.accelerator)
        metrics = self.state.log_history[-1] if self.state.log_history else {}
        return TrainOutput(self.state.global_step, total_loss / max(self.state.global_step, 1), metrics)

    def _save_and_exit_on_preemption(self) -> None:
        step = self.state.global_step
        path = os.path.join(self.args.output_dir, f"checkpoint-{step}")
        if not os.path.exists(path):
            checkpoint.save(self, step)
        self.metrics.close()
        runtime.settle_processes(self.accelerator)
        logger.warning("SIGTERM received: saved %s; exiting. Resume with trainer.train(resume_from_checkpoint=True).",
                       path)
        raise SystemExit(0)

    @property
    def cycle_length(self) -> int:
        """Micro-steps that train on one generation batch."""
        return self.args.steps_per_generation * self.args.num_iterations

    def _step(self) -> float:
        """One optimizer step: gradient_accumulation_steps micro-steps, then clip, check, apply, log, save."""
        a = self.args
        start = time.perf_counter()
        step_loss = 0.0
        for micro in range(a.gradient_accumulation_steps):
            batch = self._next_micro_batch()
            last = micro == a.gradient_accumulation_steps - 1
            # gradients accumulate locally until the last micro-step (DeepSpeed: reduces and steps only then)
            with nullcontext() if last else self.accelerator.no_sync(self.model), zero.boundary(self.accelerator, last):
                step_loss += self._train_on(batch)
        # each process's loss is its share of the global one: their mean is the loss of the whole batch
        step_loss = runtime.process_mean(self.accelerator, step_loss)
        grad_norm = self._clip_and_check_gradients()
        self.optimizer.step()
        if not self.accelerator.optimizer_step_was_skipped:  # fp16 loss scaling skips a step that overflowed
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.global_step += 1
        self.state.epoch = self.state.global_step / self.steps_per_epoch
        self.metrics.add_many({"loss": step_loss, "grad_norm": grad_norm,
                               "learning_rate": self.lr_scheduler.get_last_lr()[0],
                               "step_time": time.perf_counter() - start})
        self._log_and_save()
        return step_loss

    def _next_micro_batch(self) -> TrainBatch:
        """The micro-step's slice of the current generation; generates anew when a cycle starts."""
        a = self.args
        cycle = self.cycle_length
        position = self._micro_step % cycle
        if position == 0 or not self._buffer:
            batch = self._generate_and_score()
            # split into steps_per_generation slices after a seeded shuffle (every slice mixes groups)
            order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(a.seed + self._micro_step))
            batch = batch.select(order)
            self._buffer = [batch.select(rows) for rows in torch.arange(len(batch)).chunk(a.steps_per_generation)]
        self._micro_step += 1
        return self._buffer[position % a.steps_per_generation]

    # ---- phase 1: generate, score, advantages, old/ref log-probs -----------------------------------------------

    def _generate_and_score(self) -> TrainBatch:
        """Generate, score and normalize one generation batch; this process's share of it as a TrainBatch.
        With dynamic_sampling, groups without reward spread are dropped and further prompts generated (the data
        position advances) until the batch is full or dynamic_sampling_max_attempts rounds have run."""
        a, acc, g = self.args, self.accelerator, self.args.num_generations
        wanted = a.generation_batch_size
        rounds = a.dynamic_sampling_max_attempts if a.dynamic_sampling else 1
        kept: list[Scored] = []
        dropped, attempts, timing = 0, 0, {"generation": 0.0, "scoring": 0.0, "tokens": 0}
        while attempts < rounds and sum(len(p) for p in kept) < wanted:
            attempts += 1
            part = gather_scored(self._sample_round(self._data_position, timing), acc)
            self._data_position += 1
            last_round = part
            if a.dynamic_sampling:
                spread = groups_with_spread(part.rewards, self.reward_weights, g, a.dynamic_sampling_std_threshold)
                dropped += int((~spread).sum())
                part = part.select(rows_of_groups(spread, g))
            kept.append(part)
        scored = Scored.concat(kept)
        scored = scored.select(range(min(len(scored), wanted)))
        if a.dynamic_sampling:
            self.metrics.add_many({"dynamic_sampling/groups_dropped": dropped, "dynamic_sampling/rounds": attempts})
            if len(scored) == 0:  # nothing to learn from: the last round as it came (advantages all 0)
                scored = last_round
                logger.warning("Dynamic sampling: no group had reward spread in %d rounds; this step's policy "
                               "gradient is zero. Check the reward functions, or raise "
                               "dynamic_sampling_max_attempts.", attempts)
            elif len(scored) < wanted:
                logger.warning("Dynamic sampling: %d of %d groups have reward spread after %d rounds; this step "
                               "trains on those.", len(scored) // g, wanted // g, attempts)
        adv = compute_advantages(scored.rewards, self.reward_weights, g, a.scale_rewards,
                                 a.multi_objective_aggregation)
        mine = list(local_rows(len(scored), acc.process_index, acc.num_processes))
        batch = collate(scored.rollout.select(mine), adv.advantages[mine], self.processing_class.pad_token_id,
                        a.mask_truncated_completions, group=torch.tensor(scored.rows)[mine]).to(acc.device)
        self._num_items = acc.reduce(batch.mask.sum(), reduction="sum").item()
        self._add_old_and_ref_logps(batch)
        self._log_generation(scored, adv, timing)
        if self.completion_log is not None:
            self.completion_log.record(scored, adv.advantages, self.processing_class)
        return batch

    def _sample_round(self, position: int, timing: dict[str, float]) -> Scored:
        """This process's share of one round: the prompts at data position `position`, generated and scored."""
        t0 = time.perf_counter()
        rows = self._local_rows(position)
        examples = [self.train_dataset[i] for i in rows]
        prompts = [example["prompt"] for example in examples]
        rollout = self.engine.generate([self._prompt_ids(i) for i in rows])
        t1 = time.perf_counter()
        texts = self.processing_class.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        extra: dict[str, list] = {}
        rewards = self._score(examples, data.completions_for_rewards(prompts, texts), rollout.completion_ids, extra)
        timing["generation"] += t1 - t0
        timing["scoring"] += time.perf_counter() - t1
        timing["tokens"] += sum(len(c) for c in rollout.completion_ids)
        return Scored(rows=rows, prompts=prompts, rollout=rollout, texts=texts, rewards=rewards, extra=extra)

    def _local_rows(self, generation: int) -> list[int]:
        """Dataset rows this process generates for: each prompt repeated G times, this process's contiguous
        share of the generation batch (shared spec §5.1-5.2)."""
        a, acc = self.args, self.accelerator
        unique = data.generation_prompt_indices(generation, len(self.train_dataset),
                                                a.generation_batch_size // a.num_generations, a.seed,
                                                a.shuffle_dataset)
        repeated = [i for i in unique for _ in range(a.num_generations)]
        per_process = len(repeated) // acc.num_processes
        return repeated[acc.process_index * per_process:(acc.process_index + 1) * per_process]

    def _prompt_ids(self, row: int) -> list[int]:
        if row not in self._prompt_cache:
            prompt = self.train_dataset[row]["prompt"]
            self._prompt_cache[row] = data.tokenize_prompts([prompt], self.processing_class,
                                                            self.args.chat_template_kwargs)[0]
        return self._prompt_cache[row]

    def _score(self, examples: list[dict], completions: list, completion_ids: list,
               extra: dict[str, list]) -> torch.Tensor:
        """Rewards (rows, functions); every dataset column but the prompt reaches the functions as a keyword.
        Columns the functions pass to `log_extra` land in `extra` (for the completions table)."""
        columns: dict[str, list] = {}
        for example in examples:
            for key, value in example.items():
                if key not in ("prompt", "completion", "completion_ids"):
                    columns.setdefault(key, []).append(value)
        kwargs = dict(columns, prompts=[e["prompt"] for e in examples], completions=completions,
                      completion_ids=completion_ids, trainer_state=self.state, log_metric=self.metrics.add,
                      log_extra=lambda name, values: extra.__setitem__(name, list(values)))
        return score(self.reward_funcs, self.reward_names, kwargs, len(examples))

    def _needs_old_logps(self) -> bool:
        a = self.args
        return a.gradient_accumulation_steps % (a.steps_per_generation * a.num_iterations) != 0

    @torch.no_grad()
    def _add_old_and_ref_logps(self, batch: TrainBatch) -> None:
        """Old-policy log-probs only when the batch is reused after an update (shared spec §4.1); reference
        log-probs only when beta > 0. Chunked by the micro-batch size, no gradient checkpointing needed."""
        a = self.args
        chunk = a.per_device_train_batch_size
        with self.accelerator.autocast():
            if self._needs_old_logps():
                batch.old_logps, _ = self._logps(self.model, batch, with_entropy=False, chunk_size=chunk)
            if self.ref_model is not None:
                batch.ref_logps, _ = self._logps(self.ref_model, batch, with_entropy=False, chunk_size=chunk)
            elif self.ref_from_adapters:
                with lora.adapters_disabled(self.model):
                    batch.ref_logps, _ = self._logps(self.model, batch, with_entropy=False, chunk_size=chunk)

    def _logps(self, model: Any, batch: TrainBatch, **kwargs: Any):
        """`token_logps` with this trainer's temperature and fast-path choices."""
        return token_logps(model, batch, self.args.temperature, share_prefix=self.share_prefix,
                           chunked_head=self.chunked_head, **kwargs)

    # ---- phase 2: optimize ----------------------------------------------------------------------------------------

    def _train_on(self, batch: TrainBatch) -> float:
        a, acc = self.args, self.accelerator
        t0 = time.perf_counter()
        lean = lean_linears.lean_linears(self.model, self.lean_dtype) if self.lean_dtype else nullcontext()
        blocks = lean_blocks.lean_blocks(self.model) if self.lean_blocks else nullcontext()
        with acc.autocast(), lean, blocks:
            logps, entropies = self._logps(self.model, batch, with_entropy=True, entropy_grad=a.entropy_coef != 0.0)
        entropy_mask = None
        if a.top_entropy_quantile < 1.0:
            active = entropies.detach()[batch.mask.bool()].float()
            everyone = acc.pad_across_processes(active, dim=0, pad_index=-1e9)
            everyone = acc.gather(everyone)
            entropy_mask = high_entropy_mask(entropies.detach(), batch.mask, everyone[everyone != -1e9],
                                             a.top_entropy_quantile)
        ga = a.gradient_accumulation_steps
        # dapo-family losses divide by the generation's active tokens, rescaled to one accumulation window
        normalizer = max(self._num_items, 1.0) / acc.num_processes * ga / a.steps_per_generation
        loss, stats = compute_policy_loss(logps, batch.old_logps, batch.advantages, batch.mask, a,
                                          batch.ref_logps, num_items_in_batch=normalizer, entropy_mask=entropy_mask)
        if a.loss_type not in TOKEN_SUM_LOSSES:
            loss = loss / ga
        if a.entropy_coef != 0.0:
            bonus_mask = batch.mask if entropy_mask is None else batch.mask * entropy_mask
            loss = loss - a.entropy_coef * entropy_bonus(entropies, bonus_mask) / ga
        if not torch.isfinite(loss):
            raise TrainingError(self._nonfinite_message("loss", loss.item()))
        acc.backward(loss, **zero.backward_kwargs(acc))
        stats["entropy"] = masked_mean_stat(entropies.detach(), batch.mask)
        self.metrics.add_many(reduce_stats(stats, self.accelerator))
        n_tokens = batch.mask.sum().item()
        self.metrics.add("timing/training_tokens_per_s", n_tokens / max(time.perf_counter() - t0, 1e-9))
        return loss.item()

    def _clip_and_check_gradients(self) -> float:
        """The gradient norm (NaN when fp16 loss scaling overflowed: the scaler skips the step and lowers the
        scale); a non-finite norm is an error otherwise, or after fp16 overflowed on every step of 32 in a row."""
        norm = runtime.clip_gradients(self.accelerator, self.model, self.args.max_grad_norm)
        finite = math.isfinite(norm)
        self._overflows = 0 if finite or self.accelerator.scaler is None else self._overflows + 1
        if 0 < self._overflows < 32:
            logger.info("Step %d: fp16 gradients overflowed; the step is skipped and the loss scale lowered.",
                        self.state.global_step + 1)
            return float("nan")
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingError(self._nonfinite_message("gradient norm", norm))
        return norm

    def _nonfinite_message(self, what: str, value: float) -> str:
        applied = what == "gradient norm" and zero.in_use(self.accelerator)  # DeepSpeed steps inside backward
        return runtime.nonfinite_message(self.state.global_step + 1, what, value, applied)

    # ---- phase 3: log and checkpoint ------------------------------------------------------------------------------

    def _log_generation(self, scored: Scored, adv: Advantages, timing: dict[str, float]) -> None:
        self.state.num_input_tokens_seen += sum(len(p) + len(c) for p, c in zip(scored.rollout.prompt_ids,
                                                                                scored.rollout.completion_ids))
        self.metrics.add("num_tokens", self.state.num_input_tokens_seen)
        self.metrics.add_many(generation_metrics(scored, adv, timing, self.reward_names))

    def _log_and_save(self) -> None:
        a, step = self.args, self.state.global_step
        self.metrics.advance(step)
        log_every = _every(a.logging_steps, self.max_steps)
        if step % log_every == 0 or step == self.max_steps:
            row = self.metrics.log(step, self.state.epoch)
            self.state.log_history.append(row)
            if self.completion_log is not None and self.accelerator.is_main_process:
                self.completion_log.flush(step, self.metrics.console)
        if a.save_strategy == "steps" and step % _every(a.save_steps, self.max_steps) == 0:
            checkpoint.save(self, step)

    def save_model(self, output_dir: str | None = None) -> None:
        """Write the policy (and tokenizer) as a normal Hugging Face model directory."""
        output_dir = output_dir or self.args.output_dir
        self.accelerator.wait_for_everyone()
        state_dict = checkpoint.model_state(self)  # every process: a sharded model is gathered
        if self.accelerator.is_main_process:
            checkpoint.save_pretrained(self, output_dir, state_dict)


def _every(value: float, total: int) -> int:
    """logging_steps / save_steps: an int, or a fraction (< 1) of the total number of steps."""
    return max(int(math.ceil(value * total)) if value < 1 else int(value), 1)
