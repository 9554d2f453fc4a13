"""Image prompts for vision-language models (shared spec §5.3): from a dataset row's `image`/`images` column to the
pixel inputs every forward pass of that row gets.

A row's images are read once (`row_images`: PIL images, or paths opened here), placed into its conversational
prompt as TRL 1.16 places them (`multimodal_messages`: one image block per image at the start of the first user
message with text content), and kept on the row's `Prompt`. Whenever rows run through the model (generation, the
old/reference passes, the training pass) `Pixels.inputs` calls the processor on exactly those rows, in their order,
and hands the model what it returns besides the token ids: pixel values, image grid sizes, pixel masks, and the
per-token fields (`mm_token_type_ids`, `token_type_ids`) marked on the trainer's own token layout. The processor
itself decides how a batch of rows with different image sizes (or none) is arranged, so every architecture it
supports works the same way, and a row's G completions see exactly its image.

Every image grpo decodes (a dataset's files and bytes, a generation server's base64 images) and every PIL image a
dataset gives is at most `MAX_IMAGE_PIXELS`, checked from the header before the pixels are read; the trainer reads
every row's headers when it is built (`check_image_file`), so a missing, unreadable or oversized image is named by
row and path before training.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError
from transformers import ProcessorMixin

IMAGE_COLUMNS = ("images", "image")  # "images" (a list per row) wins over "image" (one per row), as in TRL
TOKEN_FIELDS = ("mm_token_type_ids", "token_type_ids")  # per-token fields: aligned with the input ids
# architectures (config model_type) whose token_type_ids are not image marks: PaliGemma's mark its prompt (0, a
# prefix attended both ways) and its completion (1)
PREFIX_LM = ("paligemma",)
# The most pixels (width x height) an image may have; None: no limit but PIL's. Vision-language processors resize
# to a few megapixels (Qwen2-VL: 12.8 at most), so more only costs memory: a 0.4 MB PNG of 20000x20000 decodes to
# 1.2 GB. 8192 x 8192 (192 MiB as RGB) stays below PIL's own Image.MAX_IMAGE_PIXELS (89 MP: a warning; twice
# that: an error), which grpo turns into this module's error.
MAX_IMAGE_PIXELS: int | None = 8192 * 8192


def is_processor(processing_class: Any) -> bool:
    """Whether `processing_class` is a multimodal processor (a `transformers.ProcessorMixin`), not a tokenizer."""
    return isinstance(processing_class, ProcessorMixin)


def image_column(columns: Sequence[str]) -> str | None:
    return next((name for name in IMAGE_COLUMNS if name in columns), None)


def row_images(example: dict, row: int, dataset: str = "train_dataset") -> list[Any] | None:
    """The row's images as PIL images (RGB), None when the dataset has no image column. `images` is a list (None or
    [] for a row without images); `image` one image or None. A path is opened here: a missing or unreadable file is an
    error naming the row and the path."""
    name = image_column(list(example))
    if name is None:
        return None
    return [load_image(v, row, dataset) for v in image_values(name, example[name], row, dataset)]


def image_values(column: str, value: Any, row: int, dataset: str = "train_dataset") -> list:
    """A row's `column` value as a list of images, as given (empty for none)."""
    if value is None:
        return []
    if column == "images" and not isinstance(value, (list, tuple)):
        raise ValueError(
            f"{dataset} row {row}: the 'images' column holds a {type(value).__name__}; it is a list of images "
            "per row (use an 'image' column for one image per row)."
        )
    return list(value) if column == "images" else [value]


def load_image(value: Any, row: int, dataset: str = "train_dataset") -> Any:
    """One image: a PIL image, a file path, or a `datasets.Image` dict of bytes/path, as an RGB PIL image."""
    if isinstance(value, Image.Image):
        check_pixels(value.size, f"{dataset} row {row}: the image {image_name(value)}")
        return value.convert("RGB") if value.mode != "RGB" else value
    image = _opened(value, row, dataset, lambda image: image.convert("RGB"))
    image.info["grpo_source"] = _name(value)  # how logs name it (info survives copies and pickling)
    return image


