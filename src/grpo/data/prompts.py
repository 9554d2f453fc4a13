"""Prompts in, `Prompt` records out (shared spec §5.3): the one place prompts are rendered and tokenized.

Also the prompt order: which dataset rows feed generation number k. It is a pure function of (seed, k), so a
resumed run sees exactly the prompts the uninterrupted one would have seen.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from grpo.base import seeding
from grpo.base.records import Prompt, Request, group_requests
from grpo.config import ResolvedConfig
from grpo.data.datasets import is_stream
from grpo.distributed import collectives
from grpo.models import vision

logger = logging.getLogger("grpo")
IMAGE_PROMPTS_KEPT = 512  # image prompts PromptSource keeps decoded (text prompts: all)


def is_conversational(prompt: Any) -> bool:
    """A prompt is conversational when it is a list of messages (dicts with a "role")."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], dict) and "role" in prompt[0]


# keywords the trainer itself passes to reward functions: a dataset column of that name would be shadowed
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
# columns not passed to reward functions, as in TRL (a dataset's own completions are not the sampled ones)
DROPPED_COLUMNS = ("completion",)


def check_dataset(dataset: Any, tools: bool = False, environments: bool = False, name: str = "train_dataset") -> None:
    """Fail early, with the fix, on datasets the trainer cannot use: the columns, and every row's prompt (its
    shape only, no tokenization: cheap for any size). With tools, prompts must be conversational; with
    environments, a row may have no prompt (its environment's reset supplies one). Errors call the dataset
    `name` (an evaluation's: "eval_dataset", "eval_dataset['<key>']")."""
    if dataset is None:
        raise ValueError(f"{name} is None: pass a datasets.Dataset (or list of dicts) with a 'prompt' column.")
    if is_stream(dataset):  # no length and no random access: its first row is checked; each prompt when used
        first = next(iter(dataset), None)
        if first is None:
            raise ValueError(f"{name} is an empty stream: it yields no rows.")
        if "prompt" not in first and not environments:
            raise ValueError(f"{name}'s rows have no 'prompt' (its first row has {sorted(first)}).")
        _check_columns(list(first), environments, name)
        return
    if len(dataset) == 0:
        raise ValueError(f"{name} is empty: it needs at least one row with a 'prompt'.")
    columns = list(getattr(dataset, "column_names", None) or dataset[0].keys())
    if "prompt" not in columns and not environments:
        raise ValueError(
            f"{name} has no 'prompt' column (columns: {columns}). Rename the column that holds "
            "the prompts to 'prompt', e.g. dataset.rename_column('question', 'prompt')."
        )
    _check_columns(columns, environments, name)
    if "prompt" not in columns:
        return
    prompts = dataset["prompt"] if hasattr(dataset, "column_names") else None
    for i in range(len(dataset)):
        if prompts is None and "prompt" not in dataset[i]:
            if environments:
                continue
            raise ValueError(f"{name} row {i} has no 'prompt': every row needs one.")
        prompt = prompts[i] if prompts is not None else dataset[i]["prompt"]
        if prompt is None and environments:
            continue
        problem = _prompt_problem(prompt)
        if problem is None and tools and not is_conversational(prompt):
            problem = (
                "tools= need conversational prompts (a list of {'role': ..., 'content': ...} messages), so that "
                "tool results can follow as messages; this one is a string."
            )
        if problem:
            raise ValueError(f"{name} row {i}: {problem}")


def _check_columns(columns: list[str], environments: bool, dataset: str = "train_dataset") -> None:
    for name in RESERVED_COLUMNS + (("environments",) if environments else ()):
        if name in columns:
            raise ValueError(
                f"{dataset} has a '{name}' column, but reward functions receive the trainer's own '{name}' "
                f"under that keyword. Rename the column (dataset.rename_column('{name}', 'my_{name}'))."
            )
    for name in DROPPED_COLUMNS:
        if name in columns:
            warnings.warn(
                f"{dataset}'s '{name}' column is not passed to reward functions (they get the sampled "
                f"completions as 'completions', as in TRL); rename it to pass it.",
                stacklevel=4,
            )


