"""The multi-turn tool loop (shared spec §6.2), above the engine: it works with every engine behind the rollout
interface.

After the first turn of every completion, rows whose last turn makes tool calls run them (`tools.run_calls`), get
one tool message per call, and generate their next turn (one sample per row), until a turn makes no call,
`max_tool_calling_iterations` rounds have run, or the tool results would not leave room for another token within
`max_completion_length` (the whole multi-turn completion counts; the results are then not added and the row ends).
Results certain not to fit are found from their length, before they are tokenized (`grpo.agent.budget`).

What each turn after the first continues (`turn_context`):
- "appended": the tokens so far, as they happened: the prompt's tokens, the model's sampled tokens, the tokens of
  each rendered tool turn (`template.tool_suffix_ids`), the next sampled tokens, and so on; nothing is re-rendered.
  The row is one sequence.
- "rendered": the conversation so far (the prompt's messages, the model's turns as parsed, the tool results) as the
  chat template renders it, as a deployed model meets it where the template re-renders earlier turns (strips their
  reasoning). Where that rendering continues the tokens so far, the tool turn's tokens are appended as above;
  where it does not, the turn starts a new span of the row's completion after its own context (`Rollout.turns`),
  and the training pass scores each span after exactly that context (`grpo.learner.tree`). The completion then
  holds the sampled tokens (and the appended tool turns) only. A vision-language model's conversation is rendered
  by its processor with the row's images so far (the prompt's and the tools'), which every rendered history holds.
  Rows without messages (a rollout_func's) are appended.
Tool tokens have loss mask 0 and sampling log-prob 0.0 (a placeholder the mask hides): the model attends to them,
they are not trained. A row's token budget (`max_completion_length`) counts what its next turn continues, past the
prompt. Every process joins every round, with or without rows left, so the collectives a sharded model's generation
runs are matched on every process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from PIL import Image

from grpo.agent.budget import token_span
from grpo.agent.parsing import parse_turn
from grpo.agent.template import cannot_fit, tool_suffix_ids
from grpo.agent.tools import ToolSet, run_calls
from grpo.base.records import Prompt, Request, Rollout
from grpo.base.sigterm import Preempted
from grpo.data.prompts import render_images, tokenize_prompts
from grpo.rollout.base import Engine


@dataclass
class _Row:
    prompt_ids: list[int]
    tools: ToolSet
    image_prompt: Prompt | None = None  # the row's image prompt (a vision-language model's): every turn sees it
    ids: list[int] = field(default_factory=list)  # the completion so far: sampled and tool tokens
    # with images: what the next turn continues (`chain`) with one placeholder per image (`Prompt.placeholder_ids`)
    unexpanded: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1 on sampled tokens, 0 on tool tokens
    logps: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the completion as messages
    calls: int = 0
    failures: int = 0
    # what the completion's tokens from `start` on continue: the prompt, or with rendered turns the current turn's
    # rendered history; `done` holds the finished turns (start, end, context) once a turn was forked
    context: list[int] = field(init=False)
    start: int = 0
    done: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    prompt_messages: list[dict] | None = None  # the prompt's messages where turns are rendered, else None

    def __post_init__(self) -> None:
        self.context = list(self.prompt_ids)  # the first turn continues the prompt

    @property
    def chain(self) -> list[int]:
        """The tokens the next turn continues."""
        return self.context + self.ids[self.start :]

    @property
    def spent(self) -> int:
        """The budget spent: the tokens the next turn continues, past the prompt."""
        return len(self.context) - len(self.prompt_ids) + len(self.ids) - self.start

    def fork(self, context: list[int], unexpanded: list[int]) -> None:
        """The next turn continues `context` (a rendered history that does not continue the tokens so far), whose
        tokens with one placeholder per image are `unexpanded`."""
        self.done.append((self.start, len(self.ids), tuple(self.context)))
        self.context, self.start = context, len(self.ids)
        self.unexpanded = list(unexpanded)

    @property
    def turns(self) -> tuple[tuple[int, int, tuple[int, ...]], ...] | None:
        if not self.done:
            return None  # one sequence: the prompt, then the completion
        return (*self.done, (self.start, len(self.ids), tuple(self.context)))

    def add(self, ids: list[int], logps: list[float], sampled: bool, unexpanded: list[int] | None = None) -> None:
        self.ids += ids
        self.unexpanded += ids if unexpanded is None else unexpanded
        self.mask += [int(sampled)] * len(ids)
        self.logps += logps if sampled else [0.0] * len(ids)

    def next_prompt(self) -> Prompt:
        """What the next turn continues: the prompt and the completion so far, with the row's images (its prompt's
        and its tools')."""
        ids = tuple(self.chain)
        if self.image_prompt is None:
            return Prompt(ids)
        # not the dataset's prompt record (messages None): its text renders the first text_tokens ids only
        return dataclasses.replace(
            self.image_prompt,
            ids=ids,
            messages=None,
            text_tokens=len(self.prompt_ids),
            placeholder_ids=tuple(self.unexpanded),
        )

    def add_images(self, images: list) -> None:
        """Images a tool returned: the row's image prompt holds them after its own (in the order the tokens are)."""
        prompt = self.image_prompt or Prompt(tuple(self.prompt_ids))
        self.image_prompt = dataclasses.replace(prompt, images=(*(prompt.images or ()), *images), messages=None)

    @property
    def wants_tools(self) -> bool:
        return bool(self.messages and self.messages[-1].get("tool_calls"))


