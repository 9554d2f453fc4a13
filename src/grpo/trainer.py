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
the sequential and the asynchronous loop); the trainer is the learner. Its parts are built once, by
`grpo.assembly.assemble`, and held as one frozen record (`parts`); TRL's attributes read them. The trainer alone
writes its `TrainerState`: checkpoints, preemption and the report take values and return what changes.

Where grpo departs from the reference (TRL 1.16) is one list, for users and developers alike: docs/trl.md
("Coming from TRL"); the shared spec's first section records the decisions behind it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from accelerate import Accelerator
from transformers import PreTrainedModel, TrainerControl, TrainerState

from grpo import checkpoint
from grpo.agent import Environments
from grpo.algo import sampling_correction
from grpo.algo.advantages import Advantages, compute_advantages
from grpo.algo.losses import (
    LossScale,
    entropy_cut_mask,
    high_entropy_mask,
    masked_mean_stat,
    off_policy_mask,
    policy_loss,
)
from grpo.assembly import Part, Parts, assemble
from grpo.config import GRPOConfig, ResolvedConfig, resolve_args
from grpo.data import prompts as data
from grpo.distributed import collectives
from grpo.distributed.accelerator import end_run, end_training
from grpo.distributed.accumulation import accumulating, backward
from grpo.learner import optimization, ref_sync
from grpo.learner.batch import TrainBatch, collate
from grpo.learner.forward import TrainingPass
from grpo.learner.loop import TrainOutput, Update
from grpo.learner.optimization import TrainingError
from grpo.models import lora
from grpo.models.modeling import model_name
from grpo.observe import reporting, run_dir
from grpo.observe.callbacks import Callbacks
from grpo.observe.metrics import MetricsLogger, generation_metrics, trl_logs
from grpo.rounds import evaluation, preemption
from grpo.rounds.groups import GenerationBatch, Scored
from grpo.rounds.preemption import Preempted, StepStart, preemption_guard

logger = logging.getLogger("grpo")
__all__ = ["GRPOTrainer", "TrainOutput", "TrainingError"]


