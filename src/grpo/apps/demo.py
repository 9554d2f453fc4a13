"""`make demo`: GRPO teaches SmolLM2-135M-Instruct single-digit addition, on a CPU, in minutes.

    python -m grpo.apps.demo [--seed N] [--steps N] [--output runs/demo]

The task: "Compute {a}+{b}. Reply with only the final number." with a, b in 1..9; reward 1.0 when the last
integer of the completion is a+b. Before and after training, greedy accuracy is measured on all 81 pairs with
that phrasing and with one never trained on ("What is {a} plus {b}? Give just the number."). Everything goes
to the output directory: report.html (the run report), metrics.jsonl, sample completions, and the trained model.
The last line printed is `accuracy_before=<a> accuracy_after=<b>` (greedy, first phrasing).

Training: 2 prompts x 8 completions per step, max 32 new tokens, learning rate 2e-5 decaying linearly over
36 steps, beta 0, loss dapo, bfloat16 compute where the CPU has fast bfloat16. Accuracy is measured in float32
(the weights as saved), so it does not depend on the training precision, with grpo's fast engine decoding
greedily (the same completions as `model.generate`, tested); a progress line shows how far each evaluation is.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sys
import time
from typing import Any, TextIO

import torch
from datasets import Dataset
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from grpo.algo.sampling import SamplingSettings
from grpo.base.process_env import set_for_dependency
from grpo.base.records import Prompt, Request, left_pad
from grpo.config import GRPOConfig
from grpo.data.prompts import tokenize_prompts
from grpo.models.bundled import bundled_model_path
from grpo.models.modeling import generation_eos
from grpo.observe.report import REPORT
from grpo.rollout.fast import FastEngine, unsupported_reason
from grpo.trainer import GRPOTrainer

TRAIN_TEMPLATE = "Compute {a}+{b}. Reply with only the final number."
HELDOUT_TEMPLATE = "What is {a} plus {b}? Give just the number."
PAIRS = [(a, b) for a in range(1, 10) for b in range(1, 10)]


def last_integer(text: str) -> int | None:
    found = re.findall(r"-?\d+", text)
    return int(found[-1]) if found else None


def correctness_reward(completions: list, a: list[int], b: list[int], **kwargs: Any) -> list[float]:
    """1.0 when the last integer in the completion equals a+b, else 0.0."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if last_integer(t) == x + y else 0.0 for t, x, y in zip(texts, a, b)]


def chat(template: str, a: int, b: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": template.format(a=a, b=b)}]


def train_dataset(seed: int, size: int = 2048) -> Dataset:
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"prompt": chat(TRAIN_TEMPLATE, a, b), "a": a, "b": b})
    return Dataset.from_list(rows)


EVAL_CHUNK = 81  # prompts decoded together: a phrasing's 81 pairs (27 at a time took 1.3x longer)


def greedy_accuracy(
    model: Any, tokenizer: Any, template: str, max_new_tokens: int = 24, progress: Any = None
) -> tuple[float, list]:
    """Greedy accuracy on all 81 pairs, and the (prompt, completion, correct) triples. `progress(n)` is told
    each time n more prompts are done."""
    prompts = [chat(template, a, b) for a, b in PAIRS]
    texts = greedy_completions(model, tokenizer, tokenize_prompts(prompts, tokenizer), max_new_tokens, progress)
    results = [(p[0]["content"], t, last_integer(t) == a + b) for p, t, (a, b) in zip(prompts, texts, PAIRS)]
    return sum(r[2] for r in results) / len(results), results


@torch.no_grad()
def greedy_completions(
    model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int, progress: Any = None
) -> list[str]:
    """Greedy completions in float32 whatever the training precision (the accuracy of the weights as saved), with
    grpo's fast engine (the plain `model.generate` where it does not apply), EVAL_CHUNK prompts at a time."""
    eos = generation_eos(model)
    stop = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    # no processor changes the distribution, and the sampler takes its argmax: greedy decoding, stopping where
    # model.generate stops
    sampling = SamplingSettings(max_completion_length=max_new_tokens)
    engine = None
    if unsupported_reason(model, sampling) is None:
        engine = FastEngine(model, tokenizer, sampling, stop, sampler=lambda logprobs: logprobs.argmax(-1))
    device = next(model.parameters()).device
    texts: list[str] = []
    with torch.autocast(device.type, enabled=False):
        for start in range(0, len(prompts), EVAL_CHUNK):
            chunk = prompts[start : start + EVAL_CHUNK]
            if engine is not None:
                texts += engine.generate([Request(Prompt(ids=tuple(ids))) for ids in chunk]).texts
            else:
                texts += _generate(model, tokenizer, chunk, max_new_tokens, device)
            if progress is not None:
                progress(len(chunk))
    return texts


def _generate(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int, device: Any) -> list[str]:
    was_training = model.training
    model.eval()
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.train(was_training)
    return tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)


def evaluate(model: Any, tokenizer: Any, when: str) -> dict[str, tuple[float, list]]:
    """Greedy accuracy with both phrasings, with progress on stdout."""
    progress = EvalProgress(f"Greedy evaluation {when}", 2 * len(PAIRS))
    try:
        return {
            name: greedy_accuracy(model, tokenizer, t, progress=progress)
            for name, t in (("train", TRAIN_TEMPLATE), ("heldout", HELDOUT_TEMPLATE))
        }
    finally:
        progress.close()


