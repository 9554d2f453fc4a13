"""Effects of the tool-calling fields, on the tiny model with a tool-capable template and a scripted engine
whose turns always call the tool."""

from __future__ import annotations

import threading

from support.field_effects import Setting, effect
from support.runs import generate

CALL = '<tool_call>{"name": "%s", "arguments": {"x": 1}}</tool_call>'


def _tool_trainer(s: Setting, tool, **more):
    from datasets import Dataset

    from grpo import GRPOTrainer
    from grpo.agent import CHATML_TOOLS
    from support.scripted import TurnScript
    from support.tiny import make_model, make_tokenizer

    tok = make_tokenizer()
    tok.chat_template = CHATML_TOOLS
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"go {i}"}]} for i in range(8)])
    trainer = GRPOTrainer(
        model=make_model(tok, context=4096),
        processing_class=tok,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        train_dataset=data,
        args=s.config(max_completion_length=1000, **more),
        tools=[tool],
    )
    trainer.engine = TurnScript(tok, lambda text, turn, j: CALL % tool.__name__)
    return trainer


def echo(x: int) -> int:
    """Returns x.

    Args:
        x: a number
    """
    return x


@effect("max_tool_calling_iterations", 3)
def _(s: Setting) -> None:
    rollout = generate(_tool_trainer(s, echo), [0] * 4).rollout
    assert rollout.tool_calls == [3] * 4  # a model that always calls: exactly 3 rounds (None: until the budget)
    assert [m["role"] for m in rollout.messages[0]] == ["assistant", "tool"] * 3 + ["assistant"]


@effect("tool_call_timeout", 0.2)
def _(s: Setting) -> None:
    release = threading.Event()

    def hang(x: int) -> int:
        """Waits.

        Args:
            x: a number
        """
        release.wait()
        return x

    try:
        rollout = generate(_tool_trainer(s, hang, max_tool_calling_iterations=1), [0] * 4).rollout
    finally:
        release.set()
    assert rollout.tool_failures == [1] * 4
    assert "did not return within 0.2 s" in rollout.messages[0][1]["content"]