class GRPOTrainer:
    """TRL-compatible GRPO trainer. See the module docstring for the algorithm and `GRPOConfig` for options; its
    parts are built by `grpo.assembly.assemble`."""

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
        resolved = resolve_args(args, model_name(model), model, quantization_config)
        run_dir.check_output_dir(resolved.output_dir)
        self.state = TrainerState()  # the HF Trainer's: step, epoch, log history, best checkpoint (only we write it)
        self.parts: Parts = assemble(
            resolved,
            self.state,
            self,
            model=model,
            reward_funcs=reward_funcs,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            tools=tools,
            rollout_func=rollout_func,
            environment_factory=environment_factory,
        )
        self.state.max_steps = self.parts.max_steps
        self.policy_version = 0  # a new number whenever the policy's weights change (the producer syncs on it)
        self.step_applied = False  # whether the current step's optimizer step has been applied
        self.metrics: MetricsLogger | None = None  # made by train()
        self.latest_batch: tuple[Scored, torch.Tensor] | None = None  # the last generation batch and its advantages
        self._fire("init_end")

    # ---- TRL's attributes, read from the parts ---------------------------------------------------------------

    args = Part[ResolvedConfig]()
    accelerator = Part[Accelerator]()
    model = Part[torch.nn.Module]()  # the policy as prepared: wrapped, sharded or DeepSpeed's engine
    ref_model = Part[torch.nn.Module | None]()  # beta > 0; None with LoRA (the policy without its adapters)
    processing_class = Part[Any]()
    optimizer = Part[torch.optim.Optimizer]()
    lr_scheduler = Part[Any]()
    train_dataset = Part[Any]()  # the training rows as read (a stream: by position)
    eval_dataset = Part[Any]()
    environments = Part[Environments | None]()  # environment_factory's: the latest rollouts', one per row
    callback_handler = Part[Callbacks](lambda p: p.callbacks)
    control = Part[TrainerControl](lambda p: p.callbacks.control)
    # the reward functions as called (reward models as callables, an environment's get_reward last), their names
    # (their metrics': a function's __name__, a reward model's last path part, an environment's class name), their
    # weights (an environment's get_reward: 1) and tokenizers (a reward model's; None for a function), as TRL's
    reward_funcs = Part[list[Callable]](lambda p: list(p.rewards.funcs))
    reward_func_names = Part[list[str]](lambda p: list(p.rewards.names))
    reward_weights = Part[torch.Tensor](lambda p: p.rewards.weights)
    reward_processing_classes = Part[list[Any]](lambda p: [getattr(f, "tokenizer", None) for f in p.rewards.funcs])
    # whether a mixture-of-experts router's load-balancing loss is added (logged as aux_loss); the entropy bonus's
    # coefficient now (it moves with use_adaptive_entropy; 0 when the bonus is off)
    aux_loss_enabled = Part[bool](lambda p: p.loss_terms.router_aux)
    entropy_coef = Part[float](lambda p: p.loss_terms.entropy.coef if p.loss_terms.entropy is not None else 0.0)
    # grpo's: the policy unwrapped, the training pass (`grpo.learner.forward`), the parts of the run that save and
    # load themselves in checkpoints (a component added there is saved with every checkpoint, restored on resume)
    unwrapped_model = Part[PreTrainedModel]()
    training_pass = Part[TrainingPass]()
    state_components = Part[list[checkpoint.StateComponent]](lambda p: p.saved.components)

    @property
    def tools(self) -> list[Callable]:
        """The functions the model may call: the `tools` given, then each environment class's methods (its own
        instance's at each rollout), as TRL lists them."""
        given = [tool.fn for tool in self.parts.rollouts.tools.tools.values()]
        methods = self.environments.methods if self.environments is not None else {}
        return given + [getattr(cls, tool.name) for cls, tools in methods.items() for tool in tools]

    @property
    def _logs(self) -> dict[str, Any]:
        """The latest generation batch as TRL's `trainer._logs` holds it (callbacks written for TRL read it):
        prompt, completion, rewards, advantages, extra (`log_extra` columns), images
        (`grpo.observe.metrics.trl_logs`)."""
        scored, advantages = self.latest_batch or (None, None)
        return trl_logs(scored, advantages, self.parts.rewards.names, self.args.log_multimodal)

    get_off_policy_mask = staticmethod(off_policy_mask)  # (advantages, logps, sampling logps, mask, threshold)

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """The non-pad tokens whose entropy is at or above the `threshold` quantile of every process's non-pad
        entropies (TRL's helper: threshold = 1 - top_entropy_quantile)."""
        everyone = entropies[mask.bool()].float()
        if self.accelerator.num_processes > 1:
            everyone = collectives.gather_values(everyone, self.accelerator)
        return entropy_cut_mask(entropies, mask, everyone, threshold)

    @property
    def engine(self) -> Any:
        """The generation engine (`grpo.rollout`); settable (tests give scripted ones)."""
        return self.parts.rollouts.engine

    @engine.setter
    def engine(self, engine: Any) -> None:
        self.parts.rollouts.engine = engine

    # ---- the HF Trainer's user methods -----------------------------------------------------------------------

    def add_callback(self, callback: Any) -> None:
        self.parts.callbacks.add(callback)

    def pop_callback(self, callback: Any) -> Any:
        return self.parts.callbacks.pop(callback)

    def remove_callback(self, callback: Any) -> None:
        self.parts.callbacks.remove(callback)

    def save_model(self, output_dir: str | None = None) -> None:
        """Write the policy (and tokenizer) as a normal Hugging Face model directory."""
        p = self.parts
        output_dir = output_dir or p.args.output_dir
        p.accelerator.wait_for_everyone()
        state_dict = checkpoint.model_state(p.model, p.accelerator)  # every process: a sharded model is gathered
        if checkpoint.strategy.writer(p.args, p.accelerator):  # the main process, or each node's (save_on_each_node)
            checkpoint.save_pretrained(p.saved, output_dir, state_dict)

    def push_to_hub(self, commit_message: str = "End of training", blocking: bool = True, **card: Any) -> Any:
        """Save the model and its card to output_dir and push them to hub_model_id (`grpo.checkpoint.hub`)."""
        p = self.parts
        main = p.accelerator.is_main_process
        return p.hub.push(commit_message, blocking, self.save_model, p.saved.write_card, main, **card)

    def end(self) -> None:
        """Finish the trackers and end the process group: once, at the very end of a script (as the HF Trainer)."""
        end_run(self.accelerator)

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
        p, a = self.parts, self.parts.args
        start = time.perf_counter()
        with run_dir.holding(a.output_dir, p.accelerator):
            self.metrics = MetricsLogger(a.output_dir, p.accelerator, p.max_steps, not a.disable_tqdm)
            resume_from_checkpoint = checkpoint.strategy.resume_target(resume_from_checkpoint, a.resume_from_checkpoint)
            path = checkpoint.resolve(resume_from_checkpoint, a.output_dir) if resume_from_checkpoint else None
            if path:
                self._resume(path)
            p.model.train()
            total_loss, first = 0.0, self.state.global_step
            self._fire("train_begin")
            p.hub.start_completions_upload(p.accelerator.is_main_process)
            report = p.run_report.running(self.state, path, a.to_dict())  # run_info.json: this config
            rounds = p.rounds.running(p.loop.data_position)
            with self.metrics, report, preemption_guard() as preempted, rounds:
                step_start = None  # preempted in eval_on_start: as between steps (evaluating changes nothing)
                try:
                    if a.eval_on_start and p.evaluations:
                        self.evaluate()
                    while self.state.global_step < p.max_steps and not self.control.should_training_stop:
                        step_start = StepStart.capture(p.loop, p.buffer, self._window, self.state.num_input_tokens_seen)
                        total_loss += self._step()
                        if collectives.any_process(p.accelerator, preempted.is_set()):
                            self._save_and_exit(None)
                except Preempted as stop:
                    self._save_and_exit(step_start, stop.agreed)
            self._load_best_model()
            p.hub.finish_completions_upload()
            loss = total_loss / max(self.state.global_step, 1)
            summary = reporting.train_summary(a, self.state, time.perf_counter() - start, first, loss)
            last = dict((self.state.log_history or [{}])[-1])
            self.state.log_history, record = reporting.with_summary(
                self.state.log_history, summary, self.state.global_step
            )
            self._fire("log", logs=record)
            self._fire("train_end")
        end_training(p.accelerator)
        return TrainOutput(self.state.global_step, loss, {**last, **summary})

    def _step(self) -> float:
        """One optimizer step: gradient_accumulation_steps micro-steps, then update, log, checkpoint."""
        p = self.parts
        start = time.perf_counter()
        self.step_applied = False
        losses = []
        if self.state.global_step % p.steps_per_epoch == 0:
            self._fire("epoch_begin")
        self._fire("step_begin")
        for micro in range(p.args.gradient_accumulation_steps):
            if p.buffer.needs_generation(p.loop.micro_step):
                p.buffer.fill(self._generation(), p.loop.micro_step)
            batch = p.buffer.take(p.loop.micro_step)
            p.loop.micro_step += 1
            last = micro == p.args.gradient_accumulation_steps - 1
            with accumulating(p.accelerator, p.model, last), p.rounds.learning(p.loop.micro_step):
                losses.append(self._loss_and_backward(batch))
            if not last:
                self._fire("substep_end")
        update = self._update(losses)
        self._fire("step_end")
        self._log_step(update, time.perf_counter() - start)
        step = self.state.global_step
        self._checkpoint(self._evaluation_due(step))
        if step % p.steps_per_epoch == 0 or step == p.max_steps:
            self._fire("epoch_end")
        return update.loss

    # ---- generate, score, advantages, old/reference log-probs ------------------------------------------------

    def _generation(self) -> TrainBatch:
        """The next generation batch (`grpo.rounds.sequential.Rounds.next`: every process's rows, generated from the
        current policy or, async, an older one, scored, gathered, filtered), its advantages, this process's share
        collated with its old-policy and reference log-probs, logged."""
        p = self.parts
        where = (p.loop.data_position, p.unwrapped_model, self.policy_version, self.state)
        generated = p.rounds.next(*where)
        p.loop.data_position += generated.rounds
        advantages = self._advantages(generated.batch)
        batch = self._add_old_and_ref_logps(self._collate(generated.batch, advantages))
        self._log_generation(generated, advantages, batch)
        return batch

    def _advantages(self, scored: Scored, group_size: int | None = None) -> Advantages:
        """Group-relative advantages; groups of num_generations (an evaluation's: num_generations_eval)."""
        a = self.args
        size = group_size or a.num_generations
        return compute_advantages(
            scored.rewards, self.parts.rewards.weights, size, a.scale_rewards, a.multi_objective_aggregation
        )

    def _collate(self, scored: Scored, advantages: Advantages) -> TrainBatch:
        """This process's share of the generation batch as tensors; its `num_items_in_batch` counts the trained
        tokens of every process's share (`collectives.loss_tokens`)."""
        p, acc = self.parts, self.parts.accelerator
        mine = list(collectives.local_rows(len(scored), acc.process_index, acc.num_processes))
        batch = collate(
            scored.rollout.select(mine),
            advantages.advantages[mine],
            p.tokenizer.pad_token_id,
            p.args.mask_truncated_completions,
            group=data.prompt_groups(scored.rows, scored.rollout.prompt_ids, p.environments is not None)[mine],
            pad_to_multiple_of=p.args.pad_to_multiple_of,
        ).to(acc.device)
        tokens = collectives.loss_tokens(acc, batch.mask.sum(), p.args.average_tokens_across_devices)
        return dataclasses.replace(batch, num_items_in_batch=tokens)

    def _needs_old_logps(self) -> bool:
        """Whether a generation batch is trained on after an update (shared spec §4.1)."""
        return self.args.gradient_accumulation_steps % self.parts.buffer.cycle != 0

    def _add_old_and_ref_logps(self, batch: TrainBatch, old: bool = True) -> TrainBatch:
        """Old-policy log-probs only when the batch is reused after an update (and `old`); reference log-probs only
        when beta > 0. Chunked by the micro-batch size, no gradient checkpointing needed."""
        p = self.parts
        chunk = p.args.per_device_train_batch_size
        needs_old, old_logps = old and self._needs_old_logps(), batch.old_logps  # async: the behaviour policy's
        ref = None
        if needs_old and old_logps is None:
            old_logps = p.training_pass.logps(p.model, batch, chunk)
        if p.ref_model is not None:
            ref = p.training_pass.logps(p.ref_model, batch, chunk)
        elif p.ref_from_adapters:
            with lora.adapters_disabled(p.model):
                ref = p.training_pass.logps(p.model, batch, chunk)
        return dataclasses.replace(batch, old_logps=old_logps, ref_logps=ref)

    # ---- loss, backward, update ------------------------------------------------------------------------------

    def _loss_and_backward(self, batch: TrainBatch) -> float:
        """The micro-batch's share of the step's loss, backpropagated; returns its value."""
        p = self.parts
        a, acc = p.args, p.accelerator
        t0 = time.perf_counter()
        trained = self.training_pass.train(self.model, batch, entropy_grad=p.loss_terms.entropy_grad)
        logps, entropies = trained.logps, trained.entropies
        assert entropies is not None  # the gradient pass scores them
        self.state.total_flos += reporting.micro_batch_flos(p.flop_parameters, batch)
        entropy_mask = None
        if a.top_entropy_quantile < 1.0:
            everyone = collectives.gather_values(entropies.detach()[batch.mask.bool()].float(), acc)
            entropy_mask = high_entropy_mask(entropies.detach(), batch.mask, everyone, a.top_entropy_quantile)
        scale = LossScale(
            batch.num_items_in_batch, acc.num_processes, a.gradient_accumulation_steps, a.steps_per_generation
        )
        is_ratio, sampler_logps, sampling = p.correction(logps, batch.old_logps, batch.sampling_logps, batch.mask)
        loss, metrics = policy_loss(
            logps,
            batch.old_logps,
            batch.advantages,
            batch.mask,
            p.loss_params,
            batch.ref_logps,
            entropy_mask=entropy_mask,
            scale=scale,
            sampler_logps=sampler_logps,
            is_ratio=is_ratio,
        )
        bonus_mask = batch.mask if entropy_mask is None else batch.mask * entropy_mask
        loss, extra = p.loss_terms.add(loss, entropies, bonus_mask, trained.aux_loss)
        # the loss and the token count in one host sync (with reduce_stats' below, two per micro-step)
        loss_value, tokens = torch.stack([loss.detach().float(), batch.mask.sum().float()]).tolist()
        if not math.isfinite(loss_value):
            raise TrainingError(optimization.nonfinite_message(self.state.global_step + 1, "loss", loss_value, False))
        backward(acc, loss)
        stats = dict(metrics.stats, **sampling, **extra, entropy=masked_mean_stat(entropies.detach(), batch.mask))
        if self.args.async_generation:  # the weight against the behaviour policy that sampled (old_logps)
            stats.update(sampling_correction.importance_stats(logps.detach(), batch.old_logps, batch.mask))
        self._window.add_many(collectives.reduce_stats(stats, acc))
        self._window.add("timing/training_tokens_per_s", tokens / max(time.perf_counter() - t0, 1e-9))
        if self.training_pass.tree:  # packing "tree" or "auto": the share of the pass's pieces laid out as trees
            self._window.add("packing/trees", trained.layouts.count("trees") / max(len(trained.layouts), 1))
        return loss_value

    def _update(self, losses: list[float]) -> Update:
        """Clip and check the accumulated gradients, apply them, advance the schedule."""
        p, acc = self.parts, self.parts.accelerator
        # each process's loss is its share of the global one: their mean is the loss of the whole batch
        loss = collectives.process_mean(acc, sum(losses))
        grad_norm = p.gradient_check(acc, p.model, p.optimizer, self.state.global_step + 1)
        self._fire("pre_optimizer_step")
        p.optimizer.step()
        self._fire("optimizer_step")
        self.step_applied = True
        if not acc.optimizer_step_was_skipped:  # fp16 loss scaling skips a step that overflowed
            p.lr_scheduler.step()
        p.optimizer.zero_grad(set_to_none=True)
        self.policy_version += 1  # the producer pushes these weights before its next generation
        self.state.global_step += 1
        self._window.add_many(p.loss_terms.end_step(acc))  # the adaptive entropy controller
        ref_sync.after_step(p.args, p.model, p.ref_model, self.state.global_step)  # sync_ref_model (TR-DPO)
        self.state.epoch = self.state.global_step / p.steps_per_epoch
        return Update(loss, grad_norm, p.lr_scheduler.get_last_lr()[0])

    # ---- log and checkpoint ----------------------------------------------------------------------------------

    def _log_generation(self, generated: GenerationBatch, advantages: Advantages, batch: TrainBatch) -> None:
        p = self.parts
        for name, value in generated.logged:  # reward functions' log_metric calls; an async round's staleness
            self._window.add(name, value)
        seen, mode = self.state.num_input_tokens_seen, p.args.include_num_input_tokens_seen
        rollout = generated.batch.rollout
        self.state.num_input_tokens_seen = reporting.count_tokens(
            self._window, seen, rollout, batch, p.accelerator, mode
        )
        names, tools, dynamic = p.rewards.names, p.rollouts.uses_tools, p.args.dynamic_sampling
        self._window.add_many(generation_metrics(generated, advantages, names, dynamic, tools))
        self.latest_batch = (generated.batch, advantages.advantages)  # trainer._logs
        if p.completion_log is not None:
            p.completion_log.record(generated.batch, advantages.advantages, p.tokenizer)

    def _log_step(self, update: Update, seconds: float) -> None:
        p, step = self.parts, self.state.global_step
        values = dict(loss=update.loss, grad_norm=update.grad_norm, learning_rate=update.learning_rate)
        self._window.add_many(dict(values, step_time=seconds))
        self._window.advance(step)
        if reporting.should_log(p.args, step, p.max_steps, p.steps_per_epoch) or self.control.should_log:
            self.state.log_history.append(self._window.log(step, self.state.epoch))
            if p.completion_log is not None and p.accelerator.is_main_process:
                p.completion_log.flush(step, self._window.console)
            self._fire("log", logs=self.state.log_history[-1])
            p.diagnosis.update(self.state.log_history, p.accelerator.is_main_process)
            p.run_report.refresh()  # report.html, when due
        elif p.args.logging_strategy == "no":
            self._window.discard()  # no row will ever average this window
        reporting.release_memory_on_schedule(p.args, step, p.accelerator.device)  # torch_empty_cache_steps

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
        p, step, path = self.parts, self.state.global_step, None
        if checkpoint.strategy.should_save(p.saved) or self.control.should_save:
            path = self._save(step)
        if evaluate:
            try:
                self.evaluate()
            except Preempted as stop:
                if p.accelerator.num_processes > 1 and not stop.agreed:
                    raise
                self._save_and_exit(None)  # the step is complete: as between steps
            if path is not None:
                self._record_best(step, path)
                checkpoint.add_evaluation(p.saved, path)
            elif checkpoint.strategy.should_save(p.saved) or self.control.should_save:
                path = self._save(step)
        if path is not None:
            # hub_strategy (main process, in the background)
            p.hub.after_checkpoint(path, step, p.processing_class, p.saved.write_card)
            self._fire("save")

    def _save(self, step: int) -> str:
        """checkpoint-<step> (every process), the best checkpoint when its step's logged metric beats the best."""
        p = self.parts
        self._record_best(step, checkpoint.path_of(p.args.output_dir, step))  # trainer_state.json names the best
        return checkpoint.save(p.saved, step, self._window.state_dict())

    def _record_best(self, step: int, path: str) -> None:
        best = checkpoint.strategy.new_best(self.parts.saved, step, path)
        if best is not None:
            for name, value in best.items():
                setattr(self.state, name, value)

    def _resume(self, path: str) -> None:
        """Continue the run from checkpoint `path` (every process): its parts restored (`checkpoint.load`), then
        the trainer state and the logging window it holds."""
        p = self.parts
        resumed = checkpoint.load(p.saved, path)
        for name, value in resumed.state.items():
            setattr(self.state, name, value)
        self._window.load_state_dict(resumed.metrics_window)
        self._window.resume(self.state.global_step)
        p.diagnosis.replay(self.state.log_history)  # the findings before the resume, not warned again
        self.policy_version += 1  # the loaded weights
        logger.info("Resumed from %s at step %d.", path, self.state.global_step)

    def _save_and_exit(self, step_start: StepStart | None, agreed: bool = False) -> NoReturn:
        """After SIGTERM (`grpo.rounds.preemption`): the state at the end of the last complete step saved when that
        is safe (inside a step: `step_start` puts back what the step changed), then exit with status 143."""
        p, step, mid_step = self.parts, self.state.global_step, step_start is not None
        p.rounds.halt()  # an asynchronous producer stops before anything is saved or settled
        save = None
        if preemption.safe_to_save(step, mid_step, self.step_applied, p.accelerator.num_processes, agreed):
            if step_start is not None:
                step_start.restore(p.loop, p.buffer, self._window)
                self.state.num_input_tokens_seen = step_start.tokens_seen
            if not os.path.exists(checkpoint.path_of(p.args.output_dir, step)):
                save = lambda: self._save(step)  # noqa: E731
        preemption.save_and_exit(save, self._window, p.accelerator, p.args.output_dir, p.args.save_only_model, mid_step)

    def _load_best_model(self) -> None:
        """load_best_model_at_end: the best checkpoint's weights into the policy (a new policy version)."""
        best = checkpoint.strategy.best_to_load(self.parts.saved)
        if best is not None:
            checkpoint.load_model_weights(self.parts.saved, best)
            self.policy_version += 1

    # ---- evaluation and callbacks ----------------------------------------------------------------------------

    def evaluate(self, eval_dataset: Any = None, metric_key_prefix: str = "eval") -> dict[str, float | None]:
        """Completions of every eval prompt scored by the reward functions: the `eval_` metrics
        (`grpo.rounds.evaluation`; None where a value is not finite), logged and passed to the callbacks'
        on_evaluate. Changes nothing training depends on."""
        p = self.parts
        runs = p.evaluations
        if eval_dataset is not None:
            runs = evaluation.build(eval_dataset, p.args, p.prompts, p.accelerator.num_processes)
        state, policy = self.state, (p.unwrapped_model, self.policy_version)
        metrics = p.evaluator.run(runs, metric_key_prefix, *policy, state.global_step, self._eval_loss)
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
        p = self.parts
        if not p.evaluations:
            return False
        due = p.evaluator.due(p.evaluations, step, p.max_steps, p.steps_per_epoch)
        return due or self.control.should_evaluate

    def _eval_loss(self, scored: Scored, group_size: int) -> float | None:
        """The policy loss of one evaluation batch (every process's rows), as the HF Trainer's `eval_loss`: the
        batch's group advantages, on-policy (ratio 1; with beta > 0 the KL to the reference), each process's rows
        through the training pass without gradient, the processes' losses weighted by their rows. None for a batch
        some process has no rows of (a last, short batch): a sharded model's forward is collective, so all or none
        run it."""
        p = self.parts
        acc, a = p.accelerator, p.args
        mine = list(collectives.local_rows(len(scored), acc.process_index, acc.num_processes))
        if collectives.any_process(acc, not mine):
            return None
        advantages = self._advantages(scored, group_size).advantages[mine]
        pad = p.tokenizer.pad_token_id
        batch = collate(scored.rollout.select(mine), advantages, pad, a.mask_truncated_completions).to(acc.device)
        batch = self._add_old_and_ref_logps(batch, old=False)
        logps = p.training_pass.logps(p.model, batch, a.per_device_eval_batch_size)
        loss, _ = policy_loss(logps, None, batch.advantages, batch.mask, p.loss_params, batch.ref_logps)
        rows = collectives.process_mean(acc, float(len(mine)))
        return collectives.process_mean(acc, loss.item() * len(mine)) / rows

    def _fire(self, event: str, **kwargs: Any) -> None:
        self.parts.callbacks.fire(event, self.args, self.state, **kwargs)