def check_image_file(value: Any, row: int, dataset: str = "train_dataset") -> None:
    """What `load_image` would refuse, found before training: a PIL image past the pixel budget; a file or bytes
    that are missing, do not read as an image, whose header gives a size past the budget (refused before any
    pixel is decoded), or whose data does not decode (a truncated PNG): each file is decoded once here and
    dropped, so no more than one image is held at a time. A PIL image opened from a file and not yet read is
    decoded from its file the same way."""
    if isinstance(value, Image.Image):
        check_pixels(value.size, f"{dataset} row {row}: the image {image_name(value)}")
        filename: str = getattr(value, "filename", "") or ""
        if getattr(value, "fp", None) is not None and filename:  # opened lazily from a file, not read yet
            _opened(filename, row, dataset, lambda image: image.load())
    else:
        _opened(value, row, dataset, lambda image: image.load())


def check_pixels(size: tuple[int, int], what: str) -> None:
    """An image of `size` (width, height) past MAX_IMAGE_PIXELS is an error naming `what`."""
    width, height = size
    if MAX_IMAGE_PIXELS is not None and width * height > MAX_IMAGE_PIXELS:
        raise _too_large(
            f"{what} is {width}x{height} pixels ({width * height / 1e6:.0f} megapixels, "
            f"{3 * width * height / 2**30:.1f} GiB decoded)"
        )


def _too_large(what: str) -> ValueError:
    budget = "no limit" if MAX_IMAGE_PIXELS is None else f"{MAX_IMAGE_PIXELS / 1e6:.0f} megapixels"
    pil = Image.MAX_IMAGE_PIXELS
    also = " and PIL.Image.MAX_IMAGE_PIXELS" if pil and (MAX_IMAGE_PIXELS is None or MAX_IMAGE_PIXELS > pil) else ""
    return ValueError(
        f"{what}, more than grpo decodes ({budget}: grpo.models.vision.MAX_IMAGE_PIXELS). Downscale it "
        f"(vision-language processors resize images to a few megapixels anyway), or raise "
        f"grpo.models.vision.MAX_IMAGE_PIXELS{also}."
    )


def _opened(value: Any, row: int, dataset: str, use: Any) -> Any:
    """`use(image)` on the image a path or a `datasets.Image` dict names, opened; a missing, unreadable,
    unsupported or oversized one is an error naming the row (and the path)."""
    source: Any = value
    if isinstance(value, dict):  # a datasets.Image feature that was not decoded
        source = io.BytesIO(value["bytes"]) if value.get("bytes") else value.get("path")
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ValueError(f"{dataset} row {row}: the image file {path} does not exist.")
    elif not isinstance(source, io.BytesIO):
        raise ValueError(
            f"{dataset} row {row}: an image is a PIL image or a file path; got {type(value).__name__} "
            f"{str(value)[:60]!r}."
        )
    try:
        return _decoded(source, f"{dataset} row {row}: the image {_name(value)}", use)
    except (OSError, UnidentifiedImageError) as err:
        raise ValueError(f"{dataset} row {row}: cannot read the image {_name(value)}: {err}.") from None