def _prompt_problem(prompt: Any) -> str | None:
    """What is wrong with one prompt (None: nothing)."""
    if isinstance(prompt, str):
        if not prompt.strip():
            return "the prompt is empty; give every row a non-empty prompt (or drop it)."
        return text_problem(prompt)
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return (
            f"the prompt is {type(prompt).__name__} {prompt!r:.80}; a prompt is a non-empty string or a "
            "list of {'role': ..., 'content': ...} messages."
        )
    for j, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"message {j} of the prompt has no 'role'; each message is {{'role': ..., 'content': ...}}."
        content = message.get("content")
        if content is None and message.get("tool_calls"):  # an assistant turn that only calls tools
            continue
        if not isinstance(content, (str, list)):
            return (
                f"message {j} of the prompt ({message['role']}) has no text 'content' (it is "
                f"{type(content).__name__}); give it a string."
            )
    return text_problem(prompt)


# half of a UTF-16 pair, alone: a valid Python str (and valid JSON: "\ud800") that no UTF-8 tokenizer encodes
_SURROGATE = re.compile("[\ud800-\udfff]")
# keys whose values are not text the chat template renders (a content block's image: a path, URL or bytes)
_NOT_TEXT = frozenset(("image", "images", "image_url", "video", "videos", "audio"))


def _texts(value: Any, path: str) -> Any:
    """(path, text) of every string in a prompt (a string, or messages with their content blocks), in order."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, (list, tuple)):
        for j, item in enumerate(value):
            yield from _texts(item, f"{path}[{j}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            if key not in _NOT_TEXT:
                yield from _texts(item, f"{path}[{key!r}]")


def text_problem(prompt: Any) -> str | None:
    """Where a prompt's text holds a lone UTF-16 surrogate, which the tokenizer cannot encode (None: nowhere)."""
    for path, text in _texts(prompt, "prompt"):
        if text.isascii():
            continue
        found = _SURROGATE.search(text)
        if found is not None:
            where = "the prompt" if path == "prompt" else path
            return (
                f"{where} holds a lone UTF-16 surrogate {found.group()!r} at character {found.start()}: half of a "
                "UTF-16 pair (e.g. JSON's \\ud800 escape without its partner), which is not Unicode text and which "
                "no tokenizer encodes. Repair the text, or drop the row; text.encode('utf-8', 'replace')"
                ".decode('utf-8') replaces each such character with '?'."
            )
    return None


