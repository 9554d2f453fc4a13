"""Agent training: the model learns to answer multiplications by calling a `multiply` tool (docs/agents.md).

    python examples/train_tools.py
    accelerate launch --config_file examples/accelerate/ddp.yaml examples/train_tools.py

The model's chat template must render tools (Qwen2.5's does; for one that does not, set
`tokenizer.chat_template = grpo.agent.CHATML_TOOLS` and pass `processing_class=tokenizer`). `make demo-agent` is the
same task on the bundled SmolLM2-135M-Instruct, on a CPU.
"""

import os
import random
import re

from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def right_product(completions, product, **kwargs):
    """1.0 when the last integer of the final turn is the product (completions: the whole exchange, as messages)."""
    answers = [re.findall(r"-?\d+", c[-1]["content"] or "") for c in completions]
    return [1.0 if found and int(found[-1]) == p else 0.0 for found, p in zip(answers, product)]


rng = random.Random(0)
pairs = [(rng.randint(100, 999), rng.randint(10, 99)) for _ in range(1024)]
dataset = Dataset.from_list(
    [{"prompt": [{"role": "user", "content": f"What is {a} times {b}?"}], "product": a * b} for a, b in pairs]
)
args = GRPOConfig(
    output_dir=os.environ.get("OUTPUT_DIR", "runs/multiply"),
    max_completion_length=512,
    max_tool_calling_iterations=3,
    learning_rate=1e-6,
    logging_steps=1,
    log_completions=True,
)
trainer = GRPOTrainer(
    model=os.environ.get("MODEL", "Qwen/Qwen2.5-0.5B-Instruct"),
    reward_funcs=right_product,
    train_dataset=dataset,
    tools=[multiply],
    args=args,
)
trainer.train()
trainer.save_model()
