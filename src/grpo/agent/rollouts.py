"""From dataset rows to completions, the one call the trainer makes per generation round:

    generated = rollouts(rows, examples)      # Generated(rollout, prompts, columns)

Single-turn: each row's prompt (tokenized once) goes to the engine. With `tools` or `environment_factory`, the
prompts are rendered with the tools' schemas and every completion runs the tool loop (`grpo.agent.loop`);
with environments, each rollout first gets its instance and `reset(**row)` (`grpo.agent.environments`). With
`rollout_func` (TRL 1.16's signature, shared spec §6.4) the user's function replaces tokenization and generation,
and the tool loop still runs on its output when there are tools.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo.agent.environments import EMPTY_PROMPT, Environments
from grpo.agent.loop import ToolLoop
from grpo.agent.rollout_output import MASK_KEY, ROLLOUT_KEYS, checked, policy_vocab_size
from grpo.agent.template import check_tool_template, rerendering
from grpo.agent.tools import ToolSet
from grpo.base.records import Rollout, expand, group_requests
from grpo.base.sigterm import Preempted
from grpo.config import ResolvedConfig
from grpo.data import prompts as data
from grpo.rollout.base import Engine

logger = logging.getLogger("grpo")


@dataclass
class Generated:
    rollout: Rollout
    prompts: list  # the prompts as reward functions get them (with what an environment's reset added)
    columns: dict[str, list] = field(default_factory=dict)  # more keywords for reward functions, one value per row


class Rollouts:
    def __init__(
        self,
        engine: Engine,
        source: data.PromptSource,
        args: ResolvedConfig,
        stop_ids: Sequence[int],
        any_process: Callable[[bool], bool],
        tools: Sequence[Callable] | None = None,
        environments: Environments | None = None,
        rollout_func: Callable | None = None,
        trainer: Any = None,
    ) -> None:
        self.engine = engine
        self.source = source
        self.tokenizer = source.tokenizer
        self.stop_ids = set(stop_ids)
        self.tools = ToolSet.of(tools or [])
        self.environments = environments
        self.rollout_func = rollout_func
        self.trainer = trainer
        self.vocab_size: int | None = None  # the policy's, read at rollout_func's first call (its ids are checked)
        self.uses_tools = bool(self.tools) or bool(environments and environments.has_tools)
        if environments is not None:  # a tool and an environment method of the same name: refused now, not mid-run
            for pool in environments.pool.values():
                self.tools + environments.tools_of(pool[0])
        self.tool_names = [*self.tools.tools, *(environments.tool_names if environments else ())]
        self.loop = None
        if self.uses_tools:
            check_tool_template(self.tokenizer, args.chat_template_kwargs, self.stop_ids)
            source.tools = self.tools.schemas
            rendered = args.turn_context == "rendered"
            if args.turn_context == "auto":
                how = rerendering(self.tokenizer, args.chat_template_kwargs)
                rendered = how is not None
                logger.info(
                    "turn_context='auto': %s",
                    f"the chat template re-renders earlier assistant turns ({how}), so each turn is sampled after "
                    "the conversation as it renders it ('rendered')"
                    if rendered
                    else "the chat template keeps earlier assistant turns as they were, so turns are appended",
                )
            self.loop = ToolLoop(
                self.tokenizer,
                stop_ids,
                args.max_completion_length,
                args.max_tool_calling_iterations,
                source.context,
                args.tool_call_timeout,
                args.chat_template_kwargs,
                any_process,
                source.processor,
                rendered,
            )

    def __call__(
        self, rows: Sequence[int], examples: Sequence[dict], source: data.PromptSource | None = None, engine: Any = None
    ) -> Generated:
        """Completions of `examples` (rows `rows` of the source's dataset: the training one unless `source` is
        given), from `engine` (None: the training engine)."""
        source = source or self.source
        engine = engine or self.engine
        prompts = [example.get("prompt") for example in examples]
        columns: dict[str, list] = {}
        toolsets = [self.tools] * len(rows)
        records = None  # each row's prompt record (the tool loop renders rendered turns from its messages)
        if self.environments is not None:
            instances, prompts = self.environments.start(examples)
            toolsets = [self.tools + self.environments.tools_of(env) for env in instances]
            columns["environments"] = instances
        try:
            if self.rollout_func is not None:
                rollout, extra = self._custom(prompts)
                columns.update(extra)
            else:
                if self.environments is None:
                    requests = source.requests(rows)
                    records = [request.prompt for request in expand(requests)]
                    if source.processor is not None:  # reward functions get the prompts with their image blocks
                        prompts = [_as_given(source[row], prompt) for row, prompt in zip(rows, prompts)]
                else:
                    made = [source.make(r, p, t.schemas, e) for r, p, t, e in zip(rows, prompts, toolsets, examples)]
                    requests = source.fit(group_requests(made))
                    records = made
                rollout = engine.generate(requests)
        except Preempted as stop:
            if self.loop is None or stop.agreed:
                raise
            self.loop.meet(stop)  # the other processes may already wait in the tool loop
        if self.loop is not None:
            rollout = self.loop.run(engine, rollout, toolsets, records)
        return Generated(rollout, prompts, columns)

    def _custom(self, prompts: list) -> tuple[Rollout, dict[str, list]]:
        """rollout_func(prompts, trainer)'s output, checked (`grpo.agent.rollout_output`), as a Rollout, and its
        further keys as reward columns."""
        assert self.rollout_func is not None  # called only with one
        n = len(prompts)
        if n == 0:  # a process with no rows in this (evaluation) batch
            return Rollout([], [], [], []), {}
        output = self.rollout_func(copy.deepcopy(prompts), self.trainer)
        if self.vocab_size is None:
            model = getattr(self.trainer, "unwrapped_model", None)
            self.vocab_size = policy_vocab_size(model, self.tokenizer) if model is not None else len(self.tokenizer)
        prompt_ids, completion_ids, logprobs, mask = checked(output, n, self.vocab_size, self.environments is not None)
        conversational = [data.is_conversational(p) for p in prompts]
        rollout = Rollout(
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            sampling_logps=logprobs,
            truncated=[not c or c[-1] not in self.stop_ids for c in completion_ids],
            texts=self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
            loss_mask=mask if mask is not None and self.loop is None else [],
        )
        rollout.messages = [
            [{"role": "assistant", "content": text}] if conv else None
            for text, conv in zip(rollout.texts, conversational)
        ]
        extra = {
            k: list(v) if isinstance(v, (list, tuple)) and len(v) == n else [v] * n
            for k, v in output.items()
            if k not in ROLLOUT_KEYS and k != MASK_KEY
        }
        return rollout, extra


def _as_given(record: Any, prompt: Any) -> Any:
    """A prompt as reward functions see it: a vision-language model's conversation with its image blocks (TRL 1.16)."""
    return [dict(m) for m in record.messages] if record.messages is not None else prompt


__all__ = ["EMPTY_PROMPT", "Generated", "Rollouts"]
