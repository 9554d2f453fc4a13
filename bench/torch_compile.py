"""Does `torch_compile=True` help a training step here? Steps of the tiny test model, or of a larger random
Llama, with and without it, in one process, one step of each in turn (same prompts, same seed).

    .venv/bin/python bench/torch_compile.py                         # tiny: hidden 32, 2 layers
    .venv/bin/python bench/torch_compile.py --hidden 512 --layers 13  # ~30M parameters

Prints, for each setting, the first step (compilation included) and the median of the later steps, for the whole
optimizer step and for its training pass (forward + backward). (The two runs share torch's sampling RNG in turn, so
their completions differ; `tests/integration/test_runtime_fields.py` checks that compiling leaves the loss as it is.)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "src"), os.path.join(HERE, "..", "tests")]


def build(model_dir: str, out: str, steps: int, compile_: bool, checkpointing: bool) -> tuple:
    from grpo import GRPOConfig, GRPOTrainer
    from support.rewards import length_reward
    from support.runs import chat_dataset

    args = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=32,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        bf16=False,
        seed=0,
        learning_rate=1e-5,
        gradient_checkpointing=checkpointing,
        torch_compile=compile_,
    )
    trainer = GRPOTrainer(
        model=model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(64, tasks=False), args=args
    )
    passes: list[float] = []
    original = trainer._loss_and_backward

    def timed(batch):
        start = time.perf_counter()
        loss = original(batch)
        passes.append(time.perf_counter() - start)
        return loss

    trainer._loss_and_backward = timed
    return trainer, passes


def interleaved(trainers: dict, steps: int) -> dict:
    """One step of each trainer in turn (so that a busy machine slows both alike)."""
    for step in range(1, steps + 1):
        for trainer, _ in trainers.values():
            trainer.parts = dataclasses.replace(trainer.parts, max_steps=step)  # one more step each train()
            trainer.state.max_steps = step
            trainer.train()
    out = {}
    for key, (trainer, passes) in trainers.items():
        rows = trainer.state.log_history
        out[key] = {
            "params_m": sum(p.numel() for p in trainer.model.parameters()) / 1e6,
            "step": [r["step_time"] for r in rows],
            "pass": passes,
            "loss": [r["loss"] for r in rows],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--no-checkpointing", action="store_true")
    a = parser.parse_args()
    from tiny import make_model, make_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = make_tokenizer()
        make_model(tokenizer, hidden=a.hidden, layers=a.layers).save_pretrained(tmp + "/model")
        tokenizer.save_pretrained(tmp + "/model")
        model, ckpt = tmp + "/model", not a.no_checkpointing
        trainers = {c: build(model, f"{tmp}/out{c}", a.steps, c, ckpt) for c in (False, True)}
        results = interleaved(trainers, a.steps)
    for compiled, r in results.items():
        print(
            f"torch_compile={compiled} params={r['params_m']:.1f}M first_step={r['step'][0]:.2f}s "
            f"median_step={statistics.median(r['step'][1:]):.3f}s first_pass={r['pass'][0]:.2f}s "
            f"median_pass={statistics.median(r['pass'][1:]):.3f}s"
        )


if __name__ == "__main__":
    main()
