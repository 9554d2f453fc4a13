"""The benchmark workload, written once: both frameworks read this dict (issue: fast rollouts and lean memory).

1 warm-up step then 3 timed steps of the demo task on the bundled SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

WORKLOAD = dict(
    per_device_train_batch_size=16,
    gradient_accumulation_steps=1,
    num_generations=8,
    max_completion_length=64,
    temperature=1.0,
    learning_rate=1e-5,
    gradient_checkpointing=False,
    beta=0.0,
    loss_type="dapo",
    seed=0,
    max_steps=4,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
)


class TokenCounter:
    """A reward function wrapper counting the completion tokens actually generated (EOS counted, padding not):
    both frameworks hand reward functions the trimmed completion ids."""

    def __init__(self, reward):
        self.reward = reward
        self.tokens = 0
        self.__name__ = reward.__name__

    def __call__(self, completions, completion_ids, **kwargs):
        self.tokens += sum(len(ids) for ids in completion_ids)
        return self.reward(completions=completions, completion_ids=completion_ids, **kwargs)


def report(result: dict) -> None:
    """The one line a runner prints for the harness."""
    print("BENCH_RESULT " + json.dumps(result), flush=True)


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


TOPICS = [
    "a lighthouse keeper",
    "a lost robot",
    "the first winter on Mars",
    "a baker's apprentice",
    "a river",
    "an old clock",
    "two rival chess players",
    "a city under the sea",
]


def dataset(name: str, seed: int = 0):
    """The prompts of a run and their reward function: the demo task, ("story") prompts whose completions run to
    the length cap, or ("random") prompts for a random-weight model (bench/random_model.py), rewarded by a
    function whose value only has to vary."""
    from grpo.apps.demo import correctness_reward, train_dataset

    if name == "random":
        import random_model

        return _rows(random_model.prompts(64, seed)), random_model.varied_reward
    if name != "story":
        return train_dataset(seed), correctness_reward
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}."}],
            "a": 0,
            "b": 0,
        }
        for i in range(64)
    ]
    return _rows(rows), correctness_reward


def _rows(rows: list[dict]):
    """A datasets.Dataset (TRL needs one), or the list itself where datasets is missing (grpo takes lists)."""
    try:
        from datasets import Dataset
    except ImportError:
        return rows
    return Dataset.from_list(rows)


def decode_weights(model) -> int:
    """The numbers a decode step multiplies by: every parameter but an input embedding the output head does not
    share (its rows are looked up, not multiplied)."""
    total = sum(p.numel() for p in model.parameters())
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return total if embedding is head else total - embedding.numel()


def peak_memory() -> dict:
    """The process's peak memory: on CUDA the most its tensors held (torch's allocator), and its resident set."""
    import resource

    import torch

    peak = {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["peak_device_gb"] = torch.cuda.max_memory_allocated() / 1e9
        peak["device"] = torch.cuda.get_device_name()
    return peak
