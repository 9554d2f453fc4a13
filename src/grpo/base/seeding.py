"""The run's seeds, with the HF Trainer's meanings: `seed` seeds initialisation and generation (every generator:
python, numpy, torch); `data_seed` seeds the prompt order only (None: `seed`); `full_determinism` also switches
torch to deterministic algorithms (transformers' `enable_full_determinism`: slower, and some CUDA kernels then
refuse to run)."""

from __future__ import annotations

from accelerate.utils import set_seed
from transformers import enable_full_determinism


def seed_run(seed: int, full_determinism: bool) -> None:
    if full_determinism:
        enable_full_determinism(seed)
    else:
        set_seed(seed)


def distinct_per_process(seed: int, process_index: int) -> None:
    """After the model is built (the same initialisation everywhere): process i > 0 reseeds every generator with
    seed + i, as TRL's device-specific seed, so that a group whose completions are split over processes gets
    distinct samples instead of the same draws on every process. Process 0 keeps its stream (one process: no
    change)."""
    if process_index > 0:
        set_seed(seed + process_index)


def prompt_order_seed(seed: int, data_seed: int | None) -> int:
    """The seed of the prompt order (`grpo.data.prompts.generation_prompt_indices`)."""
    return seed if data_seed is None else data_seed
