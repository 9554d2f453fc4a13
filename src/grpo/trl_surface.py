"""The trainer's public surface beyond train() and evaluate(), as TRL's GRPOTrainer and the HF Trainer have it (a
mixin of `GRPOTrainer`): what TRL users' scripts, callbacks and tests read (the reward functions, their names,
weights and tokenizers, the tools, the MoE router loss and entropy bonus switches, the latest generation batch as
TRL's `_logs`, TRL's two mask helpers), the user methods save_model, push_to_hub and end; and TRL 1.16's settings for
streaming datasets (`stream_settings`). Each reads the trainer's own state; the training loop uses none of it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from grpo import checkpoint
from grpo.algo.losses import entropy_cut_mask, off_policy_mask
from grpo.config import ResolvedConfig
from grpo.data.datasets import is_stream
from grpo.distributed import collectives
from grpo.distributed.accelerator import end_run
from grpo.observe.metrics import trl_logs

if TYPE_CHECKING:
    from grpo.agent import Environments, Rollouts
    from grpo.algo.loss_terms import LossTerms
    from grpo.checkpoint.hub import Hub, PublishedRun
    from grpo.checkpoint.run import CheckpointedRun
    from grpo.observe.callbacks import Callbacks
    from grpo.rewards.calling import RewardFunctions
    from grpo.rounds.groups import Scored

logger = logging.getLogger("grpo")


class TrlSurface:
    # what GRPOTrainer, the class this mixes into, sets
    args: ResolvedConfig
    accelerator: Any
    rewards: RewardFunctions
    rollouts: Rollouts
    environments: Environments | None
    loss_terms: LossTerms
    latest_batch: tuple[Scored, torch.Tensor] | None
    callback_handler: Callbacks
    hub: Hub

    @property
    def reward_func_names(self) -> list[str]:
        """The reward functions' names, as their metrics (rewards/<name>/mean) and TRL name them: a function's
        __name__, a reward model's name (the last part of its path), an environment's get_reward its class name."""
        return list(self.rewards.names)

    @property
    def reward_funcs(self) -> list[Callable]:
        """The reward functions as called: reward models as callables, an environment's get_reward last (a function
        of `environments=[...]`, None for another class's rollouts), as TRL holds them."""
        return list(self.rewards.funcs)

    @property
    def tools(self) -> list[Callable]:
        """The functions the model may call: the `tools` given, then each environment class's methods (its own
        instance's at each rollout), as TRL lists them."""
        given = [tool.fn for tool in self.rollouts.tools.tools.values()]
        methods = self.environments.methods if self.environments is not None else {}
        return given + [getattr(cls, tool.name) for cls, tools in methods.items() for tool in tools]

    @property
    def reward_weights(self) -> torch.Tensor:
        """Each reward function's weight (reward_weights, 1 for an environment's get_reward), as TRL holds them."""
        return self.rewards.weights

    @property
    def reward_processing_classes(self) -> list[Any]:
        """Each reward function's tokenizer, as TRL holds them: a reward model's (given or its own), None for a plain
        function."""
        return [getattr(func, "tokenizer", None) for func in self.rewards.funcs]

    @property
    def aux_loss_enabled(self) -> bool:
        """Whether a mixture-of-experts router's load-balancing loss is added to the loss (logged as `aux_loss`)."""
        return self.loss_terms.router_aux

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus's coefficient now (it moves with use_adaptive_entropy; 0 when the bonus is off)."""
        entropy = self.loss_terms.entropy
        return entropy.coef if entropy is not None else 0.0

    @property
    def _logs(self) -> dict[str, Any]:
        """The latest generation batch as TRL's `trainer._logs` holds it (callbacks written for TRL read it):
        prompt, completion, rewards, advantages, extra (`log_extra` columns), images
        (`grpo.observe.metrics.trl_logs`)."""
        scored, advantages = self.latest_batch or (None, None)
        return trl_logs(scored, advantages, self.rewards.names, self.args.log_multimodal)

    get_off_policy_mask = staticmethod(off_policy_mask)  # (advantages, logps, sampling logps, mask, threshold)

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """The non-pad tokens whose entropy is at or above the `threshold` quantile of every process's non-pad
        entropies (TRL's helper: threshold = 1 - top_entropy_quantile)."""
        everyone = entropies[mask.bool()].float()
        if self.accelerator.num_processes > 1:
            everyone = collectives.gather_values(everyone, self.accelerator)
        return entropy_cut_mask(entropies, mask, everyone, threshold)

    # ---- the HF Trainer's user methods -----------------------------------------------------------------------

    @property
    def control(self) -> Any:
        return self.callback_handler.control

    def add_callback(self, callback: Any) -> None:
        self.callback_handler.add(callback)

    def pop_callback(self, callback: Any) -> Any:
        return self.callback_handler.pop(callback)

    def remove_callback(self, callback: Any) -> None:
        self.callback_handler.remove(callback)

    def push_to_hub(self, commit_message: str = "End of training", blocking: bool = True, **card: Any) -> Any:
        """Save the model and its card to output_dir and push them to hub_model_id (`grpo.checkpoint.hub`)."""
        return self.hub.push(cast("PublishedRun", self), commit_message, blocking, **card)

    def end(self) -> None:
        """Finish the trackers and end the process group: once, at the very end of a script (as the HF Trainer)."""
        end_run(self.accelerator)

    def save_model(self, output_dir: str | None = None) -> None:
        """Write the policy (and tokenizer) as a normal Hugging Face model directory."""
        output_dir = output_dir or self.args.output_dir
        run = cast("CheckpointedRun", self)  # GRPOTrainer, the class this mixes into, is one
        self.accelerator.wait_for_everyone()
        state_dict = checkpoint.model_state(run)  # every process: a sharded model is gathered
        if checkpoint.strategy.writer(run):  # the main process, or each node's with save_on_each_node
            checkpoint.save_pretrained(run, output_dir, state_dict)


def stream_settings(args: ResolvedConfig, train_dataset: Any, eval_dataset: Any) -> None:
    """TRL 1.16's settings for streaming datasets, kept in the config users read: `accelerator_config`'s
    dispatch_batches must not be True and becomes False, and a streaming train dataset sets dataloader_num_workers
    to 0 (with a warning). grpo reads rows itself, so neither shapes its reading; they say what the run did."""
    evals = list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]
    if not (is_stream(train_dataset) or any(is_stream(e) for e in evals)):
        return
    if args.accelerator_config.dispatch_batches:
        raise ValueError(
            "Iterable datasets require `dispatch_batches=False`, but it is set to `True` in `accelerator_config`: "
            "set it to False (a streaming dataset is read by each process, not dispatched from the first)."
        )
    args.accelerator_config.dispatch_batches = False
    if is_stream(train_dataset) and args.dataloader_num_workers != 0:
        logger.warning(
            "Iterable datasets require `dataloader_num_workers=0` to keep each prompt's generations together; "
            "overriding the provided value (%s).",
            args.dataloader_num_workers,
        )
        args.dataloader_num_workers = 0