class ToolLoop:
    def __init__(
        self,
        tokenizer: Any,
        stop_ids: Sequence[int],
        max_completion_length: int,
        max_iterations: int | None,
        context: int | None,
        timeout: float | None,
        chat_template_kwargs: dict | None,
        any_process: Callable[[bool], bool],
        processor: Any = None,
        rendered: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.processor = processor  # a vision-language model's: tool results may hold images
        self.stop_ids = set(stop_ids)
        self.budget = max_completion_length
        self.max_iterations = max_iterations
        self.context = context or float("inf")
        self.timeout = timeout
        self.chat_template_kwargs = chat_template_kwargs
        self.any_process = any_process  # True everywhere when true on any process (a collective)
        self.span = token_span(tokenizer)  # how many characters a token can stand for (None: no bound)
        self.rendered = rendered  # turn_context: each next turn after the conversation as the template renders it

    def run(
        self, engine: Engine, first: Rollout, toolsets: Sequence[ToolSet], prompts: Sequence[Prompt] | None = None
    ) -> Rollout:
        """The rollout with every row's tool rounds done (next turns from `engine`): completions as whole
        exchanges. `prompts`: each row's prompt record (its messages, for rendered turns)."""
        rows = []
        for i, tools in enumerate(toolsets):
            image_prompt = first.vision[i]
            row = _Row(list(first.prompt_ids[i]), tools, image_prompt)
            record = prompts[i] if prompts is not None else None  # None: a rollout_func's rows
            if self.rendered and record is not None and record.messages is not None:
                row.prompt_messages = [dict(m) for m in record.messages]
            prompt = image_prompt or Prompt(tuple(first.prompt_ids[i]))
            row.unexpanded = prompt.unexpanded_ids(self.tokenizer)  # an image prompt's: its text's tokens
            row.add(list(first.completion_ids[i]), list(first.sampling_logps[i]), sampled=True)
            row.messages.append(self._parse(row, row.ids, row.prompt_ids))
            rows.append(row)
        active = [row for row in rows if row.wants_tools]
        iteration, stopped = 0, None
        while self._more(iteration) and self.any_process(bool(active)):
            try:
                active = self._turn(engine, active)
            except Preempted as stop:  # SIGTERM: the next check meets the other processes, which raise it there too
                if stop.agreed:
                    raise
                stopped, active = stop, []
            iteration += 1
        if stopped is not None:  # one process, or the last turn
            raise stopped
        return self._rollout(rows)

    def meet(self, stop: Preempted) -> NoReturn:
        """SIGTERM stopped this process's first generation: the others may be waiting in the loop's first check,
        where this process meets them (all raise `Preempted`, agreed, there)."""
        if self._more(0):
            self.any_process(False)
        raise stop

    def _more(self, iteration: int) -> bool:
        return self.max_iterations is None or iteration < self.max_iterations

    def _turn(self, engine: Engine, active: list[_Row]) -> list[_Row]:
        """One turn: the active rows' tool calls, then the model's next answers; the rows that call tools again.
        SIGTERM during the calls: the turn's generation still runs, with no rows (the other processes' may run
        collectives), then `Preempted` is raised."""
        stopped = None
        try:
            going = self._call_tools(active)
        except Preempted as stop:
            stopped, going = stop, []
        turn = engine.generate([Request(row.next_prompt(), 1, self.budget - row.spent) for row in going])
        if stopped is not None:
            raise stopped
        for j, row in enumerate(going):
            prefix = row.chain
            new = list(turn.completion_ids[j])[: self.budget - row.spent]
            row.add(new, list(turn.sampling_logps[j])[: len(new)], sampled=True)
            if new:  # a turn cut to nothing adds no message
                row.messages.append(self._parse(row, new, prefix))
        return [row for row in going if row.wants_tools]

    def _call_tools(self, active: list[_Row]) -> list[_Row]:
        """Run the active rows' calls and append the results; the rows with room left for a next turn."""
        results = run_calls([row.messages[-1]["tool_calls"] for row in active], [r.tools for r in active], self.timeout)
        going = []
        for row, outcome in zip(active, results):
            row.calls += len(outcome)
            row.failures += sum(r.failed for r in outcome)
            tool_messages = [{"role": "tool", "name": r.name, "content": r.content} for r in outcome]
            images = self._tool_images(tool_messages)
            chain = row.chain
            room = min(self.budget - row.spent, self.context - len(chain))
            # as below, but a 4 MB result is not tokenized first (a rendered history may drop earlier tokens: then
            # only a result that alone would pass the budget or the context is certain not to fit)
            sure = room if row.prompt_messages is None else min(self.budget, self.context - len(row.prompt_ids))
            if cannot_fit(self.tokenizer, tool_messages, self.stop_ids, sure, self.span, self.chat_template_kwargs):
                continue
            if row.prompt_messages is not None:  # rendered: the conversation with the results, as the template has it
                after, plain = self._render(row, row.messages + tool_messages, images)
                held = len(row.unexpanded)
                continues = after[: len(chain)] == chain and plain[:held] == row.unexpanded
                suffix, unexpanded = (after[len(chain) :], plain[held:]) if continues else (None, None)
            else:
                unexpanded = tool_suffix_ids(self.tokenizer, tool_messages, self.stop_ids, self.chat_template_kwargs)
                suffix = unexpanded
                if images:  # the processor turns each placeholder into the image's tokens
                    text = self.tokenizer.decode(unexpanded)
                    suffix = self.processor(text=[text], images=[images], add_special_tokens=False)["input_ids"][0]
                after = chain + suffix
            if len(after) - len(chain) >= room:
                continue  # no room for the model's answer: the results are not added, the row ends here
            row.messages += tool_messages
            if suffix is None:  # the rendered history does not continue the tokens so far: a turn of its own
                row.fork(after, plain)
            else:
                row.add(suffix, [], sampled=False, unexpanded=unexpanded)
            if images:
                row.add_images(images)
            going.append(row)
        return going

    def _render(self, row: _Row, messages: list[dict], images: list) -> tuple[list[int], list[int]]:
        """The row's prompt and `messages` as the chat template renders them, with the next assistant header: the
        tokens a deployed model's next turn continues; and those tokens with one placeholder per image. A
        vision-language model's processor renders them and expands the row's images so far and the new `images`
        (the tool results'), in order."""
        assert row.prompt_messages is not None  # rendered rows only
        conversation = row.prompt_messages + messages
        schemas = row.tools.schemas or None
        if self.processor is None:
            ids = tokenize_prompts([conversation], self.tokenizer, self.chat_template_kwargs, schemas)[0]
            return ids, ids
        earlier = row.image_prompt.images or () if row.image_prompt is not None else ()
        fix = (
            "(the prompt's and the tools'): a rendered history must hold every earlier image, in order, for its "
            "turns to be trained after what they saw. Use turn_context='appended', or a template that renders each "
            "message's images."
        )
        text, ids = render_images(
            self.processor, conversation, [*earlier, *images], schemas, self.chat_template_kwargs, fix
        )
        return ids, self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _tool_images(self, tool_messages: Sequence[dict]) -> list:
        """The images of the tool results' image blocks (a vision-language model sees them in its next turn)."""
        images = []
        for message in tool_messages:
            content = message["content"]
            for block in content if isinstance(content, list) else ():
                if isinstance(block, dict) and block.get("type") == "image":
                    if self.processor is None:
                        raise ValueError(
                            f"The tool '{message['name']}' returned an image, but the model is text-only: return "
                            "text, or train a vision-language model."
                        )
                    if not isinstance(block.get("image"), Image.Image):
                        raise ValueError(
                            f"The tool '{message['name']}' returned an image block whose 'image' is a "
                            f"{type(block.get('image')).__name__}; give a PIL image."
                        )
                    images.append(block["image"].convert("RGB"))
        return images

    def _parse(self, row: _Row, ids: list[int], prefix: list[int]) -> dict:
        return parse_turn(self.tokenizer, ids, prefix, row.tools.schemas)

    def _rollout(self, rows: list[_Row]) -> Rollout:
        return Rollout(
            prompt_ids=[row.prompt_ids for row in rows],
            completion_ids=[row.ids for row in rows],
            sampling_logps=[row.logps for row in rows],
            truncated=[not row.ids or row.ids[-1] not in self.stop_ids for row in rows],
            texts=[exchange_text(row.messages) for row in rows],
            messages=[row.messages for row in rows],
            loss_mask=[row.mask for row in rows],
            tool_calls=[row.calls for row in rows],
            tool_failures=[row.failures for row in rows],
            vision=[row.image_prompt for row in rows] if any(row.image_prompt for row in rows) else [],
            turns=[row.turns for row in rows],
        )


def exchange_text(messages: Sequence[dict]) -> str:
    """A readable rendering of a completion's messages (the completions table shows it)."""
    parts = []
    for message in messages:
        if message["role"] == "tool":
            parts.append(f"[{message.get('name', 'tool')} -> {message['content']}]")
            continue
        text = message.get("content") or ""
        calls = [
            f"<call {c['function']['name']}({c['function'].get('arguments')})>" for c in message.get("tool_calls") or []
        ]
        parts.append(" ".join(p for p in [text, *calls] if p))
    return "\n".join(parts)
