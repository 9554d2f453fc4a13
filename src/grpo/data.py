"""Prompts in, `Prompt` records out (shared spec §5.3): the one place prompts are rendered and tokenized.

Also the prompt order: which dataset rows feed generation number k. It is a pure function of (seed, k), so a
resumed run sees exactly the prompts the uninterrupted one would have seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from grpo.rollout.base import Prompt, Request

UNSUPPORTED_COLUMNS = ("image", "images")


def is_conversational(prompt: Any) -> bool:
    """A prompt is conversational when it is a list of messages (dicts with a "role")."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], dict) and "role" in prompt[0]


def check_dataset(dataset: Any) -> None:
    """Fail early, with the fix, on datasets the trainer cannot use."""
    if dataset is None:
        raise ValueError("train_dataset is None: pass a datasets.Dataset (or list of dicts) with a 'prompt' column.")
    columns = list(getattr(dataset, "column_names", None) or (dataset[0].keys() if len(dataset) else []))
    if len(dataset) == 0:
        raise ValueError("train_dataset is empty: it needs at least one row with a 'prompt'.")
    if "prompt" not in columns:
        raise ValueError(
            f"train_dataset has no 'prompt' column (columns: {columns}). Rename the column that holds "
            "the prompts to 'prompt', e.g. dataset.rename_column('question', 'prompt')."
        )
    for name in UNSUPPORTED_COLUMNS:
        if name in columns:
            raise ValueError(
                f"train_dataset has an '{name}' column: image prompts for vision-language models are "
                f"not available yet in grpo. Remove the column (dataset.remove_columns('{name}')) to "
                "train on text only."
            )


def render_prompts(prompts: Sequence[Any], tokenizer: Any, chat_template_kwargs: dict | None = None) -> list[str]:
    """Conversational prompts through the chat template (with the generation prompt); strings as they are."""
    texts = []
    for prompt in prompts:
        if is_conversational(prompt):
            texts.append(
                tokenizer.apply_chat_template(
                    list(prompt), tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
                )
            )
        elif isinstance(prompt, str):
            texts.append(prompt)
        else:
            raise ValueError(
                f"A prompt must be a string or a list of {{'role', 'content'}} messages; got "
                f"{type(prompt).__name__}: {str(prompt)[:80]!r}."
            )
    return texts


def tokenize_prompts(
    prompts: Sequence[Any], tokenizer: Any, chat_template_kwargs: dict | None = None
) -> list[list[int]]:
    """Token ids per prompt. The chat template already writes its special tokens, so rendered conversations
    are tokenized without adding any; standard prompts get the tokenizer's defaults (e.g. BOS)."""
    texts = render_prompts(prompts, tokenizer, chat_template_kwargs)
    ids = []
    for prompt, text in zip(prompts, texts):
        ids.append(tokenizer(text, add_special_tokens=not is_conversational(prompt))["input_ids"])
    return ids


def make_prompt(prompt: Any, tokenizer: Any, chat_template_kwargs: dict | None = None) -> Prompt:
    """A dataset prompt (string or messages) as a tokenized `Prompt` record."""
    ids = tokenize_prompts([prompt], tokenizer, chat_template_kwargs)[0]
    messages = tuple(dict(m) for m in prompt) if is_conversational(prompt) else None
    return Prompt(ids=tuple(ids), messages=messages)


class PromptSource:
    """The dataset's prompts as `Prompt` records, each tokenized once (on first use) and kept."""

    def __init__(self, dataset: Any, tokenizer: Any, chat_template_kwargs: dict | None = None) -> None:
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.chat_template_kwargs = chat_template_kwargs
        self._cache: dict[int, Prompt] = {}

    def __getitem__(self, row: int) -> Prompt:
        if row not in self._cache:
            self._cache[row] = make_prompt(self.dataset[row]["prompt"], self.tokenizer, self.chat_template_kwargs)
        return self._cache[row]

    def requests(self, rows: Sequence[int]) -> list[Request]:
        """One request per run of equal consecutive rows (a process's share of a prompt's group), in order."""
        requests: list[Request] = []
        for i, row in enumerate(rows):
            if i > 0 and rows[i - 1] == row:
                requests[-1] = Request(requests[-1].prompt, requests[-1].num_samples + 1)
            else:
                requests.append(Request(self[row]))
        return requests


def end_of_turn_ids(tokenizer: Any, model_eos: int | list[int] | None = None) -> list[int]:
    """Every token that ends a completion: EOS, the chat template's end-of-turn token (e.g. <|im_end|>,
    <|eot_id|>) and the model's generation_config EOS ids. The reference stops at EOS only (its quirk 10),
    which lets chat models whose end-of-turn is not EOS run on to max_completion_length."""
    ids = []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if model_eos is not None:
        ids.extend([model_eos] if isinstance(model_eos, int) else list(model_eos))
    turn_end = _template_turn_end(tokenizer)
    if turn_end is not None:
        ids.append(turn_end)
    return list(dict.fromkeys(ids))


def _template_turn_end(tokenizer: Any) -> int | None:
    if not getattr(tokenizer, "chat_template", None):
        return None
    sentinel = "GRPOSENTINEL"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": sentinel}], tokenize=False
        )
    except Exception:  # templates that refuse this shape simply have no detectable end-of-turn
        return None
    if sentinel not in text:
        return None
    suffix = tokenizer(text.split(sentinel, 1)[1], add_special_tokens=False)["input_ids"]
    special = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    return suffix[0] if suffix and suffix[0] in special else None


def prompts_per_generation(num_rows: int, unique_per_generation: int) -> int:
    """Whole blocks of unique prompts per epoch; an incomplete last block is dropped (as the reference)."""
    blocks = num_rows // unique_per_generation
    if blocks == 0:
        raise ValueError(
            f"train_dataset has {num_rows} prompts but one generation needs {unique_per_generation} "
            "distinct prompts (generation_batch_size / num_generations). Add prompts or lower "
            "per_device_train_batch_size / steps_per_generation."
        )
    return blocks


def generation_prompt_indices(
    generation: int, num_rows: int, unique_per_generation: int, seed: int, shuffle: bool
) -> list[int]:
    """Dataset row indices of generation number `generation` (0-based), unique prompts only.

    Epoch e uses the permutation drawn from a generator seeded with (seed, e), so the order is a pure function
    of the generation index and resuming needs no sampler state."""
    blocks = prompts_per_generation(num_rows, unique_per_generation)
    epoch, block = divmod(generation, blocks)
    if shuffle:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(num_rows, generator=gen).tolist()
    else:
        order = list(range(num_rows))
    return order[block * unique_per_generation : (block + 1) * unique_per_generation]
