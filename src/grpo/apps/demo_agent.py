"""`make demo-agent`: GRPO teaches SmolLM2-135M-Instruct to answer multiplications by calling a tool, on a CPU.

    python -m grpo.apps.demo_agent [--seed N] [--steps N] [--output runs/demo-agent]

The task: "What is {a} times {b}?" with a 3-digit a and a 2-digit b, which the model cannot compute itself. It
has one tool, `multiply(a, b)`, described by the chat template (`grpo.agent.CHATML_TOOLS`: ChatML with tools in
the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` format), and the prompt shows one worked example
(a question, the assistant's call, the tool's result, the answer). Reward 1.0 when the last integer of the final
assistant turn is a*b. Greedy accuracy and tool-call rate are measured before and after training on held-out pairs
(no pair, and no `a` or `b`, appears in training). Everything goes to the output directory: report.html (the run
report), metrics.jsonl, samples of whole exchanges before and after, summary.json and the trained `model/` (with
the tool-capable tokenizer). The last line printed is
`accuracy_before=<a> accuracy_after=<b> tool_calls_before=<c> tool_calls_after=<d>`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import torch
from datasets import Dataset

from grpo.agent import CHATML_TOOLS
from grpo.agent.loop import ToolLoop
from grpo.agent.tools import ToolSet
from grpo.algo.sampling import SamplingSettings
from grpo.apps.demo import demo_config as addition_config
from grpo.apps.demo import fresh_output_dir, last_integer, report_path
from grpo.base.records import Request
from grpo.config import GRPOConfig
from grpo.data.prompts import end_of_turn_ids, make_prompt
from grpo.models.bundled import bundled_model_path
from grpo.models.modeling import generation_eos
from grpo.rollout.fast import FastEngine
from grpo.trainer import GRPOTrainer

EXAMPLE = (312, 47)


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


def question(a: int, b: int) -> str:
    return f"What is {a} times {b}?"


def chat(a: int, b: int) -> list[dict]:
    x, y = EXAMPLE
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": x, "b": y}}}
    return [
        {"role": "user", "content": question(x, y)},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "multiply", "content": str(x * y)},
        {"role": "assistant", "content": f"The answer is {x * y}."},
        {"role": "user", "content": question(a, b)},
    ]


def split_pairs(seed: int, heldout: int = 128) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train, held-out) pairs: the held-out ones use `a` and `b` values that no training pair uses."""
    rng = random.Random(1234)  # the same held-out set for every seed
    a_values, b_values = list(range(100, 1000)), list(range(10, 100))
    rng.shuffle(a_values)
    rng.shuffle(b_values)
    held_a, train_a = a_values[:150], a_values[150:]
    held_b, train_b = b_values[:15], b_values[15:]
    held = rng.sample([(a, b) for a in held_a for b in held_b], heldout)
    rng = random.Random(seed)
    train = [(rng.choice(train_a), rng.choice(train_b)) for _ in range(4096)]
    return train, held


def correct_answer(completions: list, a: list[int], b: list[int], **kwargs: Any) -> list[float]:
    """1.0 when the last integer of the final assistant turn is a*b."""
    out = []
    for messages, x, y in zip(completions, a, b):
        final = next((m for m in reversed(messages) if m["role"] == "assistant"), {"content": ""})
        out.append(1.0 if last_integer(final.get("content") or "") == x * y else 0.0)
    return out


def dataset(pairs: list[tuple[int, int]]) -> Dataset:
    return Dataset.from_list([{"prompt": chat(a, b), "a": a, "b": b} for a, b in pairs])


def tool_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHATML_TOOLS
    return tokenizer


@dataclass
class Measured:
    accuracy: float
    tool_calls: float  # fraction of exchanges with at least one tool call
    exchanges: list[tuple[str, list[dict], bool]]


@torch.no_grad()
def measure(model: Any, tokenizer: Any, pairs: list[tuple[int, int]], max_completion_length: int) -> Measured:
    """Greedy multi-turn exchanges (top_k=1, float32) with the real tool, through grpo's own tool loop."""
    sampling = SamplingSettings(top_k=1, max_completion_length=max_completion_length)
    stop_ids = end_of_turn_ids(tokenizer, generation_eos(model))
    engine = FastEngine(model, tokenizer, sampling, stop_ids)
    tools = ToolSet.of([multiply])
    loop = ToolLoop(tokenizer, stop_ids, max_completion_length, 3, None, 10.0, None, lambda flag: flag)
    with torch.autocast("cpu", enabled=False):
        requests = [Request(make_prompt(chat(a, b), tokenizer, tools=tools.schemas)) for a, b in pairs]
        first = engine.generate(requests)
        rollout = loop.run(engine, first, [tools] * len(pairs))
    rewards = correct_answer(rollout.messages, [a for a, _ in pairs], [b for _, b in pairs])
    called = [c > 0 for c in rollout.tool_calls]
    exchanges = []
    for (a, b), messages, reward in zip(pairs, rollout.messages, rewards):
        assert messages is not None  # a chat prompt's completion is messages
        exchanges.append((question(a, b), messages, reward == 1.0))
    return Measured(sum(rewards) / len(pairs), sum(called) / len(pairs), exchanges)


