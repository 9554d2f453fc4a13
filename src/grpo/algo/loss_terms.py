"""Terms the trainer adds to the policy loss of `grpo.algo.losses` (shared spec §2.8, TRL 1.16):

- the entropy bonus, `loss - c * mean_t(H_t) / GA` over the trained (and kept high-entropy) tokens, on when
  `entropy_coef != 0` or `use_adaptive_entropy`; `c` comes from `grpo.algo.entropy_control` (adaptive: moved at each
  optimizer step by the step's entropy over every process). Metrics `policy_loss` (the step's loss without the
  bonus, reduced like `loss`, for every loss type; TRL 1.16 logs the mean of its micro-batches' values, 1/GA of
  that for dapo, cispo and vespo under accumulation) and `entropy_coef` (at each optimizer step);
- a mixture-of-experts router's load-balancing loss, `loss + router_aux_loss_coef * aux_loss / GA`, on when the
  model's config has `output_router_logits` and the coefficient (`router_aux_loss_coef`, None: the config's own)
  is not 0. Metric `aux_loss`. A model whose forward takes no `output_router_logits` computes no such loss (Llama 4,
  DeepSeek-V3, GLM-4.5 in transformers): the config's own coefficient is then not used (a warning says so) and a
  coefficient set in GRPOConfig is an error at start-up, not at the first training pass.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from grpo.algo.entropy_control import EntropyController
from grpo.algo.losses import Stat, entropy_bonus
from grpo.config import ResolvedConfig


def router_aux_coef(model: Any, args: ResolvedConfig) -> float:
    """The weight of the router's load-balancing loss for this model (0.0: off). A non-zero
    `router_aux_loss_coef` on a model that returns no router logits is an error, as in TRL 1.16."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    coef = args.router_aux_loss_coef
    name = type(model).__name__
    if coef and not hasattr(config, "output_router_logits"):
        raise ValueError(
            f"GRPOConfig.router_aux_loss_coef is {coef}, but {name} is not a mixture-of-experts "
            "model that returns router logits, so there is no load-balancing loss to weight. Leave "
            "router_aux_loss_coef at None (or 0)."
        )
    if not hasattr(config, "output_router_logits"):
        return 0.0
    weight = float(getattr(config, "router_aux_loss_coef", 0.0) if coef is None else coef)
    if weight and not _takes_router_logits(model):
        # TRL 1.16 asks such a model for router logits anyway and fails at its first training pass
        if coef is not None:
            raise ValueError(
                f"GRPOConfig.router_aux_loss_coef is {coef}, but {name}'s forward computes no load-balancing loss "
                "(it takes no output_router_logits), so there is none to weight. Leave router_aux_loss_coef at None "
                "(or 0)."
            )
        warnings.warn(
            f"{name} computes no router load-balancing loss (its forward takes no output_router_logits), so it "
            f"trains without one; its config's router_aux_loss_coef ({weight}) is not used.",
            stacklevel=2,
        )
        return 0.0
    return weight


def _takes_router_logits(model: Any) -> bool:
    """Whether `model`'s forward can return a router loss: transformers' mixture-of-experts models that compute one
    take `output_router_logits`; a class from elsewhere is trusted (the training pass checks its outputs)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under a PEFT wrapper
    cls = type(base)
    if not cls.__module__.startswith("transformers."):
        return True
    return "output_router_logits" in inspect.signature(cls.forward).parameters


class LossTerms:
    """The entropy bonus and the router loss of one run; `add` per micro-batch, `end_step` per optimizer step."""

    def __init__(self, args: ResolvedConfig, aux_coef: float) -> None:
        self.accumulation_steps = args.gradient_accumulation_steps
        self.entropy = EntropyController.of(args)
        self.aux_coef = aux_coef
        self.window: torch.Tensor | None = None  # this step's (entropy sum, token count) on this process

    @property
    def entropy_grad(self) -> bool:
        """Whether the entropies need a gradient (the bonus is on)."""
        return self.entropy is not None

    @property
    def router_aux(self) -> bool:
        return self.aux_coef != 0.0

    def add(
        self, loss: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor, aux_loss: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, Stat]]:
        """The micro-batch's loss with the terms added (`mask`: the tokens the bonus acts on), and their metrics."""
        ga, stats = self.accumulation_steps, {}
        if self.entropy is not None:
            # times GA: the window's mean over its GA micro-batches is then the step's policy loss
            stats["policy_loss"] = Stat("mean", torch.stack([loss.detach().float() * ga, loss.new_ones(())]))
            loss = loss - self.entropy.applied * entropy_bonus(entropies, mask) / ga
            mask = mask.to(entropies.dtype)
            part = torch.stack([(entropies.detach() * mask).sum(), mask.sum()]).float()
            self.window = part if self.window is None else self.window + part
        if self.router_aux and aux_loss is not None:
            loss = loss + self.aux_coef * aux_loss / ga
            stats["aux_loss"] = Stat("mean", torch.stack([aux_loss.detach().float(), aux_loss.new_ones(())]))
        return loss, stats

    def end_step(self, accelerator: Any) -> dict[str, float]:
        """After the optimizer step: the controller sees the step's entropy over every process; the coefficient
        the next step applies is logged."""
        if self.entropy is None:
            return {}
        if self.entropy.adaptive and self.window is not None:
            total = accelerator.reduce(self.window.to(accelerator.device), reduction="sum")
            self.entropy.end_step(total[0].item(), total[1].item())
        self.window = None
        return {"entropy_coef": self.entropy.coef}

    def state_dict(self) -> dict[str, Any]:
        return self.entropy.state_dict() if self.entropy is not None else {}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.entropy is not None and state:
            self.entropy.load_state_dict(state)
