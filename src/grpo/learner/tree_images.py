"""Image rows in token trees (`packing="tree"` with a vision-language model).

A vision-language model's rows hold image tokens: one token id repeated, which the model replaces with the features
of the row's images, in the order the tokens come. So in a tree:
- Equal ids are not equal tokens. Each image token is marked with its image (a digest of the pixels) and its place
  in that image (`marks`, `tree.layout`'s marks): two rows' tokens merge only where the same image sits after the
  same tokens. A group's prompt image is then computed once per tree, not once per row, by the vision tower too.
- The pixel inputs follow the tree: each tree row's images in the order of its columns (`inputs`, through
  `grpo.models.vision.Pixels.images_inputs`).
- Positions: a model that derives them from the image layout (Qwen-VL's multimodal RoPE, `get_rope_index`) gets
  them computed over the padded rows, as its padded pass computes them, then carried to each token's column
  (`tree.Tree.origin`); the others get each token's place in its context, as text.

- Attention: a model whose image tokens attend each other both ways within each run of them (transformers'
  blockwise masks: Gemma 3 in every layer, over `token_type_ids`; Gemma 4's larger models in their sliding layers
  only, over `mm_token_type_ids`) gets the same in the tree (`tree.layout`'s `run_layers`): a run's tokens are one
  chain of the tree, each of its keys attended from the run's first token on, as each padded row attends it; in
  the layers where they attend causally the tree's plain ancestor mask (`Tree.run_layers`, `run_layers`).

`unsupported_reason` names what keeps the padded layout: a processor without an image token, another model whose
image tokens attend other tokens both ways (any model whose module builds such masks that `_IMAGE_RUNS` does not
name: the tree's mask would not be theirs; PaliGemma's prefix-LM is refused before, `vision.Pixels.of`), a model
that derives positions some other way. Rows whose image tokens do not add up to their images' keep the padded
layout too (`marks`: None), and so, where runs attend both ways, do rows where two images' tokens touch (their
runs could branch in a tree).
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass
from typing import Any

import torch

from grpo.learner import tree
from grpo.learner.batch import TrainBatch
from grpo.models.modeling import unwrap
from grpo.models.vision import computes_own_positions

# what a model's module builds its masks with where it opens attention among an image's tokens (transformers'
# masking_utils: Gemma 3's and PaliGemma's blocks, an extra mask function OR-ed with the causal one)
_OPEN_MASKS = ("block_sequence_ids", "or_mask_function")

# the architectures (config model_type) whose module builds masks that open attention among image tokens, which a
# tree lays out as they do: by the language model's `use_bidirectional_attention`, the layer types (`layer_types`)
# in which each run of image tokens attends itself both ways (causally otherwise; none: causal everywhere). Each
# is compared with its padded pass in tests/integration/test_tree_images.py.
_IMAGE_RUNS: dict[str, dict[Any, tuple[str, ...]]] = {
    "gemma3": {False: ("full_attention", "sliding_attention"), None: ("full_attention", "sliding_attention")},
    "gemma4": {"vision": ("sliding_attention",), None: ()},  # the larger models; the smaller ones are causal
}


@dataclass(frozen=True)
class Marked:
    """A piece's sequences (`tree.sequence_ids`: a row without turns is one; a row with turns one per turn) with
    their image tokens marked: `marks` for `tree.layout`, each sequence's `images`, and the image of each digest
    (`by_digest`)."""

    marks: list[list[Any]]
    images: list[tuple[Any, ...]]
    by_digest: dict[bytes, Any]
    run_layers: tuple[str, ...] = ()  # the layers where each image's tokens attend each other both ways


@dataclass(frozen=True)
class ImageInputs:
    """What a vision-language model's pass adds: each row's pixel inputs, and the tokens it never samples (their
    logits are pushed to SUPPRESSED, where their probability is exactly 0 in float32 and entropies stay finite).
    In padded rows each row's pixel inputs (`inputs`); in trees each tree row's (`marks`, then `tree_inputs`);
    `run_layers`: the layers where the model's image tokens attend each other both ways within each run
    (`run_layers`)."""

    pixels: Any
    suppressed: tuple[int, ...]
    run_layers: tuple[str, ...] = ()

    @classmethod
    def of(cls, model: Any, pixels: Any, suppressed: tuple[int, ...] = ()) -> ImageInputs:
        """For `model`'s passes, with its processor's `pixels`."""
        return cls(pixels, suppressed, run_layers(model) or ())

    def inputs(self, part: TrainBatch) -> dict[str, Any]:
        """The pixel inputs of the piece's rows (none when no row of it has images)."""
        if part.vision is None:
            return {}
        ids = torch.cat([part.prompt_ids, part.completion_ids], dim=1)
        return self.pixels.inputs(part.vision, ids, ids.device)

    def marks(self, part: TrainBatch) -> Marked | None:
        """The piece's sequences with their image tokens marked, for `tree.layout` (`marks`); None where a tree
        cannot take them."""
        return marks(self.pixels, part, self.run_layers)

    def forked_inputs(self, part: TrainBatch, rows: TrainBatch, marked: Marked | None = None) -> dict[str, Any]:
        """The pixel inputs of `rows`, the forked rows of a piece with turns (`tree.forked(part)`: one row per turn,
        its context then its tokens), each with the images its tokens hold (`marked`: the piece's marks, made here
        if None)."""
        marked = marked if marked is not None else self.marks(part)
        if marked is None:
            raise ValueError(
                "A multi-turn row's turn holds image tokens that are not those of its first images (a chat template "
                "that drops or reorders earlier images when it renders the conversation?); grpo cannot tell which "
                "images each turn saw. Train with turn_context='appended'."
            )
        ids = torch.cat([rows.prompt_ids, rows.completion_ids], dim=1)
        return self.pixels.images_inputs(marked.images, ids, ids.device)

    def tree_inputs(self, model: Any, part: TrainBatch, trees: tree.Tree, marked: Marked | None) -> dict[str, Any]:
        """The trees' image inputs (`inputs` below)."""
        assert marked is not None  # trees of image rows are laid out from their marks
        return inputs(self.pixels, model, part, trees, marked)


