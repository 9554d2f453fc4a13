"""Agent training on scripted engines: the `multiply` tool and its call, a tokenizer with grpo's tool template, the
agent run's config and dataset, a trainer whose engine follows a script, an environment (`Counter`), and a template
that strips earlier reasoning (`STRIPPING`)."""

from __future__ import annotations

from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.agent import CHATML_TOOLS
from support.runs import BASE
from support.scripted import TurnScript
from support.tiny import make_model, make_tokenizer

CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>'
GROUPS = [0] * 4 + [1] * 4  # two prompts, four samples each


def multiply(a: int, b: int) -> int:
    """Multiplies.

    Args:
        a: x
        b: y
    """
    return a * b


def tool_tokenizer():
    tok = make_tokenizer()
    tok.chat_template = CHATML_TOOLS
    return tok


def cfg(tmp_path, **kw):
    return GRPOConfig(**{**BASE, "output_dir": str(tmp_path / "out"), "max_completion_length": 200, **kw})


def dataset(n=8):
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"2*3 {i}"}], "k": i} for i in range(n)])


def final_is_6(completions, **kw):
    return [1.0 if c[-1]["content"] == "6" and len(c) > 1 else 0.0 for c in completions]


def make_trainer(tmp_path, script, tools=(multiply,), reward=final_is_6, data="default", **kw):
    tok = tool_tokenizer()
    trainer = GRPOTrainer(
        model=make_model(tok, context=4096),
        processing_class=tok,
        reward_funcs=reward,
        train_dataset=dataset() if isinstance(data, str) else data,
        args=cfg(tmp_path, **kw.pop("args", {})),
        tools=list(tools) if tools else None,
        **kw,
    )
    trainer.engine = TurnScript(tok, script)
    return trainer


class Counter:
    """Starts at the row's k; `add` adds to it; the reward is the count."""

    made = 0

    def __init__(self):
        Counter.made += 1
        self.count = 0

    def reset(self, k, **row):
        self.count = k
        return f" (start at {k})"

    def add(self, n: int) -> int:
        """Adds to the counter.

        Args:
            n: how much
        """
        self.count += n
        return self.count

    def get_reward(self):
        return float(self.count)


# every assistant turn rendered without its reasoning block, as DeepSeek-R1's and QwQ's templates do
STRIPPING = CHATML_TOOLS.replace(
    "<|im_start|>assistant\n{{ message['content'] or '' }}",
    "<|im_start|>assistant\n{{ (message['content'] or '').split('</think>')[-1] | trim }}",
)
