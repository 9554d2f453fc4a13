"""GRPOTrainer: Group Relative Policy Optimization with an explicit loop on accelerate.

    trainer = GRPOTrainer(model="path/to/model", reward_funcs=my_reward, train_dataset=ds, args=GRPOConfig(...))
    trainer.train()

The algorithm as implemented (DeepSeekMath, arXiv:2402.03300, with the loss variants of `grpo.algo.losses`):
every `steps_per_generation * num_iterations` micro-steps, take `generation_batch_size / G` prompts, sample G
completions for each with the current policy, score them with the reward functions, turn the rewards into
group-relative advantages, and compute the old-policy log-probs (only when the batch will be reused off-policy)
and the reference log-probs (only when beta > 0). Then each micro-step takes one slice of that batch and
backpropagates the policy loss; every `gradient_accumulation_steps` micro-steps the optimizer steps. `_step`
below is one optimizer step, top to bottom; each phase is one call with a typed result. A generation batch comes
from one call, `grpo.rounds.sequential.Rounds.next` (generated, scored, gathered, filtered and timed, the same for
the sequential and the asynchronous loop); the trainer is the learner.

Where grpo departs from the reference (TRL 1.16, shared spec):
- a completion stops at the chat template's end-of-turn token as well as EOS (reference quirk 10);
- a reward of float NaN/inf is an error (None is how a function says "does not apply");
- the prompt order of generation k is a pure function of (seed, k), so resuming needs no sampler state;
- position ids follow the attention mask in the training pass as in generation (the reference lets left
  padding shift positions there);
- generation runs with the model in eval mode (dropout off, KV cache on under gradient checkpointing);
- `bf16=None` turns bfloat16 on only where the hardware computes it fast (the reference: always);
- `dynamic_sampling` (DAPO, which the reference lacks) drops groups without reward spread and draws more prompts;
- async reward functions run while the sync ones do (the reference awaits them after the sync ones);
- `average_tokens_across_devices=False` divides each process's token-sum loss by its own tokens (the HF
  Trainer's meaning; the reference always counts every process's);
- the sampling/* metrics are logged for every engine; on-policy, vLLM's importance weight compares with the
  training pass's own log-probs (the reference runs an extra old-policy pass for it);
- a tensor-parallel vLLM engine (`vllm_tensor_parallel_size` > 1) samples each generation under a seed its
  processes agree on, and they may bring different numbers of rows (the reference relies on the engine's seed
  alone, which the training between generations can desynchronize, and assumes equal numbers);
- image prompts (`grpo.models.vision`): the image placeholder token, which generation never samples (as the reference),
  has probability 0 in the training pass too, so the importance weight compares the same distribution;
- tool calls (`grpo.agent`): the `<tool_call>` format is read where the tokenizer has no response parser, each
  call runs under `tool_call_timeout`, and a failing call becomes an error message to the model.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from grpo import checkpoint
from grpo.agent import Environments
from grpo.algo.advantages import Advantages, compute_advantages
from grpo.algo.losses import LossScale, high_entropy_mask, masked_mean_stat, policy_loss
from grpo.assembly import Assembly
from grpo.base import seeding
from grpo.config import GRPOConfig, resolve_args, warn_odd_combinations
from grpo.data import prompts as data
from grpo.distributed import collectives
from grpo.distributed.accelerator import end_training
from grpo.distributed.accumulation import accumulating, backward
from grpo.learner import optimization, ref_sync
from grpo.learner.acceleration import make_accelerator
from grpo.learner.batch import TrainBatch, collate
from grpo.learner.loop import TrainOutput, Update
from grpo.learner.optimization import TrainingError
from grpo.models import build as models
from grpo.models import lora
from grpo.models.modeling import model_name
from grpo.observe import reporting, run_dir
from grpo.observe.metrics import MetricsLogger, generation_metrics
from grpo.perf import allocator
from grpo.rewards.calling import RewardFunctions
from grpo.rounds import asynchronous, evaluation, preemption
from grpo.rounds.groups import GenerationBatch, Scored
from grpo.rounds.preemption import Preempted, preemption_guard

logger = logging.getLogger("grpo")
__all__ = ["GRPOTrainer", "TrainOutput", "TrainingError"]


class GRPOTrainer(Assembly):
    """TRL-compatible GRPO trainer. See the module docstring for the algorithm and `GRPOConfig` for options; its
    parts are built by `grpo.assembly.Assembly`."""

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: Callable | list[Callable] | None = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: Any = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
    ) -> None:
        self.args = args = resolve_args(args, model_name(model), model, quantization_config)
        run_dir.check_output_dir(args.output_dir)
        self.environments = Environments(environment_factory) if environment_factory is not None else None
        self.train_dataset = self._training_data(train_dataset, eval_dataset, bool(tools), environment_factory)
        warn_odd_combinations(args)
        models.default_unused_parameters(args, model)  # a vision-language model's DDP default
        self.accelerator = make_accelerator(args)
        reporting.configure_logging(args, self.accelerator)  # log_level(_replica), log_on_each_node
        if self.accelerator.device.type == "cpu" and args.cpu_keep_freed_memory:
            allocator.keep_freed_memory()
        env_rewards = self.environments.reward_functions() if self.environments else ()
        self.rewards = RewardFunctions.build(
            reward_funcs, args, reward_processing_classes, self.accelerator.device, env_rewards
        )
        seeding.seed_run(args.seed, args.full_determinism)  # full_determinism: deterministic algorithms too
        snapshot, processor = self._build_policy(model, processing_class, peft_config, optimizers)
        self._build_rounds(tools, rollout_func, processor, snapshot)
        self._build_bookkeeping(eval_dataset, callbacks)
        self._fire("init_end")

    @property
    def _window(self) -> MetricsLogger:
        """The metrics window of the run in progress (train() makes it)."""
        assert self.metrics is not None, "the metrics window exists while train() runs"
        return self.metrics

    # ---- the loop --------------------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Train to max_steps. `resume_from_checkpoint`: True for the newest checkpoint in output_dir, or a
        checkpoint path (None: the config's); the run then continues exactly where that checkpoint left it. With
        load_best_model_at_end, the best checkpoint's weights end it. The main process holds output_dir for the run
        (a second run there is refused). SIGTERM saves the last complete step and exits with status 143. The output's
        metrics: the last logged row and the HF Trainer's train_runtime, train_samples_per_second, ..."""
        a = self.args
        start = time.perf_counter()
        with run_dir.holding(a.output_dir, self.accelerator):
            self.metrics = MetricsLogger(a.output_dir, self.accelerator, self.max_steps, not a.disable_tqdm)
            resume_from_checkpoint = checkpoint.strategy.resume_target(resume_from_checkpoint, a.resume_from_checkpoint)
            path = checkpoint.resolve(resume_from_checkpoint, a.output_dir) if resume_from_checkpoint else None
            if path:
                checkpoint.load(self, path)
                self.metrics.resume(self.state.global_step)
                self.diagnosis.replay(self.state.log_history)  # the findings before the resume, not warned again
                self.policy_version += 1  # the loaded weights
                logger.info("Resumed from %s at step %d.", path, self.state.global_step)
            self.model.train()
            total_loss, first = 0.0, self.state.global_step
            self._fire("train_begin")
            self.hub.start_completions_upload(self.accelerator.is_main_process)
            report = self.run_report.running(self.state, path, self.args.to_dict())  # run_info.json: this config
            rounds = self.rounds.running(self.loop.data_position)
            with self.metrics, report, preemption_guard() as preempted, rounds:
                step_start = None  # preempted in eval_on_start: as between steps (evaluating changes nothing)
                try:
                    if a.eval_on_start and self.evaluations:
                        self.evaluate()
                    while self.state.global_step < self.max_steps and not self.control.should_training_stop:
                        step_start = preemption.StepStart.capture(self)
                        total_loss += self._step()
                        if collectives.any_process(self.accelerator, preempted.is_set()):
                            preemption.save_and_exit(self, None)
                except Preempted as stop:
                    preemption.save_and_exit(self, step_start, stop.agreed)
            if checkpoint.strategy.load_best_model(self, checkpoint.load_model_weights):
                self.policy_version += 1
            self.hub.finish_completions_upload()
            loss = total_loss / max(self.state.global_step, 1)
            summary = reporting.train_summary(a, self.state, time.perf_counter() - start, first, loss)
            last = dict((self.state.log_history or [{}])[-1])
            self._fire("log", logs=reporting.add_summary(self.state.log_history, summary, self.state.global_step))
            self._fire("train_end")
        end_training(self.accelerator)
        return TrainOutput(self.state.global_step, loss, {**last, **summary})

    def _step(self) -> float:
        """One optimizer step: gradient_accumulation_steps micro-steps, then update, log, checkpoint."""
        start = time.perf_counter()
        self.step_applied = False
        losses = []
        if self.state.global_step % self.steps_per_epoch == 0:
            self._fire("epoch_begin")
        self._fire("step_begin")
        for micro in range(self.args.gradient_accumulation_steps):
            if self.buffer.needs_generation(self.loop.micro_step):
                self.buffer.fill(self._generation(), self.loop.micro_step)
            batch = self.buffer.take(self.loop.micro_step)
            self.loop.micro_step += 1
            last = micro == self.args.gradient_accumulation_steps - 1
            with accumulating(self.accelerator, self.model, last), self.rounds.learning(self.loop.micro_step):
                losses.append(self._loss_and_backward(batch))
            if not last:
                self._fire("substep_end")
        update = self._update(losses)
        self._fire("step_end")
        self._log_step(update, time.perf_counter() - start)
        step = self.state.global_step
        self._checkpoint(self._evaluation_due(step))
        if step % self.steps_per_epoch == 0 or step == self.max_steps:
            self._fire("epoch_end")
        return update.loss

    # ---- generate, score, advantages, old/reference log-probs ------------------------------------------------

    def _generation(self) -> TrainBatch:
        """The next generation batch (`grpo.rounds.sequential.Rounds.next`: every process's rows, generated from the
        current policy or, async, an older one, scored, gathered, filtered), its advantages, this process's share
        collated with its old-policy and reference log-probs, logged."""
        where = (self.loop.data_position, self.unwrapped_model, self.policy_version, self.state)
        generated = self.rounds.next(*where)
        self.loop.data_position += generated.rounds
        advantages = self._advantages(generated.batch)
        batch = self._add_old_and_ref_logps(self._collate(generated.batch, advantages))
        self._log_generation(generated, advantages, batch)
        return batch

    def _advantages(self, scored: Scored, group_size: int | None = None) -> Advantages:
        """Group-relative advantages; groups of num_generations (an evaluation's: num_generations_eval)."""
        a = self.args
        size = group_size or a.num_generations
        return compute_advantages(
            scored.rewards, self.rewards.weights, size, a.scale_rewards, a.multi_objective_aggregation
        )

    def _collate(self, scored: Scored, advantages: Advantages) -> TrainBatch:
        """This process's share of the generation batch as tensors; its `num_items_in_batch` counts the trained
        tokens of every process's share (`collectives.loss_tokens`)."""
        acc = self.accelerator
        mine = list(collectives.local_rows(len(scored), acc.process_index, acc.num_processes))
        batch = collate(
            scored.rollout.select(mine),
            advantages.advantages[mine],
            self.tokenizer.pad_token_id,
            self.args.mask_truncated_completions,
            group=data.prompt_groups(scored.rows, scored.rollout.prompt_ids, self.environments is not None)[mine],
            pad_to_multiple_of=self.args.pad_to_multiple_of,
        ).to(acc.device)
        tokens = collectives.loss_tokens(acc, batch.mask.sum(), self.args.average_tokens_across_devices)
        return dataclasses.replace(batch, num_items_in_batch=tokens)

    def _needs_old_logps(self) -> bool:
        """Whether a generation batch is trained on after an update (shared spec §4.1)."""
        return self.args.gradient_accumulation_steps % self.buffer.cycle != 0

    def _add_old_and_ref_logps(self, batch: TrainBatch, old: bool = True) -> TrainBatch:
        """Old-policy log-probs only when the batch is reused after an update (and `old`); reference log-probs only
        when beta > 0. Chunked by the micro-batch size, no gradient checkpointing needed."""
        chunk = self.args.per_device_train_batch_size
        needs_old, old_logps = old and self._needs_old_logps(), batch.old_logps  # async: the behaviour policy's
        ref = None
        if needs_old and old_logps is None:
            old_logps = self.training_pass.logps(self.model, batch, chunk)
        if self.ref_model is not None:
            ref = self.training_pass.logps(self.ref_model, batch, chunk)
        elif self.ref_from_adapters:
            with lora.adapters_disabled(self.model):
                ref = self.training_pass.logps(self.model, batch, chunk)
        return dataclasses.replace(batch, old_logps=old_logps, ref_logps=ref)

    # ---- loss, backward, update ------------------------------------------------------------------------------

    def _loss_and_backward(self, batch: TrainBatch) -> float:
        """The micro-batch's share of the step's loss, backpropagated; returns its value."""
        a, acc = self.args, self.accelerator
        t0 = time.perf_counter()
        trained = self.training_pass.train(self.model, batch, entropy_grad=self.loss_terms.entropy_grad)
        logps, entropies = trained.logps, trained.entropies
        assert entropies is not None  # the gradient pass scores them
        self.state.total_flos += reporting.micro_batch_flos(self.flop_parameters, batch)
        entropy_mask = None
        if a.top_entropy_quantile < 1.0:
            everyone = collectives.gather_values(entropies.detach()[batch.mask.bool()].float(), acc)
            entropy_mask = high_entropy_mask(entropies.detach(), batch.mask, everyone, a.top_entropy_quantile)
        scale = LossScale(
            batch.num_items_in_batch, acc.num_processes, a.gradient_accumulation_steps, a.steps_per_generation
        )
        is_ratio, sampler_logps, sampling = self.correction(logps, batch.old_logps, batch.sampling_logps, batch.mask)
        loss, metrics = policy_loss(
            logps,
            batch.old_logps,
            batch.advantages,
            batch.mask,
            self.loss_params,
            batch.ref_logps,
            entropy_mask=entropy_mask,
            scale=scale,
            sampler_logps=sampler_logps,
            is_ratio=is_ratio,
        )
        bonus_mask = batch.mask if entropy_mask is None else batch.mask * entropy_mask
        loss, extra = self.loss_terms.add(loss, entropies, bonus_mask, trained.aux_loss)
        # the loss and the token count in one host sync (with reduce_stats' below, two per micro-step)
        loss_value, tokens = torch.stack([loss.detach().float(), batch.mask.sum().float()]).tolist()
        if not math.isfinite(loss_value):
            raise TrainingError(optimization.nonfinite_message(self.state.global_step + 1, "loss", loss_value, False))
        backward(acc, loss)
        stats = dict(metrics.stats, **sampling, **extra, entropy=masked_mean_stat(entropies.detach(), batch.mask))
        if self.args.async_generation:  # the weight against the behaviour policy that sampled (old_logps)
            stats.update(asynchronous.importance_stats(logps.detach(), batch.old_logps, batch.mask))
        self._window.add_many(collectives.reduce_stats(stats, acc))
        self._window.add("timing/training_tokens_per_s", tokens / max(time.perf_counter() - t0, 1e-9))
        if self.training_pass.tree:  # packing "tree" or "auto": the share of the pass's pieces laid out as trees
            self._window.add("packing/trees", trained.layouts.count("trees") / max(len(trained.layouts), 1))
        return loss_value

    def _update(self, losses: list[float]) -> Update:
        """Clip and check the accumulated gradients, apply them, advance the schedule."""
        # each process's loss is its share of the global one: their mean is the loss of the whole batch
        loss = collectives.process_mean(self.accelerator, sum(losses))
        grad_norm = self.gradient_check(self.accelerator, self.model, self.optimizer, self.state.global_step + 1)
        self._fire("pre_optimizer_step")
        self.optimizer.step()
        self._fire("optimizer_step")
        self.step_applied = True
        if not self.accelerator.optimizer_step_was_skipped:  # fp16 loss scaling skips a step that overflowed
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.policy_version += 1  # the producer pushes these weights before its next generation
        self.state.global_step += 1
        self._window.add_many(self.loss_terms.end_step(self.accelerator))  # the adaptive entropy controller
        ref_sync.after_step(self)  # sync_ref_model (TR-DPO)
        self.state.epoch = self.state.global_step / self.steps_per_epoch
        return Update(loss, grad_norm, self.lr_scheduler.get_last_lr()[0])

    # ---- log and checkpoint ----------------------------------------------------------------------------------

    def _log_generation(self, generated: GenerationBatch, advantages: Advantages, batch: TrainBatch) -> None:
        for name, value in generated.logged:  # reward functions' log_metric calls; an async round's staleness
            self._window.add(name, value)
        mode = self.args.include_num_input_tokens_seen
        reporting.count_tokens(self.state, self.metrics, generated.batch.rollout, batch, self.accelerator, mode)
        names, tools = self.rewards.names, self.rollouts.uses_tools
        self._window.add_many(generation_metrics(generated, advantages, names, self.args.dynamic_sampling, tools))
        self.latest_batch = (generated.batch, advantages.advantages)  # trainer._logs
        if self.completion_log is not None:
            self.completion_log.record(generated.batch, advantages.advantages, self.tokenizer)

    def _log_step(self, update: Update, seconds: float) -> None:
        step = self.state.global_step
        values = dict(loss=update.loss, grad_norm=update.grad_norm, learning_rate=update.learning_rate)
        self._window.add_many(dict(values, step_time=seconds))
        self._window.advance(step)
        if reporting.should_log(self.args, step, self.max_steps, self.steps_per_epoch) or self.control.should_log:
            self.state.log_history.append(self._window.log(step, self.state.epoch))
            if self.completion_log is not None and self.accelerator.is_main_process:
                self.completion_log.flush(step, self._window.console)
            self._fire("log", logs=self.state.log_history[-1])
            self.diagnosis.update(self.state.log_history, self.accelerator.is_main_process)
            self.run_report.refresh()  # report.html, when due
        elif self.args.logging_strategy == "no":
            self._window.discard()  # no row will ever average this window
        reporting.release_cached_memory(self.args, step, self.accelerator.device)  # torch_empty_cache_steps

    def _checkpoint(self, evaluate: bool) -> None:
        """The end of an optimizer step (every process): its checkpoint when due, then its evaluation when due, in
        that order, so that an evaluation that fails (a reward function raising on an eval row) or is preempted
        loses no step. The events stay the HF Trainer's (on_evaluate, then on_save): the evaluation's row, the best
        checkpoint it makes and the callbacks' states go into the checkpoint's trainer_state.json after it
        (`checkpoint.add_evaluation`), as the HF Trainer, which saves after evaluating, writes them. A checkpoint only
        the evaluation decides (save_strategy="best" on an eval_ metric, a callback's on_evaluate asking) is written
        after it. SIGTERM during the evaluation: the step is complete, so it is saved (unless saved already) and the
        run exits with status 143; by several processes when they stopped together (at a batch's gather or a tool
        loop's check, `grpo.base.sigterm`), otherwise they save nothing more."""
        step, path = self.state.global_step, None
        if checkpoint.strategy.should_save(self) or self.control.should_save:
            path = checkpoint.save(self, step)
        if evaluate:
            try:
                self.evaluate()
            except Preempted as stop:
                if self.accelerator.num_processes > 1 and not stop.agreed:
                    raise
                preemption.save_and_exit(self, None)  # the step is complete: as between steps
            if path is not None:
                checkpoint.add_evaluation(self, path)
            elif checkpoint.strategy.should_save(self) or self.control.should_save:
                path = checkpoint.save(self, step)
        if path is not None:
            self.hub.after_checkpoint(self, path)  # hub_strategy (main process, in the background)
            self._fire("save")

    # ---- evaluation and callbacks ----------------------------------------------------------------------------

    def evaluate(self, eval_dataset: Any = None, metric_key_prefix: str = "eval") -> dict[str, float | None]:
        """Completions of every eval prompt scored by the reward functions: the `eval_` metrics
        (`grpo.rounds.evaluation`; None where a value is not finite), logged and passed to the callbacks'
        on_evaluate. Changes nothing training depends on."""
        runs = self.evaluations
        if eval_dataset is not None:
            runs = evaluation.build(eval_dataset, self.args, self.prompts, self.accelerator.num_processes)
        state, policy = self.state, (self.unwrapped_model, self.policy_version)
        metrics = self.evaluator.run(runs, metric_key_prefix, *policy, state.global_step)
        row: dict[str, Any] = {**metrics, "epoch": round(state.epoch or 0.0, 4), "step": state.global_step}
        state.log_history.append(row)
        if self.metrics is not None:
            self.metrics.write_row(row)
        self._fire("log", logs=row)
        self._fire("evaluate", metrics=metrics)
        return metrics

    def _evaluation_due(self, step: int) -> bool:
        """Whether the trainer evaluates after optimizer step `step`: an eval dataset's strategy says so, or a
        callback set control.should_evaluate."""
        if not self.evaluations:
            return False
        due = self.evaluator.due(self.evaluations, step, self.max_steps, self.steps_per_epoch)
        return due or self.control.should_evaluate

    def _eval_loss(self, scored: Scored, group_size: int) -> float | None:
        """The policy loss of one evaluation batch (every process's rows), as the HF Trainer's `eval_loss`: the
        batch's group advantages, on-policy (ratio 1; with beta > 0 the KL to the reference), each process's rows
        through the training pass without gradient, the processes' losses weighted by their rows. None for a batch
        some process has no rows of (a last, short batch): a sharded model's forward is collective, so all or none
        run it."""
        acc, a = self.accelerator, self.args
        mine = list(collectives.local_rows(len(scored), acc.process_index, acc.num_processes))
        if collectives.any_process(acc, not mine):
            return None
        advantages = self._advantages(scored, group_size).advantages[mine]
        pad = self.tokenizer.pad_token_id
        batch = collate(scored.rollout.select(mine), advantages, pad, a.mask_truncated_completions).to(acc.device)
        batch = self._add_old_and_ref_logps(batch, old=False)
        logps = self.training_pass.logps(self.model, batch, a.per_device_eval_batch_size)
        loss, _ = policy_loss(logps, None, batch.advantages, batch.mask, self.loss_params, batch.ref_logps)
        rows = collectives.process_mean(acc, float(len(mine)))
        return collectives.process_mean(acc, loss.item() * len(mine)) / rows

    def _fire(self, event: str, **kwargs: Any) -> None:
        self.callback_handler.fire(event, self.args, self.state, **kwargs)