class EvalProgress:
    """Progress of a greedy evaluation. On a terminal, a live bar like the training's (`<label> ━━━ 81/162 prompts
    0:00:07`, its clock ticking), cleared when done for the result line; where stdout is not a terminal (a log, a
    pipe), a plain line `<label>: 81/162 prompts, 7 s` at each phrasing's end."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.label, self.total, self.done = label, total, 0
        self.start = time.perf_counter()
        self.bar = None
        if self.stream.isatty():
            self.bar = Progress(
                TextColumn(label),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("prompts"),
                TimeElapsedColumn(),
                console=Console(file=self.stream),
                transient=True,
            )
            self.task = self.bar.add_task("eval", total=total)
            self.bar.start()

    def __call__(self, done: int) -> None:
        self.done += done
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done)
        elif self.done % len(PAIRS) == 0:
            seconds = time.perf_counter() - self.start
            self.stream.write(f"{self.label}: {self.done}/{self.total} prompts, {seconds:.0f} s\n")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def fresh_output_dir(path: str) -> None:
    """Start a fresh run: a previous run is moved to <path>.previous (replacing an older one), and said so; then
    where the run's report will be."""
    if os.path.exists(path):
        previous = path.rstrip("/") + ".previous"
        shutil.rmtree(previous, ignore_errors=True)
        shutil.move(path, previous)
        print(f"Moved the previous run in {path} to {previous}.")
    os.makedirs(path)
    print(f"Report: {report_path(path)} (open it in a browser; it is rewritten as training goes)")


def report_path(output_dir: str) -> str:
    return os.path.abspath(os.path.join(output_dir, REPORT))


def demo_config(output_dir: str, seed: int, steps: int, **overrides: Any) -> GRPOConfig:
    params: dict[str, Any] = dict(
        output_dir=output_dir,
        seed=seed,
        max_steps=steps,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=32,
        learning_rate=2e-5,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        gradient_checkpointing=False,
        temperature=1.0,
        log_completions=True,  # for the report's completions table
        num_completions_to_print=0,  # (not printed: the console keeps the progress line)
    )
    params.update(overrides)
    return GRPOConfig(**params)


def run(model_path: str, output_dir: str, seed: int, steps: int, **overrides: Any) -> tuple[float, float]:
    fresh_output_dir(output_dir)
    args = demo_config(output_dir, seed, steps, **overrides)
    trainer = GRPOTrainer(
        model=model_path, reward_funcs=correctness_reward, train_dataset=train_dataset(seed), args=args
    )
    model, tokenizer = trainer.unwrapped_model, trainer.parts.tokenizer
    before = evaluate(model, tokenizer, "before training")
    print(
        f"Before training: greedy accuracy {before['train'][0]:.3f} (trained phrasing), "
        f"{before['heldout'][0]:.3f} (unseen phrasing)"
    )
    start = time.perf_counter()
    trainer.train()
    train_time = time.perf_counter() - start
    after = evaluate(model, tokenizer, "after training")
    trainer.save_model(os.path.join(output_dir, "model"))
    _write_samples(output_dir, before, after)
    summary = {
        "seed": seed,
        "steps": steps,
        "train_seconds": round(train_time, 1),
        **{
            f"accuracy_{when}_{name}": round(acc[name][0], 4)
            for when, acc in (("before", before), ("after", after))
            for name in acc
        },
    }
    with open(os.path.join(output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(
        f"Training took {train_time:.0f} s for {steps} steps. Files in {output_dir}: report.html, metrics.jsonl, "
        "samples.md, summary.json, completions/, model/"
    )
    print(f"The run's report (charts, diagnostics, sampled completions): {report_path(output_dir)}")
    print(f"Greedy accuracy, trained phrasing: {before['train'][0]:.3f} -> {after['train'][0]:.3f}")
    print(f"Greedy accuracy, unseen phrasing:  {before['heldout'][0]:.3f} -> {after['heldout'][0]:.3f}")
    return before["train"][0], after["train"][0]


def _write_samples(output_dir: str, before: dict, after: dict, n: int = 12) -> None:
    with open(os.path.join(output_dir, "samples.md"), "w") as f:
        for name in ("train", "heldout"):
            f.write(f"## {name} phrasing: greedy completions before -> after\n\n")
            for (prompt, old, ok_old), (_, new, ok_new) in list(zip(before[name][1], after[name][1]))[:: 81 // n]:
                f.write(
                    f"- {prompt}\n  - before ({'ok' if ok_old else 'wrong'}): {old!r}\n"
                    f"  - after ({'ok' if ok_new else 'wrong'}): {new!r}\n"
                )
            f.write("\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=36)
    parser.add_argument("--output", default="runs/demo")
    parser.add_argument("--model", default=None, help="model directory (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a GRPOConfig field of the demo, e.g. --set learning_rate=3e-5",
    )
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        # accelerate imports DeepSpeed where it is installed (`make test` installs it), and DeepSpeed then prints
        # "Setting accelerator to CPU"; told so, it says nothing (the demo never uses it)
        set_for_dependency("DS_ACCELERATOR", "cpu", "DeepSpeed would announce its guess")
    if opts.model is None:
        opts.model = bundled_model_path()
    overrides = dict(item.split("=", 1) for item in opts.set)
    before, after = run(
        opts.model,
        opts.output,
        opts.seed,
        opts.steps,
        **{k: json.loads(v) if v[:1] in "0123456789-[{tfn" else v for k, v in overrides.items()},
    )
    print(f"accuracy_before={before:.4f} accuracy_after={after:.4f}")


if __name__ == "__main__":
    main()