def _decoded(source: Any, what: str, use: Any) -> Any:
    """`use(image)` on the image in `source` (a path or file object), opened lazily: its size is checked from the
    header (`check_pixels`) before `use` reads any pixel. PIL's decompression-bomb warning is silenced (the budget,
    below PIL's limit unless raised, refuses those images anyway; `catch_warnings` is process-wide, so with several
    threads decoding at once it may stay silenced, which the budget makes harmless) and its error becomes this
    module's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(source) as image:
                check_pixels(image.size, what)
                return use(image)
        except Image.DecompressionBombError as err:  # PIL refuses it in the header already
            raise _too_large(f"{what} is over PIL's decompression-bomb limit ({err})") from None


def _name(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("path") or "(image bytes)")
    return os.fspath(value) if isinstance(value, (str, os.PathLike)) else type(value).__name__


def image_name(image: Any) -> str:
    """How logs name an image: its file name where it came from a file, else its size."""
    filename = image.info.get("grpo_source") or getattr(image, "filename", "")
    return os.path.basename(filename) if filename else f"<image {image.width}x{image.height}>"


def encode_image(image: Any) -> str:
    """An image as base64 PNG (lossless), how images travel to a generation server."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_image(text: Any, what: str) -> Any:
    """`encode_image`'s inverse, the size checked from the header before decoding (`MAX_IMAGE_PIXELS`); anything
    else is a ValueError naming `what` (a request field: the server answers 400 with it)."""
    try:
        body = io.BytesIO(base64.b64decode(text, validate=True))
    except (ValueError, TypeError) as err:
        raise ValueError(f"{what} is not a base64-encoded image ({type(err).__name__})") from None
    try:
        return _decoded(body, what, lambda image: image.convert("RGB"))
    except (OSError, UnidentifiedImageError) as err:
        raise ValueError(f"{what} is not a base64-encoded image ({type(err).__name__})") from None


def multimodal_messages(
    messages: Sequence[dict], images: Sequence[Any], row: int, dataset: str = "train_dataset"
) -> list[dict]:
    """The messages with every text content as text blocks, an image block per image at the start of the first user
    message whose content is a string, and each empty image block (`{"type": "image"}`) given the next image; blocks
    that already hold an image stay. The images must fill the empty blocks exactly."""
    out, placed = [], False
    for message in messages:
        role, content = message.get("role"), message.get("content")
        if isinstance(content, str):
            blocks = [{"type": "text", "text": content}]
            if role == "user" and not placed:
                blocks = [{"type": "image"} for _ in images] + blocks
                placed = True
            message = {**message, "content": blocks}
        out.append(message)
    empty = [
        (i, j)
        for i, message in enumerate(out)
        if isinstance(message.get("content"), list) and message.get("role") != "tool"
        for j, block in enumerate(message["content"])
        if isinstance(block, dict) and block.get("type") == "image" and "image" not in block
    ]
    if len(empty) != len(images):
        raise ValueError(
            f"{dataset} row {row}: the row has {len(images)} image(s) but its prompt has {len(empty)} image "
            "placeholder(s) ({'type': 'image'} blocks) to put them in. Give as many images as placeholders, or "
            "give text content, where grpo places the images at the start of the first user message."
        )
    for image, (i, j) in zip(images, empty):
        content = list(out[i]["content"])
        content[j] = {**content[j], "image": image}
        out[i] = {**out[i], "content": content}
    return out


@dataclass(frozen=True)
class ImageLayout:
    """What one image becomes in the model's tokens: a `digest` of its pixels (equal images, equal digests), how
    many image tokens the processor expands it into (`tokens`), and its grid (`image_grid_thw`'s row, None where
    the processor gives none)."""

    digest: bytes
    tokens: int
    grid: torch.Tensor | None