def render_prompts(
    prompts: Sequence[Any], tokenizer: Any, chat_template_kwargs: dict | None = None, tools: list[dict] | None = None
) -> list[str]:
    """Conversational prompts through the chat template (with the generation prompt, and the tools' schemas when
    there are tools); strings as they are."""
    texts = []
    for prompt in prompts:
        if is_conversational(prompt):
            texts.append(
                tokenizer.apply_chat_template(
                    list(prompt),
                    tools=tools or None,
                    tokenize=False,
                    add_generation_prompt=True,
                    **(chat_template_kwargs or {}),
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
    prompts: Sequence[Any], tokenizer: Any, chat_template_kwargs: dict | None = None, tools: list[dict] | None = None
) -> list[list[int]]:
    """Token ids per prompt. The chat template already writes its special tokens, so rendered conversations
    are tokenized without adding any; standard prompts get the tokenizer's defaults (e.g. BOS)."""
    texts = render_prompts(prompts, tokenizer, chat_template_kwargs, tools)
    ids = []
    for prompt, text in zip(prompts, texts):
        ids.append(tokenizer(text, add_special_tokens=not is_conversational(prompt))["input_ids"])
    return ids


def make_prompt(
    prompt: Any,
    tokenizer: Any,
    chat_template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
    processor: Any = None,
    images: Sequence[Any] | None = None,
    row: int = 0,
    dataset: str = "train_dataset",
) -> Prompt:
    """A dataset prompt (string or messages) as a tokenized `Prompt` record. With a vision-language model's
    `processor`, a conversational prompt becomes content blocks with the row's `images` placed in them
    (`grpo.models.vision.multimodal_messages`) and is rendered and tokenized by the processor, which expands each image
    into its image tokens. Text the tokenizer cannot encode (a lone surrogate) is an error naming the row and field."""
    problem = text_problem(prompt)
    if problem is not None:
        raise ValueError(f"{dataset} row {row}: {problem}")
    if processor is None or not is_conversational(prompt):
        ids = tokenize_prompts([prompt], tokenizer, chat_template_kwargs, tools)[0]
        messages = tuple(dict(m) for m in prompt) if is_conversational(prompt) else None
        return Prompt(ids=tuple(ids), messages=messages)
    images = list(images or [])
    blocks = vision.multimodal_messages(prompt, images, row, dataset)
    fix = f"({dataset} row {row}). Use a chat template that renders each message's image blocks."
    text, ids = render_images(processor, blocks, images, tools, chat_template_kwargs, fix)
    return Prompt(ids=tuple(ids), messages=tuple(blocks), images=tuple(images) or None, text=text)


def render_images(
    processor: Any,
    conversation: Sequence[dict],
    images: Sequence[Any],
    tools: list[dict] | None = None,
    chat_template_kwargs: dict | None = None,
    fix: str = "",
) -> tuple[str, list[int]]:
    """A conversation as a vision-language model's processor renders it, with the next assistant header: its text
    and its tokens, each of `images` (in order) expanded into its image tokens. A template that renders another
    number of image placeholders than `images` is an error (`fix`: where, and what to do), before the processor's
    own."""
    text = processor.apply_chat_template(
        list(conversation),
        tools=tools or None,
        tokenize=False,
        add_generation_prompt=True,
        **(chat_template_kwargs or {}),
    )
    placeholder = getattr(processor, "image_token", None)
    if images and placeholder is not None and text.count(placeholder) != len(images):
        raise ValueError(
            f"The chat template rendered {text.count(placeholder)} image(s) of a conversation holding "
            f"{len(images)} {fix}"
        )
    out = processor(text=[text], images=[list(images)] if images else None, add_special_tokens=False)
    return text, list(out["input_ids"][0])


def check_images(dataset: Any, processing_class: Any, dataset_name: str = "train_dataset") -> None:
    """An image column needs a vision-language model's processor. With one, before training: each row with images
    has a conversational prompt with room for them (`vision.multimodal_messages`), and each image (a path, bytes
    or a PIL image) is a readable image within the pixel budget that decodes (`vision.check_image_file`: the header
    first, then the pixels, one image at a time, none kept). A stream's rows are checked as they are read."""
    streaming = is_stream(dataset)
    columns = getattr(dataset, "column_names", None)  # a datasets.Dataset's: row 0 is not decoded to find them
    if not columns:
        first = next(iter(dataset), None) if streaming else dataset[0]
        columns = list(first or {})
    name = vision.image_column(list(columns))
    if name is None:
        return
    if not vision.is_processor(processing_class):
        raise ValueError(
            f"{dataset_name} has an '{name}' column, but the model is text-only: its processing class is a "
            f"{type(processing_class).__name__}, not a multimodal processor. Train a vision-language model (its "
            "processor is loaded with it, or pass processing_class=AutoProcessor.from_pretrained(...)), or remove "
            f"the column (dataset.remove_columns('{name}')) to train on text only."
        )
    if streaming:
        return
    if hasattr(dataset, "with_format"):  # arrow values: images stay undecoded (paths and bytes)
        table = dataset.with_format("arrow")
        values, prompts = table[name].to_pylist(), dataset["prompt"]
    else:
        values, prompts = [r.get(name) for r in dataset], [r.get("prompt") for r in dataset]
    for row, (value, prompt) in enumerate(zip(values, prompts)):
        images = vision.image_values(name, value, row, dataset_name)
        if not images:
            continue
        if not is_conversational(prompt):
            raise ValueError(
                f"{dataset_name} row {row} has images but its prompt is a string: image prompts are conversational "
                "(a list of {'role': ..., 'content': ...} messages), so that the processor's chat template can "
                "place the images. Give the raw messages and let the trainer apply the chat template."
            )
        vision.multimodal_messages(prompt, images, row, dataset_name)  # as many images as room for them
        for image in images:
            vision.check_image_file(image, row, dataset_name)


class PromptSource:
    """The dataset's prompts as `Prompt` records, each tokenized once (on first use) and kept. With the model's
    context length, a prompt that does not fit is an error naming its row, and one that leaves less room than
    max_completion_length has its completions capped at the positions left (`fit`), said once in a warning."""

    def __init__(
        self,
        dataset: Any,
        tokenizer: Any,
        chat_template_kwargs: dict | None = None,
        context: int | None = None,
        max_completion_length: int = 0,
        tools: list[dict] | None = None,
        processor: Any = None,
        name: str = "train_dataset",
    ) -> None:
        self.dataset = dataset
        self.name = name  # what errors call the dataset (an evaluation's: "eval_dataset", ...)
        self.tools = tools
        self.processor = processor  # a vision-language model's processor (image prompts), else None
        self.tokenizer = tokenizer
        self.chat_template_kwargs = chat_template_kwargs
        self.context = context
        self.max_completion_length = max_completion_length
        self._cache: dict[int, Prompt] = {}
        self._image_cache: OrderedDict[int, Prompt] = OrderedDict()
        self._warned = False

    def __getitem__(self, row: int) -> Prompt:
        if row in self._cache:
            return self._cache[row]
        if row in self._image_cache:
            self._image_cache.move_to_end(row)
            return self._image_cache[row]
        example = self.dataset[row]
        record = self.make(row, example["prompt"], example=example)
        if record.images:  # decoded images are large: only the recently used are kept (re-reading gives the same)
            self._image_cache[row] = record
            while len(self._image_cache) > IMAGE_PROMPTS_KEPT:
                self._image_cache.popitem(last=False)
        else:
            self._cache[row] = record
        return record

    def make(self, row: int, prompt: Any, tools: list[dict] | None = None, example: dict | None = None) -> Prompt:
        """Row `row`'s prompt (as given: an environment may have added to it) rendered, tokenized and checked;
        with a processor, with the images of the dataset row `example` (`vision.row_images`)."""
        images = vision.row_images(example or {}, row, self.name) if self.processor is not None else None
        record = make_prompt(
            prompt,
            self.tokenizer,
            self.chat_template_kwargs,
            tools or self.tools,
            self.processor,
            images,
            row,
            self.name,
        )
        self._check_length(row, len(record.ids))
        return record

    def _check_length(self, row: int, length: int) -> None:
        if not self.context:
            return
        if length >= self.context:
            raise ValueError(
                f"{self.name} row {row}: the prompt is {length} tokens, but the model's context is "
                f"{self.context}: no completion fits. Shorten it, or filter long prompts out of the dataset."
            )
        if length + self.max_completion_length > self.context and not self._warned:
            self._warned = True
            logger.warning(
                "%s row %d: the prompt (%d tokens) plus max_completion_length (%d) exceeds the model's "
                "context (%d); completions of such prompts are capped at the positions left (they count as "
                "truncated there). Shorten the prompts or max_completion_length to keep the full budget.",
                self.name,
                row,
                length,
                self.max_completion_length,
                self.context,
            )

    def requests(self, rows: Sequence[int]) -> list[Request]:
        """The rows' prompts as requests, a run of equal consecutive prompts as one (`group_requests`), each
        fitted to the context (`fit`)."""
        return self.fit(group_requests([self[row] for row in rows]))

    def fit(self, requests: Sequence[Request]) -> list[Request]:
        """Each request's completions capped at the positions its prompt leaves in the model's context (a learned
        position table has no row past it; a RoPE model was never trained there)."""
        if not self.context:
            return list(requests)
        fitted = []
        for request in requests:
            room = self.context - len(request.prompt.ids)
            if room < (request.max_tokens or self.max_completion_length):
                request = dataclasses.replace(request, max_tokens=room)
            fitted.append(request)
        return fitted


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


def generation_rows(
    position: int, num_rows: int | None, args: ResolvedConfig, process_index: int, num_processes: int
) -> list[int]:
    """Dataset rows a process generates for at data position `position`: each prompt repeated G times, this
    process's contiguous share of the generation batch (shared spec §5.1-5.2). A stream (num_rows None) is read in
    order: position k takes its next generation_batch_size / G rows."""
    per_generation = args.generation_batch_size // args.num_generations
    if num_rows is None:
        unique = list(range(position * per_generation, (position + 1) * per_generation))
    else:
        unique = generation_prompt_indices(
            position,
            num_rows,
            per_generation,
            seeding.prompt_order_seed(args.seed, args.data_seed),
            args.shuffle_dataset,
        )
    repeated = [i for i in unique for _ in range(args.num_generations)]
    return [repeated[i] for i in collectives.local_rows(len(repeated), process_index, num_processes)]


def prompt_groups(rows: Sequence[int], prompt_ids: Sequence[Sequence[int]], by_tokens: bool) -> torch.Tensor:
    """(N,) an id per prompt: rows with the same id have the same prompt tokens (the training pass shares their
    prefix). The dataset row, or `by_tokens` (with environments, whose reset may give a row's G rollouts different
    prompts) one id per distinct token sequence."""
    if not by_tokens:
        return torch.tensor(list(rows), dtype=torch.long)
    ids: dict[tuple[int, ...], int] = {}
    return torch.tensor([ids.setdefault(tuple(p), len(ids)) for p in prompt_ids], dtype=torch.long)
