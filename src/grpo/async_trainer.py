"""`AsyncGRPOTrainer`: TRL 1.16's asynchronous GRPO trainer's constructor on `GRPOTrainer` with async_generation
(`grpo.rounds.asynchronous`): generation overlapped with training, deterministic, resumable exactly.

    from grpo import AsyncGRPOTrainer, AsyncGRPOConfig
    trainer = AsyncGRPOTrainer(model="path/to/model", reward_funcs=reward, train_dataset=ds, args=AsyncGRPOConfig(...))

Unlike TRL's, it takes every GRPOTrainer feature (loss types, beta, images, dynamic sampling, evaluation, the fast
engine, vLLM colocate or server). TRL's `rollout_worker` and `weight_transfer` plug-ins have no counterpart: the
producer is grpo's own thread, the weights reach the engine through its `sync_weights`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from grpo.config.async_config import AsyncGRPOConfig
from grpo.models.modeling import model_name
from grpo.trainer import GRPOTrainer

logger = logging.getLogger("grpo")


class AsyncGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with async_generation on, with TRL 1.16 AsyncGRPOTrainer's arguments in its order."""

    def __init__(
        self,
        model: Any,
        reward_funcs: Callable | list[Callable] | None = None,
        args: AsyncGRPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        callbacks: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        peft_config: Any = None,
        tools: Any = None,
        environment_factory: Any = None,
        rollout_worker: Any = None,
        weight_transfer: Any = None,
    ) -> None:
        given = [
            name
            for name, value in (("rollout_worker", rollout_worker), ("weight_transfer", weight_transfer))
            if value is not None
        ]
        if given:
            raise ValueError(
                f"AsyncGRPOTrainer: {' and '.join(given)} (TRL's plug-ins for its rollout process) have no counterpart "
                "in grpo, whose producer is its own thread and whose engines take weights through sync_weights. Leave "
                "them out; use_vllm / vllm_mode='server' choose the engine."
            )
        if args is None:
            args = AsyncGRPOConfig(output_dir=f"{model_name(model)}-AsyncGRPO")
        elif not args.async_generation:
            logger.info("AsyncGRPOTrainer: async_generation=True (the config had it off).")
            args.async_generation = True
        super().__init__(
            model,
            reward_funcs,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            tools=tools,
            environment_factory=environment_factory,
        )
