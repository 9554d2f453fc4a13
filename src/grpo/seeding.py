"""The run's seeds, with the HF Trainer's meanings: `seed` seeds initialisation and generation (every generator:
python, numpy, torch); `data_seed` seeds the prompt order only (None: `seed`); `full_determinism` also switches
torch to deterministic algorithms (transformers' `enable_full_determinism`: slower, and some CUDA kernels then
refuse to run)."""

from __future__ import annotations

from typing import Any

from accelerate.utils import set_seed
from transformers import enable_full_determinism


def seed_run(args: Any) -> None:
    if args.full_determinism:
        enable_full_determinism(args.seed)
    else:
        set_seed(args.seed)


def prompt_order_seed(args: Any) -> int:
    """The seed of the prompt order (`grpo.data.generation_prompt_indices`)."""
    return args.seed if args.data_seed is None else args.data_seed