def unsupported_reason(model: Any, pixels: Any) -> str | None:
    """Why image rows cannot take a tree with this model and processor (None when they can)."""
    inner = unwrap(model)
    if pixels.placeholder is None or not pixels.token_types or pixels.token_types[0] is None:
        return "the processor or the model names no image token"
    layers = run_layers(inner)
    if layers is None and any(opens_image_attention(name) for name in _model_modules(type(inner))):
        return "the model's image tokens attend other tokens both ways in a way grpo does not lay out in a tree"
    if layers and not getattr(inner.config.get_text_config(), "layer_types", None):
        return "the model's config names no layer_types to tell the layers whose image tokens attend both ways"
    if computes_own_positions(inner) and _rope_index(inner) is None:
        return "the model derives its positions from the images without a get_rope_index grpo can call"
    return None


# the modules of classes a model's class is built on that are not its architecture's: transformers' modeling and
# generation utilities (they name every mask option), torch's (FSDP2 subclasses the model in a module of its own),
# the wrappers', the standard library's
_SHARED = ("builtins", "typing", "abc", "torch", "peft", "accelerate", "deepspeed", "grpo")


def _model_modules(cls: type) -> set[str]:
    """The modules of the classes `cls` is built on that hold an architecture: transformers' model modules, or a
    remote model's own."""
    names = {c.__module__ for c in cls.__mro__}
    return {
        name
        for name in names
        if name.split(".")[0] not in _SHARED
        and (not name.startswith("transformers.") or name.startswith("transformers.models."))
    }


def run_layers(model: Any) -> tuple[str, ...] | None:
    """The layer types in which the model's image tokens attend each other both ways within each run of them (empty
    where they attend causally in every layer); None where `_IMAGE_RUNS` does not name the model and its setting."""
    config: Any = getattr(unwrap(model), "config", None)
    settings = _IMAGE_RUNS.get(str(getattr(config, "model_type", None)))
    if settings is None:
        return None
    return settings.get(getattr(config.get_text_config(), "use_bidirectional_attention", None))


@functools.cache
def opens_image_attention(module_name: str) -> bool:
    """Whether a model's module (its name) builds masks that open attention among tokens (`_OPEN_MASKS`)."""
    module = sys.modules.get(module_name)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return True  # unknown: not taken for causal
    return any(name in source for name in _OPEN_MASKS)


