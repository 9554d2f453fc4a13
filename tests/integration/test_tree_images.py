"""Image rows as token trees (issue 47, `grpo.learner.tree_images`) on the four tiny vision-language architectures:
Qwen2.5-VL (multimodal RoPE: positions derived from the images), Idefics3 (tiled images, positions as text), Gemma 3
(image tokens that attend each other both ways) and Gemma 4 (both ways in its sliding layers only, causally in its
global ones; causally everywhere in its smaller models).

The tree pass gives the padded pass's log-probs, entropies and gradients (the vision tower's included), with a
text-only row among image rows, in pieces, with pictures in the completions, and with rendered turns whose
histories hold pictures (against each turn alone, as trees and as forked rows); each group's prompt image is
computed once per tree, and equal ids of different images never merge. Runs train like padded ones. What cannot
take a tree keeps the padded layout: rows whose image tokens do not add up to their images, Gemma 3's rows where two
images touch, and models whose masks open attention in a way grpo does not lay out (PaliGemma)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    Gemma3ForConditionalGeneration,
    Gemma4ForConditionalGeneration,
    PaliGemmaForConditionalGeneration,
)

from grpo import GRPOTrainer
from grpo.base.records import Prompt
from grpo.learner import tree, tree_attention, tree_images
from grpo.learner.batch import collate
from grpo.learner.forward import token_logps
from grpo.learner.layouts import PassSettings
from grpo.models.vision import Pixels
from support.launch import job_script, torchrun
from support.layouts import allowed_pairs, assert_same_pass, dense_twin, gathered, image_pass
from support.runs import cfg, generate, params
from support.vision import BUILDERS, PADDED_ONLY, collated, completion_pictures_batch, image, turn_pictures_batch
from support.vision_runs import QWEN_STRIPPING, CallFirst, image_rows, picture, picture_trainer, trainer_for

ARCHITECTURES = sorted(BUILDERS)
# where each architecture's image tokens attend each other both ways (the others: causally)
RUN_LAYERS = {"gemma3": ("full_attention", "sliding_attention"), "gemma4": ("sliding_attention",)}
GRAD_ATOL = 5e-6  # as test_tree_packing: the attention sums over other widths than the padded pass's


def run(trainer, batch, as_trees, chunk_size=None):
    """The trainer's pass's log-probs, entropies and every parameter's gradient of their sum; and how pieces were
    laid out."""
    return image_pass(trainer.model, batch, trainer.training_pass.images, as_trees, chunk_size)


def sampled_batch(trainer, rows):
    """Completions of dataset rows `rows` as a training batch, the rows of one dataset row a group."""
    rollout = generate(trainer, rows).rollout
    pad = trainer.parts.tokenizer.pad_token_id
    return collate(rollout, torch.zeros(len(rows)), pad, False, group=torch.tensor(rows))


def image_tokens(trainer, ids):
    return int((ids == trainer.unwrapped_model.config.image_token_id).sum())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_image_trees_score_and_backpropagate_as_padded_rows(arch, tmp_path):
    trainer = trainer_for(arch, tmp_path, image_rows(4, with_images={0, 1, 3}), max_completion_length=12)
    batch = sampled_batch(trainer, [0, 0, 1, 1, 2, 2, 3, 3])
    padded, _ = run(trainer, batch, as_trees=False)
    trees, laid_out = run(trainer, batch, as_trees=True)
    assert laid_out == {"trees": 1}
    assert_same_pass(trees, padded, batch, GRAD_ATOL)
    tower = [n for n in padded[2] if "vision" in n or "visual" in n]
    assert tower and any(padded[2][n].abs().sum() > 0 for n in tower)  # the vision tower's gradients compared too
    pieces, laid_out = run(trainer, batch, as_trees=True, chunk_size=3)  # pieces that split groups
    assert laid_out == {"trees": 3}
    assert_same_pass(pieces, padded, batch, GRAD_ATOL)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_groups_prompt_image_is_computed_once_per_tree(arch, tmp_path):
    trainer = trainer_for(arch, tmp_path, image_rows(4, with_images={0, 1, 3}), max_completion_length=12)
    batch = sampled_batch(trainer, [0, 0, 1, 1, 2, 2, 3, 3])
    images = trainer.training_pass.images
    marked = images.marks(batch)
    trees = tree.layout(batch, marks=marked.marks)
    padded_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    assert image_tokens(trainer, trees.input_ids) * 2 == image_tokens(trainer, padded_ids)  # 2 rows per group
    inputs = images.tree_inputs(trainer.model, batch, trees, marked)
    if arch.startswith("qwen"):  # one grid per image the vision tower computes: 3 prompts' images, not 6 rows'
        assert len(inputs["image_grid_thw"]) == 3 and len(images.inputs(batch)["image_grid_thw"]) == 6
        assert inputs["position_ids"].shape == (3, *trees.input_ids.shape)
    else:  # the tiles of 3 images (the padding images of a row are all zeros)
        real = inputs["pixel_values"].flatten(2).abs().sum(-1) > 0
        per_row = images.inputs(batch)["pixel_values"].flatten(2).abs().sum(-1) > 0
        assert int(real.sum()) * 2 == int(per_row.sum())


def test_a_tools_image_in_the_completions(tmp_path):
    """A tool returns a picture inside the completions: the two rows of a group make the same call and get the same
    picture, which the tree holds once; with another picture of the same size (the same token ids) in one row,
    the rows' image tokens stay apart. Both score and backpropagate as the padded rows."""
    trainer = picture_trainer(tmp_path, image_rows(2, with_images={0}))
    batch = sampled_batch(trainer, [0, 0, 1, 1])
    assert [len(p.images) for p in batch.vision] == [2, 2, 1, 1]
    padded, _ = run(trainer, batch, as_trees=False)
    trees, laid_out = run(trainer, batch, as_trees=True)
    assert laid_out == {"trees": 1}
    assert_same_pass(trees, padded, batch, GRAD_ATOL)
    images = trainer.training_pass.images
    shared = tree.layout(batch, marks=images.marks(batch).marks)
    shown = picture("x")[0]["image"]
    other = dataclasses.replace(batch.vision[1], images=(*batch.vision[1].images[:-1], image(50, *shown.size)))
    apart_batch = dataclasses.replace(batch, vision=[batch.vision[0], other, *batch.vision[2:]])
    apart = tree.layout(apart_batch, marks=images.marks(apart_batch).marks)
    assert torch.equal(  # the same token ids in both batches, the second picture's tokens laid out apart
        torch.cat([batch.prompt_ids, batch.completion_ids], 1),
        torch.cat([apart_batch.prompt_ids, apart_batch.completion_ids], 1),
    )
    picture_tokens = image_tokens(trainer, batch.completion_ids[1])
    assert image_tokens(trainer, apart.input_ids) == image_tokens(trainer, shared.input_ids) + picture_tokens
    padded, _ = run(trainer, apart_batch, as_trees=False)
    trees, _ = run(trainer, apart_batch, as_trees=True)
    assert_same_pass(trees, padded, apart_batch, GRAD_ATOL)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_pictures_in_the_completions_are_shared_only_where_the_same(arch):
    """Pictures inside the completions (where a tool's go), on each architecture: a picture two rows got after the
    same tokens is laid out once, another picture of the same size apart, and the tree pass's log-probs,
    entropies and gradients are the padded pass's (Gemma 3: the pictures' tokens attend each other both ways in
    the tree too; Qwen2.5-VL: positions derived from pictures in the completions)."""
    model, processor = BUILDERS[arch](0)
    pixels = Pixels.of(processor, model)
    images = tree_images.ImageInputs.of(model, pixels)
    batch = completion_pictures_batch(processor)
    marked = images.marks(batch)
    trees = tree.layout(batch, marks=marked.marks, run_layers=marked.run_layers)
    token = model.config.image_token_id
    per_picture = pixels.layout(image(2, 28, 28)).tokens
    prompt_picture = pixels.layout(image(1, 28, 28)).tokens
    # the prompt's picture once, A once per group, the other picture once
    assert int((trees.input_ids == token).sum()) == prompt_picture + 3 * per_picture
    assert marked.run_layers == RUN_LAYERS.get(arch, ())

    (trees, laid_out), (padded, _) = image_pass(model, batch, images, True), image_pass(model, batch, images, False)
    assert laid_out == {"trees": 1}
    assert_same_pass(trees, padded, batch, GRAD_ATOL)


