"""`SamplingSettings`: what a generation engine reads of the config, and nothing else, as `LossParams` is what the
loss reads. `grpo.rollout.build_engine` builds it once (`SamplingSettings.of(config)`) and hands it to the engine it
picks; an engine can be built and tested from these few values alone."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpo.config import ResolvedConfig


@dataclass(frozen=True)
class SamplingSettings:
    """How completions are sampled: the config's fields of the same names (`structured_outputs_regex` is
    `vllm_structured_outputs_regex`). `generation_kwargs` are applied over the others by the engines that take
    them (each refuses the keys it cannot honour). `seed` seeds vLLM's engines and a server's requests.
    `sampler_logps`: the learner takes the behaviour policy's log-probs from the engine's own
    (`async_behaviour_logps="sampler"` with `async_generation`), so the engine must record them (no beam search)."""

    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: Mapping[str, Any] = field(default_factory=dict)
    cache_implementation: str | None = None
    structured_outputs_regex: str | None = None
    seed: int = 42
    sampler_logps: bool = False

    @classmethod
    def of(cls, config: ResolvedConfig) -> SamplingSettings:
        """The settings of a (resolved) GRPOConfig."""
        return cls(
            max_completion_length=config.max_completion_length,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            min_p=config.min_p,
            repetition_penalty=config.repetition_penalty,
            generation_kwargs=dict(config.generation_kwargs or {}),
            cache_implementation=config.cache_implementation,
            structured_outputs_regex=config.vllm_structured_outputs_regex,
            seed=config.seed,
            sampler_logps=config.async_generation and config.async_behaviour_logps == "sampler",
        )