def marks(pixels: Any, part: TrainBatch, run_layers: tuple[str, ...] = ()) -> Marked | None:
    """The piece's sequences (`part`'s rows, or their turns: `Marked`) with their image tokens marked (digest, place
    in the image). A sequence holds its row's first images: as many as its image tokens expand them into (a turn's
    context renders the conversation so far, its images included). None where a row without turns does not hold
    exactly its images' tokens, where a turn's image tokens are not its row's first images', or, for a model whose
    image tokens attend each other both ways (in `run_layers`), where two images' tokens touch: a run of image
    tokens is then one image, which a tree holds as one chain (`tree.layout`)."""
    token = pixels.token_types[0]
    out: list[list[Any]] = []
    images: list[tuple[Any, ...]] = []
    by_digest: dict[bytes, Any] = {}
    for i, turns in enumerate(tree.host_turns(part)):
        prompt = part.vision[i] if part.vision is not None else None
        row = tuple(prompt.images or ()) if prompt is not None else ()
        layouts = [pixels.layout(image) for image in row]
        if any(layout is None for layout in layouts):
            return None
        ends = [0]  # the image tokens of the row's first k images
        for layout in layouts:
            ends.append(ends[-1] + layout.tokens)
        whole = part.turns is None or part.turns[i] is None  # one sequence: it holds all the row's images
        for context, _, _, tokens in turns:
            ids = context + tokens
            held = sum(t == token for t in ids)
            if held != ends[-1] if whole else held not in ends:
                return None
            first = len(row) if whole else ends.index(held)
            places = [(layout.digest, k) for layout in layouts[:first] for k in range(layout.tokens)]
            at = iter(places)
            marked = [next(at) if t == token else None for t in ids]
            if run_layers and any(a and b and b[1] == 0 for a, b in zip(marked, marked[1:])):
                return None  # an image's first token right after another image token: one run, two images
            out.append(marked)
            images.append(row[:first])
        by_digest.update((layout.digest, image) for layout, image in zip(layouts, row))
    return Marked(out, images, by_digest, run_layers)


def inputs(pixels: Any, model: Any, part: TrainBatch, trees: tree.Tree, marked: Marked) -> dict[str, Any]:
    """The model's image inputs for `trees` (laid out from `part` with `marked.marks`): the pixel inputs of each
    tree row's images in column order, and for a model that derives positions from the images, `position_ids`."""
    rows = row_images(pixels.token_types[0], trees, marked)
    out = pixels.images_inputs(rows, trees.input_ids, trees.input_ids.device)
    inner = unwrap(model)
    if computes_own_positions(inner) and any(marked.images):
        out["position_ids"] = _positions(pixels, inner, part, trees, marked)
    return out


def row_images(token: int, trees: tree.Tree, marked: Marked) -> list[list[Any]]:
    """Each tree row's images in the order of its columns (an image's first token, `token`, places it)."""
    origin, place = trees.origin.cpu().tolist(), trees.positions.cpu().tolist()
    images = (trees.input_ids.cpu() == token) & trees.real.cpu().bool()
    rows = []
    for r, columns in enumerate(images):
        firsts = [marked.marks[origin[r][c]][place[r][c]] for c in columns.nonzero().flatten().tolist()]
        rows.append([marked.by_digest[digest] for digest, k in firsts if k == 0])
    return rows


def _rope_index(inner: Any) -> Any:
    """The model's `get_rope_index` where it takes the token ids and images' grids (None otherwise)."""
    for owner in (getattr(inner, "model", None), inner):
        function = getattr(owner, "get_rope_index", None)
        if function is not None:
            names = inspect.signature(function).parameters
            if "input_ids" in names and "image_grid_thw" in names and "attention_mask" in names:
                return function
    return None


def _positions(pixels: Any, inner: Any, part: TrainBatch, trees: tree.Tree, marked: Marked) -> torch.Tensor:
    """(3, R, T) positions of the trees' tokens: the model's own (`get_rope_index`) over the padded rows, each
    token's taken from the row and place it came from."""
    if part.turns is not None:  # the padded rows of turns: one per turn (`Tree.origin` numbers them so)
        part, _, _ = tree.forked(part)
    ids = torch.cat([part.prompt_ids, part.completion_ids], dim=1)
    attention = torch.cat([part.prompt_mask, part.completion_attention], dim=1)
    grids = [pixels.layout(image).grid for row in marked.images for image in row]
    if any(grid is None for grid in grids):
        raise ValueError(
            "The processor gives no image_grid_thw, which the model derives its positions from; train with "
            "packing='padded'."
        )
    function = _rope_index(inner)
    names = inspect.signature(function).parameters
    given = {
        "image_grid_thw": torch.stack(grids).to(ids.device),
        "attention_mask": attention,
        "mm_token_type_ids": pixels.type_ids(ids),
    }
    rope = function(ids, **{k: v for k, v in given.items() if k in names})[0]
    start = part.prompt_ids.shape[1] - part.prompt_mask.sum(-1)  # where each padded row's prompt starts
    column = start[trees.origin] + trees.positions
    return rope[:, trees.origin, column]