@pytest.mark.parametrize(
    "arch,rows",
    [
        ("gemma3", "completion pictures"),
        ("gemma4", "completion pictures"),
        ("qwen2.5-vl", "turns"),
        ("qwen3-vl", "turns"),
    ],
)
def test_flex_attention_scores_image_trees_as_the_padded_pass(monkeypatch, arch, rows):
    """The "flex" kernel (compiled here for the CPU, forward only; the GPU check runs it forward and backward) gives
    the padded pass's log-probs and entropies: for Gemma 3's pictures in the completions, whose tokens attend each
    other both ways, for Gemma 4's, which do in its sliding layers only (a block mask per layer type, heads of two
    sizes), and for Qwen2.5-VL's rendered turns with pictures (positions from the forked rows) against the forked
    rows."""
    monkeypatch.setattr(tree_attention, "FORCE_KERNEL", "flex")
    model, processor = BUILDERS[arch](0)
    images = tree_images.ImageInputs.of(model, Pixels.of(processor, model))
    batch = completion_pictures_batch(processor) if rows == "completion pictures" else turn_pictures_batch(processor)[0]
    with torch.no_grad():
        padded = token_logps(model, batch, PassSettings(0.9, images=images))
        flex = token_logps(model, batch, PassSettings(0.9, images=images, layouts=("trees",)))
    assert flex.layouts == ("trees",)
    m = batch.mask.bool()
    for got, expected in ((flex.logps, padded.logps), (flex.entropies, padded.entropies)):
        torch.testing.assert_close(got[m], expected[m], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_gemma4s_block_masks_per_layer_type_train_as_the_padded_pass(monkeypatch, checkpointing):
    """The "flex" kernel's plumbing for Gemma 4, forward and backward, on the CPU: each layer type gets its own block
    mask (the sliding layer the image runs', the global ones the plain tree's), also in the forward gradient
    checkpointing re-runs; log-probs, entropies and gradients are the padded pass's. FlexAttention has no backward
    on the CPU, so `support.layouts.dense_twin` stands in for it (the block mask's own rule, attended by SDPA)."""
    masks = []

    def twin(module, query, key, value, attention_mask, **kwargs):
        masks.append((module.layer_idx, attention_mask))
        return dense_twin(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(tree_attention, "_flex_attention", twin)
    monkeypatch.setattr(tree_attention, "FORCE_KERNEL", "flex")
    model, processor = BUILDERS["gemma4"](0)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    images = tree_images.ImageInputs.of(model, Pixels.of(processor, model))
    batch = completion_pictures_batch(processor)
    (flex, laid_out), (padded, _) = image_pass(model, batch, images, True), image_pass(model, batch, images, False)
    assert laid_out == {"trees": 1}
    assert_same_pass(flex, padded, batch, GRAD_ATOL)
    layers = model.config.text_config.num_hidden_layers
    assert len(masks) == layers * (2 if checkpointing else 1)
    sliding, full = masks[1][1], masks[0][1]  # layers 0 and 2 are global, layer 1 sliding
    assert masks[2][1] is full
    shape = (sliding.shape[0], sliding.shape[-1])
    opened = allowed_pairs(sliding, *shape) & ~allowed_pairs(full, *shape)  # image tokens attending later ones
    assert opened.any() and not (allowed_pairs(full, *shape) & ~allowed_pairs(sliding, *shape)).any()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_rendered_turns_with_pictures_score_as_their_turns_alone(arch):
    """Rows whose turns were sampled after rendered histories holding pictures (the prompt's and a tool's): as
    trees and as forked rows, each token's log-prob, entropy and the gradients are those of its turn scored as a
    row of its own with the pictures its context and tokens hold. The tree holds a history two rows share once."""
    model, processor = BUILDERS[arch](0)
    pixels = Pixels.of(processor, model)
    images = tree_images.ImageInputs.of(model, pixels)
    batch, singles, where = turn_pictures_batch(processor)

    alone, _ = image_pass(model, singles, images, False)
    expected = (gathered(alone[0], where, batch.mask.shape), gathered(alone[1], where, batch.mask.shape), alone[2])
    trees, laid_out = image_pass(model, batch, images, True)
    assert laid_out == {"trees": 1}
    assert_same_pass(trees, expected, batch, GRAD_ATOL)
    forked, _ = image_pass(model, batch, images, False)
    assert_same_pass(forked, expected, batch, GRAD_ATOL)
    marked = images.marks(batch)
    layout = tree.layout(batch, marks=marked.marks, run_layers=marked.run_layers)
    token = model.config.image_token_id
    per_picture = pixels.layout(image(2, 28, 28)).tokens
    # group 0: the prompt's picture, A (in the shared first turn and the shared history), B twice (its turn and its
    # history); group 1: A twice
    assert int((layout.input_ids == token).sum()) == 7 * per_picture


def test_the_smaller_gemma4s_causal_image_tokens_take_trees():
    """A Gemma 4 whose image tokens attend causally (`use_bidirectional_attention` None, as its smaller models):
    its module builds open masks, but grpo knows this setting is causal, so its pictures take trees, with plain
    ancestor masks in every layer, and score and backpropagate as the padded pass; and one that attends both ways
    everywhere ("all": not a generative model) keeps padded rows."""
    model, processor = BUILDERS["gemma4"](0, bidirectional=None)
    pixels = Pixels.of(processor, model)
    images = tree_images.ImageInputs.of(model, pixels)
    assert tree_images.unsupported_reason(model, pixels) is None and images.run_layers == ()
    batch = completion_pictures_batch(processor)
    (trees, laid_out), (padded, _) = image_pass(model, batch, images, True), image_pass(model, batch, images, False)
    assert laid_out == {"trees": 1}
    assert_same_pass(trees, padded, batch, GRAD_ATOL)
    marked = images.marks(batch)
    assert tree.layout(batch, marks=marked.marks, run_layers=marked.run_layers).run_layers is None
    model.config.text_config.use_bidirectional_attention = "all"
    assert "both ways" in tree_images.unsupported_reason(model, pixels)
    model.config.text_config.use_bidirectional_attention, model.config.text_config.layer_types = "vision", None
    assert "layer_types" in tree_images.unsupported_reason(model, pixels)


def test_touching_images_and_rows_past_the_window_keep_the_padded_layout():
    """Gemma 3 (image tokens attend each other both ways within each run of them): a row whose completion holds two
    pictures' tokens touching (one run of two pictures: it could branch in a tree) gets no marks, where a causal
    model's rows get them; and a row longer than the language model's sliding window (its text config's) keeps
    padded rows."""
    model, processor = BUILDERS["gemma3"](0)
    pixels = Pixels.of(processor, model)
    token = model.config.image_token_id
    pictures = (image(1, 28, 28), image(2, 28, 28), image(3, 28, 28))
    n = pixels.layout(pictures[0]).tokens
    ids = [5, *[token] * n, 6]
    vision = [Prompt(ids=tuple(ids), images=pictures, text="")]
    batch = collated(processor.tokenizer, [ids], [[token] * (2 * n) + [7]], vision)
    assert tree_images.marks(pixels, batch, RUN_LAYERS["gemma3"]) is None
    assert tree_images.marks(pixels, batch) is not None
    apart = completion_pictures_batch(processor)
    assert tree.fits_window(model, apart)
    model.config.text_config.sliding_window = 8
    assert not tree.fits_window(model, apart)


def test_rows_whose_image_tokens_do_not_add_up_keep_the_padded_layout(tmp_path):
    trainer = trainer_for("qwen2.5-vl", tmp_path, image_rows(2), max_completion_length=8)
    batch = sampled_batch(trainer, [0, 0, 1, 1])
    images = trainer.training_pass.images
    assert images.marks(batch) is not None
    extra = dataclasses.replace(batch.vision[0], images=(*batch.vision[0].images, image(7)))  # no tokens for it
    assert images.marks(dataclasses.replace(batch, vision=[extra, *batch.vision[1:]])) is None


def built_as(cls, config):
    """An instance of model class `cls` with `config` and no weights (what the checks read)."""
    model = object.__new__(cls)
    object.__setattr__(model, "config", config)
    return model


def test_which_models_image_rows_take_trees():
    """Qwen2.5-VL's, Qwen3-VL's, Idefics3's and LLaVA's image tokens attend causally; Gemma 3's attend each other both
    ways within each image, which a tree lays out (also through an FSDP2-style subclass); a model whose module opens
    attention some other way (PaliGemma: its whole prompt) keeps the padded layout, and so does a processor without
    an image token, and Qwen3.5 (its image tokens attend causally, but its linear-attention layers are recurrent)."""
    for arch in ("qwen2.5-vl", "qwen3-vl", "idefics3", "llava"):
        assert not tree_images.opens_image_attention(type(BUILDERS[arch](0)[0]).__module__)
    qwen35, qwen35_processor = PADDED_ONLY["qwen3.5"](0)
    assert tree_images.unsupported_reason(qwen35, Pixels.of(qwen35_processor, qwen35)) is None
    assert "recurrent" in tree.unsupported_reason(qwen35)
    assert tree_images.opens_image_attention(PaliGemmaForConditionalGeneration.__module__)
    assert tree_images.opens_image_attention(Gemma3ForConditionalGeneration.__module__)
    model, processor = BUILDERS["qwen2.5-vl"](0)
    no_token = SimpleNamespace(placeholder=None, token_types=(None, None))
    assert "image token" in tree_images.unsupported_reason(model, no_token)
    pixels = Pixels.of(processor, model)
    assert tree_images.unsupported_reason(model, pixels) is None and not tree_images.run_layers(model)
    gemma, gemma_processor = BUILDERS["gemma3"](0)
    assert tree_images.run_layers(gemma) == RUN_LAYERS["gemma3"]
    assert tree_images.unsupported_reason(gemma, Pixels.of(gemma_processor, gemma)) is None
    wrapped = type("FSDPGemma3", (Gemma3ForConditionalGeneration,), {"__module__": "torch.distributed.fsdp"})
    fsdp = built_as(wrapped, gemma.config)
    assert tree_images.run_layers(fsdp) == RUN_LAYERS["gemma3"] and tree_images.unsupported_reason(fsdp, pixels) is None
    gemma4, gemma4_processor = BUILDERS["gemma4"](0)
    assert tree_images.opens_image_attention(Gemma4ForConditionalGeneration.__module__)
    assert tree_images.run_layers(gemma4) == ("sliding_attention",)
    assert tree_images.unsupported_reason(gemma4, Pixels.of(gemma4_processor, gemma4)) is None
    paligemma = built_as(PaliGemmaForConditionalGeneration, SimpleNamespace(model_type="paligemma"))
    assert "both ways" in tree_images.unsupported_reason(paligemma, pixels)
    fsdp_paligemma = type("FSDPPali", (PaliGemmaForConditionalGeneration,), {"__module__": "torch.distributed.fsdp"})
    assert "both ways" in tree_images.unsupported_reason(built_as(fsdp_paligemma, paligemma.config), pixels)


@pytest.mark.parametrize(
    "arch,lora",
    [
        ("gemma3", False),
        ("gemma4", False),
        ("idefics3", False),
        ("llava", False),
        ("qwen2.5-vl", False),
        ("qwen2.5-vl", True),
        ("qwen3-vl", False),
    ],
)
def test_an_image_run_as_trees_trains_like_a_padded_one(arch, lora, tmp_path):
    """Two SGD steps with a KL term (the reference pass as trees too), and with LoRA adapters on the language model:
    the tree run's parameters are the padded run's."""
    from peft import LoraConfig

    def trained(packing):
        lora_config = LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM") if lora else None
        trainer = trainer_for(
            arch,
            tmp_path / packing,
            max_steps=2,
            packing=packing,
            beta=0.04,
            learning_rate=0.5,
            optim="sgd",
            peft_config=lora_config,
        )
        trainer.train()
        return trainer

    padded, trees = trained("padded"), trained("tree")
    assert trees.training_pass.laid_out["trees"] > 0 and "trees" not in padded.training_pass.laid_out
    tree_params = params(trees.model)
    moved = 0
    for name, value in params(padded.model).items():
        torch.testing.assert_close(tree_params[name], value, rtol=1e-4, atol=1e-6)
        moved += int("lora_B" in name and bool(value.abs().sum() > 0))
    assert moved > 0 if lora else True


def token_sum_reward(completion_ids, **kwargs):
    """Differs between a group's samples whatever their lengths (a random model's turns may all run to the cap, and
    `length_reward` then gives a group no advantage: on an AVX2-only machine no parameter moved)."""
    return [float(sum(ids) % 13) for ids in completion_ids]


def test_a_run_over_rendered_turns_with_pictures_trains_like_forked_rows(tmp_path):
    """Two SGD steps with a KL term (the reference pass scores the turns too) over rendered turns whose histories
    hold the prompt's and a tool's pictures (Qwen2.5-VL): the tree run ends with the forked rows' parameters."""

    def trained(packing):
        model, processor = BUILDERS["qwen2.5-vl"](0)
        processor.chat_template = processor.tokenizer.chat_template = QWEN_STRIPPING
        tok = processor.tokenizer
        args = cfg(
            tmp_path / packing,
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=200,
            max_steps=2,
            packing=packing,
            beta=0.04,
            learning_rate=0.5,
            optim="sgd",
        )
        rows = image_rows(2, with_images={0})
        trainer = GRPOTrainer(model, token_sum_reward, args, rows, processing_class=processor, tools=[picture])
        trainer.engine = CallFirst(trainer.engine, tok)
        call = '<think>first I look</think><tool_call>{"name": "picture", "arguments": {"name": "x"}}</tool_call>'
        trainer.engine.call = tok(call)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
        initial = params(trainer.model)
        trainer.train()
        return trainer, initial

    (padded, initial), (trees, _) = trained("padded"), trained("tree")
    assert trees.training_pass.laid_out["trees"] > 0 and "trees" not in padded.training_pass.laid_out
    # turns were sampled after rendered histories
    assert trees.parts.rollouts.loop.rendered and padded.engine.follow_ups
    tree_params = params(trees.model)
    assert any(not torch.equal(initial[n], v) for n, v in tree_params.items())
    for name, value in params(padded.model).items():
        torch.testing.assert_close(tree_params[name], value, rtol=1e-4, atol=1e-6)


def test_two_processes_as_trees_train_like_padded_rows(tmp_path):
    """DDP, images on one process only (the other's vision tower unused), a KL term: the tree run ends with the
    padded run's parameters on both processes, both of which laid their pieces out as trees."""
    job = job_script("vision_job.py")
    ends = {}
    for packing in ("padded", "tree"):
        torchrun(2, job, tmp_path / packing, "qwen2.5-vl", packing, timeout=600)
        ends[packing] = [torch.load(tmp_path / packing / f"params_{rank}.pt") for rank in (0, 1)]
    assert all(end["laid_out"].get("trees", 0) > 0 for end in ends["tree"])
    assert all("trees" not in end["laid_out"] for end in ends["padded"])
    for rank in (0, 1):
        for name, value in ends["padded"][rank]["params"].items():
            torch.testing.assert_close(ends["tree"][rank]["params"][name], value, rtol=1e-4, atol=1e-6)