def demo_config(output_dir: str, seed: int, steps: int, **overrides: Any) -> GRPOConfig:
    """`make demo`'s settings, with room for a call, the tool's result and the answer."""
    params = dict(max_completion_length=64, max_tool_calling_iterations=2, num_completions_to_print=2)
    return addition_config(output_dir, seed, steps, **{**params, **overrides})


def run(model_path: str, output_dir: str, seed: int, steps: int, **overrides: Any) -> dict:
    fresh_output_dir(output_dir)
    train_pairs, held = split_pairs(seed)
    args = demo_config(output_dir, seed, steps, **overrides)
    tokenizer = tool_tokenizer(model_path)
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=correct_answer,
        train_dataset=dataset(train_pairs),
        args=args,
        processing_class=tokenizer,
        tools=[multiply],
    )
    model = trainer.unwrapped_model
    max_completion_length = args.max_completion_length
    assert max_completion_length is not None  # demo_config sets it
    before = measure(model, tokenizer, held, max_completion_length)
    print(f"Before training: greedy accuracy {before.accuracy:.3f}, tool calls {before.tool_calls:.3f} (held-out)")
    start = time.perf_counter()
    trainer.train()
    train_time = time.perf_counter() - start
    after = measure(model, tokenizer, held, max_completion_length)
    trainer.save_model(os.path.join(output_dir, "model"))
    _write_samples(output_dir, before, after)
    rewards = [json.loads(line)["reward"] for line in open(os.path.join(output_dir, "metrics.jsonl"))]
    summary = {
        "seed": seed,
        "sampled_reward_first_step": rewards[0],  # at temperature 1, as trained
        "sampled_reward_last_5_steps": sum(rewards[-5:]) / len(rewards[-5:]),
        "steps": steps,
        "heldout_pairs": len(held),
        "train_seconds": round(train_time, 1),
        "accuracy_before": before.accuracy,
        "accuracy_after": after.accuracy,
        "tool_calls_before": before.tool_calls,
        "tool_calls_after": after.tool_calls,
    }
    with open(os.path.join(output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"Training took {train_time:.0f} s for {steps} steps. Files in {output_dir}.")
    print(f"The run's report (charts, diagnostics, sampled exchanges): {report_path(output_dir)}")
    return summary


def _write_samples(output_dir: str, before: Measured, after: Measured, n: int = 8) -> None:
    def show(messages: list[dict]) -> str:
        lines = []
        for m in messages:
            calls = "".join(
                f" <call {c['function']['name']}({c['function']['arguments']})>" for c in m.get("tool_calls") or []
            )
            lines.append(f"    - {m['role']}: {(m.get('content') or '')!r}{calls}")
        return "\n".join(lines)

    pairs = list(zip(before.exchanges, after.exchanges))
    pairs.sort(key=lambda pair: (pair[0][2], not pair[1][2]))  # the ones training fixed first, then the rest
    with open(os.path.join(output_dir, "samples.md"), "w") as f:
        f.write("# Greedy exchanges on held-out pairs, before -> after training\n\n")
        for (q, old, ok_old), (_, new, ok_new) in pairs[:n]:
            f.write(f"## {q}\n- before ({'ok' if ok_old else 'wrong'}):\n{show(old)}\n")
            f.write(f"- after ({'ok' if ok_new else 'wrong'}):\n{show(new)}\n\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output", default="runs/demo-agent")
    parser.add_argument("--model", default=None, help="model directory (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a config field")
    opts = parser.parse_args(argv)
    overrides = dict(item.split("=", 1) for item in opts.set)
    summary = run(
        opts.model or bundled_model_path(),
        opts.output,
        opts.seed,
        opts.steps,
        **{k: json.loads(v) if v[:1] in "0123456789-[{tfn" else v for k, v in overrides.items()},
    )
    print(
        f"accuracy_before={summary['accuracy_before']:.4f} accuracy_after={summary['accuracy_after']:.4f} "
        f"tool_calls_before={summary['tool_calls_before']:.4f} tool_calls_after={summary['tool_calls_after']:.4f}"
    )


if __name__ == "__main__":
    main()