class Pixels:
    """The processor's non-text inputs for a batch of rows (see the module docstring); the last few batches' are
    kept, since the old/reference passes and the training pass of a micro-batch ask for the same rows. `layout`
    tells what one image becomes in the tokens, and `images_inputs` gives the inputs for rows of images in any
    order (a tree's: `grpo.learner.tree_images`).

    The per-token fields (`mm_token_type_ids`, `token_type_ids`) are marked on the tokens the model gets: 1 at the
    image token, 2 at the video token (`token_types`), as the processor marks them, wherever they are (a tool's
    image sits in the completion)."""

    def __init__(self, processor: Any, token_types: Sequence[int | None] = (), keep: int = 8) -> None:
        self.processor = processor
        self.token_types = tuple(token_types)  # (image token id, video token id)
        self.placeholder: str | None = getattr(processor, "image_token", None)  # one per image in a rendered prompt
        self.keep = keep
        self._cache: OrderedDict[Any, tuple[Any, dict]] = OrderedDict()
        self._layouts: OrderedDict[int, tuple[weakref.ref, ImageLayout]] = OrderedDict()

    @classmethod
    def of(cls, processor: Any, model: Any) -> Pixels | None:
        """For a vision-language model's processor (None for a tokenizer), with the model's image/video tokens. A
        model whose per-token field means something else (`PREFIX_LM`) is refused: the marks would be wrong."""
        if processor is None:
            return None
        config = getattr(model, "config", None)
        if getattr(config, "model_type", None) in PREFIX_LM:
            raise ValueError(
                f"grpo does not train {type(model).__name__} on images: its token_type_ids mark the prompt (which "
                "attends itself both ways, a prefix-LM mask) and the completion, where grpo marks which tokens are "
                "images, so its masks and log-probs would be wrong. Train a vision-language model whose "
                "token_type_ids mark image tokens, or none (Gemma 3, Gemma 4, Qwen2.5-VL, SmolVLM, ...)."
            )
        return cls(processor, (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None)))

    def inputs(self, prompts: Sequence[Any], input_ids: torch.Tensor, device: Any = None) -> dict[str, Any]:
        """Keyword inputs for rows with `prompts` (Prompt records; None for a text-only row) whose tokens, as the
        model gets them, are `input_ids` (B, W)."""
        if not any(p is not None and p.images for p in prompts):
            return {}
        key = tuple(id(p) for p in prompts)
        return self._given(self._kept(key, list(prompts), lambda: self._features(prompts)), input_ids, device)

    def images_inputs(self, images: Sequence[Sequence[Any]], input_ids: torch.Tensor, device: Any = None) -> dict:
        """Keyword inputs for rows holding `images` (each row's, in the order their tokens come), whose tokens, as
        the model gets them, are `input_ids` (R, W): each row must hold as many image tokens as the processor
        expands its images into."""
        if not any(images):
            return {}
        key = ("images", tuple(tuple(id(image) for image in row) for row in images))
        features = self._kept(key, [list(row) for row in images], lambda: self._image_features(images, input_ids))
        return self._given(features, input_ids, device)

    def layout(self, image: Any) -> ImageLayout | None:
        """What `image` becomes in the tokens (`ImageLayout`; None where the processor has no image token to count):
        the processor run on it alone, kept for the last few hundred images while they live (a weak reference:
        this keeps no image in memory)."""
        if self.placeholder is None or not self.token_types or self.token_types[0] is None:
            return None
        kept = self._layouts.get(id(image))
        if kept is not None and kept[0]() is image:
            self._layouts.move_to_end(id(image))
            return kept[1]
        out = self.processor(text=[self.placeholder], images=[[image]], add_special_tokens=False, return_tensors="pt")
        grid = out.get("image_grid_thw")
        digest = hashlib.blake2b(f"{image.mode} {image.size}".encode(), digest_size=16)
        digest.update(image.tobytes())
        layout = ImageLayout(
            digest.digest(), int((out["input_ids"] == self.token_types[0]).sum()), None if grid is None else grid[0]
        )
        self._layouts[id(image)] = (weakref.ref(image), layout)  # the image itself, not another at its id
        while len(self._layouts) > 64 * self.keep:
            self._layouts.popitem(last=False)
        return layout

    def _kept(self, key: Any, held: Any, make: Any) -> dict:
        """The features cached under `key` (`held` keeps the ids in it unique), made by `make()` when missing."""
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key][1]
        features = make()
        self._cache[key] = (held, features)
        while len(self._cache) > self.keep:
            self._cache.popitem(last=False)
        return features

    def _given(self, features: dict, input_ids: torch.Tensor, device: Any) -> dict[str, Any]:
        out = {k: v.to(device) if device is not None else v for k, v in features.items() if k not in TOKEN_FIELDS}
        for name in TOKEN_FIELDS:
            if name in features:
                out[name] = self.type_ids(input_ids)
        return out

    def type_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The per-token field of `input_ids` (`mm_token_type_ids`): 1 at the image token, 2 at the video token."""
        types = torch.zeros_like(input_ids)
        for value, token in enumerate(self.token_types, start=1):
            if token is not None:
                types[input_ids == token] = value
        return types

    def _features(self, prompts: Sequence[Any]) -> dict[str, Any]:
        texts = [self._text(p) for p in prompts]
        images = [list(p.images or ()) if p is not None else [] for p in prompts]
        out = self.processor(text=texts, images=images, padding=True, add_special_tokens=False, return_tensors="pt")
        mask = out["attention_mask"].bool()
        for i, prompt in enumerate(prompts):
            ids = out["input_ids"][i][mask[i]].tolist()
            # a dataset prompt's record (a tool loop's are not: they hold more than their text renders)
            if prompt is not None and prompt.messages is not None and prompt.images and ids != list(prompt.ids):
                raise ValueError(
                    "The processor tokenized an image prompt differently in a batch than alone (its image tokens "
                    "depend on the other rows); grpo cannot line its pixel inputs up with the prompt's tokens."
                )
        return {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}

    def _image_features(self, images: Sequence[Sequence[Any]], input_ids: torch.Tensor) -> dict[str, Any]:
        assert self.placeholder is not None  # `layout` gave the rows' marks
        texts = [self.placeholder * len(row) for row in images]
        rows = [list(row) for row in images]
        out = self.processor(text=texts, images=rows, padding=True, add_special_tokens=False, return_tensors="pt")
        token = self.token_types[0]
        assert token is not None  # `layout` counted it
        given = torch.eq(out["input_ids"], token).sum(-1).tolist()
        held = torch.eq(input_ids, token).sum(-1).tolist()
        if given != held:
            raise ValueError(
                f"The processor expanded rows of images into {given} image tokens where the rows hold {held}: its "
                "image tokens depend on the other images of a batch, so grpo cannot line its pixel inputs up with "
                "the tokens of a tree or of a multi-turn row's turns; train with packing='padded' and "
                "turn_context='appended'."
            )
        return {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}

    def _text(self, prompt: Any) -> str:
        """The text the processor reads with the row's images: its rendered prompt, and a placeholder for each
        image that came later (from a tool)."""
        if prompt is None:
            return ""
        text = prompt.text
        if text is None:  # a text-only prompt whose row got an image from a tool
            text = self.processor.tokenizer.decode(prompt.ids[: prompt.text_tokens])
        later = len(prompt.images or ()) - (text.count(self.placeholder) if self.placeholder else 0)
        if later <= 0:
            return text
        if self.placeholder is None:
            raise ValueError(
                f"The processor ({type(self.processor).__name__}) has no image_token: grpo cannot mark where a "
                "row's images go in its text."
            )
        return text + self.placeholder * later


# a suppressed token's logit where the engine cannot leave it out: its probability underflows to exactly 0 in
# float32, and (unlike -inf) its entropy term stays 0
SUPPRESSED = -1e4


def suppressed_tokens(model: Any) -> list[int]:
    """A vision-language model's image placeholder token(s): never sampled (shared spec §5.4)."""
    config = getattr(model, "config", None)
    return [
        i for i in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None)) if i is not None
    ]


def lora_target_modules(model: torch.nn.Module) -> list[str] | None:
    """The linear layers of a vision-language model's language model (its head excluded), for LoRA's default
    target: None for a text-only model (peft's own default applies)."""
    language = language_model(model)
    if language is None:
        return None
    prefix = next(name for name, module in model.named_modules() if module is language)
    return [
        f"{prefix}.{name}" if prefix else name
        for name, module in language.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]


def language_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The decoder stack of a vision-language model (`model.language_model`, or Idefics3's `model.text_model`); None
    for a text-only model."""
    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is None:
        return None
    inner = getattr(model, "model", model)
    for name in ("language_model", "text_model"):
        if isinstance(getattr(inner, name, None), torch.nn.Module):
            return getattr(inner, name)
    return None


def computes_own_positions(model: Any) -> bool:
    """Whether the model derives its position ids from the image layout itself (Qwen-VL's multimodal RoPE): it is
    then given none."""
    return any(hasattr(m, "get_rope_index") for m in (model, getattr(model, "model", None)) if m is not None)
