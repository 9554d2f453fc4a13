"""The entropy bonus's coefficient: fixed (`entropy_coef`), or held near a target entropy by a controller
(`use_adaptive_entropy`, TRL 1.16's rule). Pure Python: the trainer hands it each optimizer step's entropy.

Adaptive rule, per optimizer step:
- during the step every micro-batch applies `coef` if the previous step's entropy was <= `entropy_target`, else
  0 (the previous entropy starts at +inf, so the first step applies no bonus);
- at the step's end, the step's token-weighted entropy over every process (`world`) moves the coefficient:
  `coef + delta` capped at `entropy_coef_max` when world <= target (too little exploration: push harder),
  `coef - delta` floored at `entropy_coef_min` otherwise; `world` becomes the previous entropy.
The state (coefficient, previous entropy) is two numbers, saved in checkpoints as JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from grpo.config import ResolvedConfig


@dataclass
class EntropyController:
    coef: float
    adaptive: bool = False
    target: float = 0.2
    delta: float = 0.005
    coef_min: float = 0.0
    coef_max: float = 1.0
    last_world_entropy: float = math.inf

    @classmethod
    def of(cls, args: ResolvedConfig) -> EntropyController | None:
        """The config's controller; None when the bonus is off (entropy_coef 0 and not adaptive)."""
        if args.entropy_coef == 0.0 and not args.use_adaptive_entropy:
            return None
        return cls(
            coef=args.entropy_coef,
            adaptive=args.use_adaptive_entropy,
            target=args.entropy_target,
            delta=args.entropy_coef_delta,
            coef_min=args.entropy_coef_min,
            coef_max=args.entropy_coef_max,
        )

    @property
    def applied(self) -> float:
        """The coefficient every micro-batch of the current step applies."""
        if self.adaptive and not self.last_world_entropy <= self.target:
            return 0.0
        return self.coef

    def end_step(self, entropy_sum: float, tokens: float) -> None:
        """The step's entropy (sum over its tokens, all processes, and their count) updates the coefficient."""
        if not self.adaptive:
            return
        world = entropy_sum / max(tokens, 1.0)
        if world <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_world_entropy = world

    def state_dict(self) -> dict[str, float | None]:
        """JSON-ready (the initial +inf is written as None)."""
        last = self.last_world_entropy
        return {"entropy_coef": self.coef, "last_world_entropy": last if math.isfinite(last) else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        coef, last = state.get("entropy_coef"), state.get("last_world_entropy")
        if not isinstance(coef, (int, float)) or not (last is None or isinstance(last, (int, float))):
            raise ValueError(f"the entropy controller's state {state!r} is not two numbers")
        self.coef = float(coef)
        self.last_world_entropy = math.inf if last is None else float(last)
