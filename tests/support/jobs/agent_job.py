"""One GRPO step with tool calls, launched with torchrun (gloo on CPU) by test_agent_distributed.py:

    torchrun --nproc_per_node N agent_job.py OUT [fsdp|hang|rendered]

The global batch is 2 prompts x 4 samples; with 2 processes, process 0 holds prompt 0's rows, whose samples call
the tool 3 times, and process 1 prompt 1's, which call it once: process 1 has no rows left after the first
round. The scripted engine runs a collective (an all-reduce, as a sharded model's generation gathers weights) in
every generate call, so a process that skipped a round would hang the other. With `fsdp`, the policy is sharded
through accelerate's FSDP2 path as in distributed_job.py. The update, the metrics and the engine's call counts
go to OUT (main process). With `hang`, process 1's tool calls hang (after writing OUT/hung) for a SIGTERM test.
With `rendered`, a second trainer follows in the same processes (its results in OUT/rendered): every turn opens with
a reasoning block that the chat template strips from earlier turns, so each later turn is sampled after the rendered
history (turn_context="auto"), and the pass runs as token trees."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from support.agent import CALL, STRIPPING, multiply, tool_tokenizer
from support.scripted import TurnScript
from support.sharded import use_fsdp, whole
from support.tiny import make_model


class CollectiveScript(TurnScript):
    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, script)
        self.calls = 0
        self.kept_reasoning = 0  # follow-up turns asked after a context that holds an earlier turn's reasoning

    def generate(self, requests):
        self.calls += 1
        self.kept_reasoning += sum("<think>" in self.tok.decode(list(r.prompt.ids)) for r in requests)
        if dist.is_initialized():
            dist.all_reduce(torch.ones(1))
        return super().generate(requests)


def script(text, turn, j):
    """Prompt 0's samples call the tool in 3 rounds, prompt 1's in 1; sample j says j letters before its first call
    (follow-up turns are one sample each: j is 0 there)."""
    rounds = 3 if "go 0" in text else 1
    return ("x" * j if turn == 0 else "") + CALL if turn < rounds else "6"


def reward(completions, **kw):
    return [float(len(c[0]["content"]) + len(c)) for c in completions]


def multiply_or_hang(a: int, b: int) -> int:
    """Multiplies, except on process 1, where it hangs.

    Args:
        a: x
        b: y
    """
    if os.environ.get("RANK") == "1":
        open(os.path.join(sys.argv[1], "hung"), "w").close()
        time.sleep(600)
    return a * b


multiply_or_hang.__name__ = "multiply"  # the tool the script calls


def main() -> None:
    out = sys.argv[1]
    if len(sys.argv) > 2 and sys.argv[2] == "fsdp":
        use_fsdp()
    torch.set_num_threads(1)
    run(out)
    if sys.argv[2:] == ["rendered"]:
        run(os.path.join(out, "rendered"), rendered=True)


def run(out: str, rendered: bool = False) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tok = tool_tokenizer()
    turns = script
    if rendered:
        tok.chat_template = STRIPPING
        turns = lambda text, turn, j: "<think>r</think>" + script(text, turn, j)  # noqa: E731
    model = make_model(tok, context=4096)
    args = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=8 // world,
        num_generations=4,
        max_completion_length=600,
        max_steps=1,
        logging_steps=1,
        shuffle_dataset=False,
        save_strategy="no",
        disable_tqdm=True,
        bf16=False,
        gradient_checkpointing=False,
        packing="tree" if rendered else "padded",
    )
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"go {i}"}]} for i in range(8)])
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2)
    trainer = GRPOTrainer(
        model=model,
        processing_class=tok,
        reward_funcs=reward,
        train_dataset=data,
        args=args,
        optimizers=(sgd, None),
        tools=[multiply_or_hang if sys.argv[2:] == ["hang"] else multiply],
    )
    trainer.engine = CollectiveScript(tok, turns)
    before = whole(trainer.unwrapped_model)
    os.makedirs(out, exist_ok=True)
    trainer.train()
    after = whole(trainer.unwrapped_model)
    calls = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(calls, trainer.engine.calls)
    else:
        calls = [trainer.engine.calls]
    if trainer.accelerator.is_main_process:
        torch.save({n: p - before[n] for n, p in after.items()}, os.path.join(out, "update.pt"))
        with open(os.path.join(out, "row.json"), "w") as f:
            json.dump(
                {
                    **trainer.state.log_history[-1],
                    "world": world,
                    "engine_calls": calls,
                    "rendered": trainer.parts.rollouts.loop.rendered,
                    "tree": trainer.training_pass.tree,
                    "kept_reasoning": trainer.engine.kept_reasoning,
                },
                f,
            )


if __name__ == "__main__":
    main()
