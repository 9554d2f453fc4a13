"""Reward models: a sequence-classification model (a path, Hub id or `nn.Module`) in `reward_funcs` becomes a
reward function like any other (shared spec §5.6).

The text scored is the prompt followed by the completion: for conversational data, the reward tokenizer's
chat template applied to the prompt messages plus the completion message; for standard data, the plain
concatenation. It is tokenized right-padded without added special tokens, and not truncated (as TRL 1.16: a
truncated text would be scored without its end); the reward is logit 0. A model with a learned table of absolute
positions (GPT-2's `wpe`, BERT's and RoBERTa's `position_embeddings`) cannot embed a text longer than it: such a
text is refused before the forward, with the reward model, the completion and both lengths named (the forward
would fail deep inside torch, or on a GPU with a device-side assert). Models that compute their positions (RoPE,
ALiBi, relative attention) score any length, as in TRL.

Models given as ids are loaded when the trainer is built, so a model that cannot be loaded fails there, not at
step 1.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from grpo.models.modeling import ModelLoadError, from_pretrained_checked, load_pretrained, model_name


class RewardModel:
    """Calls a sequence-classification model as a reward function: one float per completion."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        chat_template_kwargs: dict[str, Any] | None = None,
        batch_size: int | None = None,
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        config: Any = model.config  # its transformers config (torch types a module attribute as Tensor | Module)
        config.pad_token_id = tokenizer.pad_token_id
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.batch_size = batch_size
        self.__name__ = model_name(model)
        self.max_length = position_limit(model)  # None: positions are computed, any length runs

    def texts(self, prompts: list, completions: list) -> list[str]:
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if isinstance(prompt, list):  # conversational
                out.append(
                    self.tokenizer.apply_chat_template(prompt + completion, tokenize=False, **self.chat_template_kwargs)
                )
            else:
                out.append(prompt + completion)
        return out

    @torch.inference_mode()
    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        texts = self.texts(prompts, completions)
        device = next(self.model.parameters()).device
        size = self.batch_size or len(texts)
        rewards: list[float] = []
        for start in range(0, len(texts), size):
            inputs = self.tokenizer(
                texts[start : start + size],
                return_tensors="pt",
                padding=True,
                padding_side="right",
                add_special_tokens=False,
            ).to(device)
            self._check_length(inputs["attention_mask"], start)
            rewards.extend(self.model(**inputs).logits[:, 0].float().tolist())
        return rewards

    def _check_length(self, attention_mask: torch.Tensor, first: int) -> None:
        lengths = attention_mask.sum(dim=1)
        if self.max_length is None or int(lengths.max()) <= self.max_length:
            return
        row = int((lengths > self.max_length).nonzero()[0])
        raise ValueError(
            f"The reward model {self.__name__}: completion {first + row} (with its prompt) is {int(lengths[row])} "
            f"tokens, but the model embeds at most {self.max_length} positions. Lower max_completion_length (and "
            "filter long prompts out of the dataset), or use a reward model with a longer context."
        )


def position_limit(model: torch.nn.Module) -> int | None:
    """How many positions the model's learned absolute position table holds (None: it has none). RoBERTa's
    positions start after the pad id (its table holds pad id + 1 more), OPT's after a fixed offset of 2."""
    limits = [
        module.num_embeddings
        - getattr(module, "offset", 0)
        - (module.padding_idx + 1 if module.padding_idx is not None else 0)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in POSITION_TABLES
    ]
    return min(limits) if limits else None


POSITION_TABLES = ("position_embeddings", "wpe", "embed_positions")  # BERT/RoBERTa/DeBERTa, GPT-2, OPT


def load_reward_model(
    entry: str | torch.nn.Module,
    tokenizer: Any,
    init_kwargs: dict[str, Any] | None,
    trust_remote_code: bool,
    chat_template_kwargs: dict[str, Any] | None,
    device: torch.device,
) -> RewardModel:
    """A `RewardModel` for a reward_funcs entry that is a model id/path or a module."""
    model: torch.nn.Module
    source: str | None
    if isinstance(entry, str):
        model = load_pretrained(
            AutoModelForSequenceClassification, "reward model", entry, init_kwargs, trust_remote_code, num_labels=1
        )
        source = entry
    else:
        model = entry
        source = getattr(model.config, "_name_or_path", None) if hasattr(model, "config") else None
        if not hasattr(model, "config"):
            raise ValueError(
                f"reward_funcs entry {type(entry).__name__} is a torch module without a transformers "
                "config: pass a sequence-classification model (AutoModelForSequenceClassification) "
                "or wrap the module in a Python reward function."
            )
    if tokenizer is None:
        if not source:
            raise ValueError(
                f"No tokenizer for the reward model {type(model).__name__}: pass it in "
                "reward_processing_classes (one entry per reward function)."
            )
        try:
            tokenizer = from_pretrained_checked(
                AutoTokenizer, "reward model's tokenizer", source, trust_remote_code=trust_remote_code
            )
        except ModelLoadError as err:
            raise ModelLoadError(f"{err} Or pass the tokenizer in reward_processing_classes.") from None
    return RewardModel(model.to(device), tokenizer, chat_template_kwargs)
