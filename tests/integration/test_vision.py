"""Image prompts (issue 20) on two tiny vision-language architectures (`support.vision`): Qwen2.5-VL (multimodal RoPE,
image patches flattened over the batch) and Idefics3/SmolVLM (tiled images batched per row).

The image really reaches the model: the training pass's log-probs of the sampled tokens equal the sampler's, and
change when a row's image is replaced. Training changes every parameter of the language model; LoRA leaves the
vision tower alone; a run resumed mid-cycle (the buffered image rows restored from the checkpoint) ends
bit-identical to a straight one; bad image input fails at construction with the row (and path) named."""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import os
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from datasets import Dataset
from PIL import Image

from grpo import GRPOTrainer
from grpo.agent import CHATML_TOOLS
from grpo.base.records import Rollout
from grpo.data import prompts as data
from grpo.learner.batch import collate
from grpo.models.vision import Pixels, language_model
from support.launch import job_script, torchrun
from support.rewards import length_reward
from support.runs import cfg, generate, params
from support.tiny import make_model, make_tokenizer
from support.vision import BUILDERS, MODELS, image
from support.vision_runs import (
    QWEN_STRIPPING,
    QWEN_TOOLS,
    CallFirst,
    build,
    image_rows,
    picture,
    picture_trainer,
    trainer_for,
)

ARCHITECTURES = sorted(MODELS)  # Qwen3.5's too: padded rows


def sampled_batch(trainer, rows):
    """Completions of `rows` from the trainer's engine, as a training batch."""
    generated = generate(trainer, rows)
    n = len(generated.rollout)
    return collate(generated.rollout, torch.zeros(n), trainer.parts.tokenizer.pad_token_id, False), generated.rollout


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_training_logps_equal_sampling_logps_and_depend_on_the_image(arch, tmp_path):
    trainer = trainer_for(arch, tmp_path, image_rows(4, with_images={0, 1, 3}))  # a text-only row among them
    batch, rollout = sampled_batch(trainer, [0, 0, 1, 1, 2, 2, 3, 3])
    assert [p is not None and bool(p.images) for p in batch.vision] == [True] * 4 + [False] * 2 + [True] * 2
    assert batch.vision[0] is batch.vision[1]  # the G completions of a prompt share its image
    mask = batch.completion_attention.bool()
    logps = trainer.training_pass.logps(trainer.model, batch, 3)  # pieces of 3 rows: pixels sliced per piece
    torch.testing.assert_close(logps[mask], batch.sampling_logps[mask], rtol=1e-5, atol=1e-6)
    # the same rows with row 0's image replaced (same size: the same image tokens) score differently
    swapped = dataclasses.replace(batch.vision[0], images=(image(99, *batch.vision[0].images[0].size),))
    other = dataclasses.replace(batch, vision=[swapped, swapped, *batch.vision[2:]])
    changed = trainer.training_pass.logps(trainer.model, other, 3)
    assert not torch.allclose(changed[:2][mask[:2]], logps[:2][mask[:2]], rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(changed[2:][mask[2:]], logps[2:][mask[2:]], rtol=1e-5, atol=1e-6)
    assert isinstance(rollout, Rollout) and all(len(c) for c in rollout.completion_ids)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("checkpointing", [True, False])
def test_steps_change_every_language_model_parameter(arch, tmp_path, checkpointing):
    trainer = trainer_for(arch, tmp_path, max_steps=3, gradient_checkpointing=checkpointing, beta=0.04)
    language = {id(p) for p in language_model(trainer.unwrapped_model).parameters()}
    before = params(trainer.unwrapped_model)
    trainer.train()
    after = dict(trainer.unwrapped_model.named_parameters())
    unchanged = [n for n, p in after.items() if id(p) in language and torch.equal(p.detach(), before[n])]
    assert not unchanged, unchanged
    assert any(not torch.equal(after[n].detach(), before[n]) for n in before if "vision" in n or "visual" in n)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_lora_targets_the_language_model_and_leaves_the_vision_tower(arch, tmp_path):
    from peft import LoraConfig

    model, processor = MODELS[arch](0)
    vision_before = {n: p.detach().clone() for n, p in model.named_parameters() if "vision" in n or "visual" in n}
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    args = cfg(tmp_path, per_device_train_batch_size=4, num_generations=4, max_steps=2, beta=0.04)
    trainer = GRPOTrainer(
        model=model,
        processing_class=processor,
        reward_funcs=length_reward,
        train_dataset=image_rows(),
        args=args,
        peft_config=config,
    )
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not [n for n in trainable if "vision" in n or "visual" in n or "connector" in n or "merger" in n]
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    now = dict(trainer.model.named_parameters())
    assert all(not torch.equal(now[n].detach(), adapters[n]) for n in adapters if "lora_B" in n)
    for name, value in vision_before.items():
        match = [p for n, p in now.items() if n.endswith(name)]
        assert len(match) == 1 and torch.equal(match[0].detach(), value), name


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_resume_mid_cycle_with_images_is_exact(arch, tmp_path):
    """steps_per_generation=2: checkpoint-1 holds the second half of a generation batch of image rows."""
    common = dict(max_steps=3, steps_per_generation=2, save_strategy="steps", save_steps=1, beta=0.04)
    straight = trainer_for(arch, tmp_path / "a", **common)
    straight.train()
    resumed = trainer_for(arch, tmp_path / "b", **common)
    resumed.train()  # its own run, then again from its checkpoint-1 in a fresh trainer
    again = trainer_for(arch, tmp_path / "b", **common)
    assert glob.glob(str(tmp_path / "b" / "out" / "checkpoint-1" / "rollouts_0.pt"))
    again.train(resume_from_checkpoint=str(tmp_path / "b" / "out" / "checkpoint-1"))
    for (name, p), q in zip(straight.unwrapped_model.named_parameters(), again.unwrapped_model.parameters()):
        assert torch.equal(p, q), name


def test_rewards_get_the_images_and_image_prompts(tmp_path):
    seen = {}

    def reward(prompts, completions, image, **kwargs):
        seen.update(prompts=prompts, image=image)
        return [float(len(c[0]["content"])) for c in completions]

    model, processor = BUILDERS["qwen2.5-vl"](0)
    rows = image_rows(2)
    args = cfg(tmp_path, per_device_train_batch_size=4, num_generations=2, log_completions=True)
    args.num_completions_to_print = 0
    GRPOTrainer(model=model, processing_class=processor, reward_funcs=reward, train_dataset=rows, args=args).train()
    assert len(seen["image"]) == 4 and all(isinstance(i, Image.Image) for i in seen["image"])
    first = seen["prompts"][0][0]["content"]
    assert first[0]["type"] == "image" and isinstance(first[0]["image"], Image.Image)
    assert first[1] == {"type": "text", "text": first[1]["text"]} and "picture" in first[1]["text"]
    table = pd.read_parquet(glob.glob(os.path.join(args.output_dir, "completions", "*.parquet"))[0])
    assert set(table["image"]) == {"<image 24x28>", "<image 34x34>"}
    assert table["prompt"].str.count("<\\|image_pad\\|>").max() == 1  # the template's text, not the expanded ids


def test_image_paths_and_lists_of_images(tmp_path):
    """An `images` column of paths, one row with two images and one with none; file names reach the log."""
    paths = []
    for i in range(3):
        path = tmp_path / f"photo{i}.png"
        image(i, 30 + 4 * i, 30).save(path)
        paths.append(str(path))
    rows = [
        {"prompt": [{"role": "user", "content": "Compare."}], "images": paths[:2]},
        {"prompt": [{"role": "user", "content": "Describe."}], "images": [paths[2]]},
        {"prompt": [{"role": "user", "content": "No picture."}], "images": []},
        {"prompt": [{"role": "user", "content": "Again."}], "images": [paths[0]]},
    ]
    trainer = trainer_for("idefics3", tmp_path, rows, max_steps=2, log_completions=True)
    trainer.args.num_completions_to_print = 0
    trainer.train()
    assert len(trainer.parts.prompts[0].images) == 2 and trainer.parts.prompts[2].images is None
    files = sorted(glob.glob(os.path.join(trainer.args.output_dir, "completions", "*.parquet")))
    names = set(pd.concat(pd.read_parquet(f) for f in files)["image"].dropna())
    assert names <= {"photo0.png, photo1.png", "photo2.png", "photo0.png", ""} and "photo0.png, photo1.png" in names


def test_bad_image_input_is_named_before_training(tmp_path):
    chat = [{"role": "user", "content": "Look."}]
    missing = str(tmp_path / "nowhere.png")
    with pytest.raises(ValueError, match=f"row 2: the image file {missing} does not exist"):
        build(tmp_path, [{"prompt": chat, "image": image(0)}] * 2 + [{"prompt": chat, "image": missing}] * 2)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image at all")
    with pytest.raises(ValueError, match=f"row 0: cannot read the image {broken}"):
        build(tmp_path, [{"prompt": chat, "image": str(broken)}] * 4)
    with pytest.raises(ValueError, match="row 1 has images but its prompt is a string.*conversational"):
        build(tmp_path, [{"prompt": chat, "image": image(0)}, {"prompt": "Look.", "image": image(1)}] * 2)
    two_slots = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which?"}]}]
    with pytest.raises(ValueError, match=r"row 0: the row has 2 image\(s\) but its prompt has 1 image placeholder"):
        build(tmp_path, [{"prompt": two_slots, "images": [image(0), image(1)]}] * 4)
    with pytest.raises(ValueError, match="'images' column holds a Image"):
        build(tmp_path, [{"prompt": chat, "images": image(0)}] * 4).train()
    assert not os.path.exists(tmp_path / "out" / "checkpoint-1")


def test_a_vision_model_defaults_ddp_to_find_unused_parameters(tmp_path):
    trainer = trainer_for("idefics3", tmp_path)
    assert trainer.args.ddp_find_unused_parameters is True
    text_only = cfg(tmp_path, ddp_find_unused_parameters=False)
    model, processor = BUILDERS["idefics3"](0)
    t = GRPOTrainer(
        model=model, processing_class=processor, reward_funcs=length_reward, train_dataset=image_rows(), args=text_only
    )
    assert t.args.ddp_find_unused_parameters is False


def test_mixed_batch_without_any_image_trains(tmp_path):
    """A vision-language model on rows of which a whole generation batch may have no image."""
    rows = [{"prompt": [{"role": "user", "content": f"Text only {i}"}], "image": None} for i in range(4)]
    trainer = trainer_for("qwen2.5-vl", tmp_path, rows, max_steps=1)
    before = params(trainer.unwrapped_model)
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.unwrapped_model.named_parameters())


def test_dataset_of_image_features(tmp_path):
    """A datasets.Dataset whose image column is a datasets Image feature (decoded to PIL by datasets)."""
    rows = image_rows(4)
    dataset = Dataset.from_list(rows)
    assert type(dataset.features["image"]).__name__ == "Image"
    trainer = trainer_for("qwen2.5-vl", tmp_path, dataset, max_steps=1)
    trainer.train()
    assert trainer.parts.prompts[0].images[0].size == rows[0]["image"].size


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def test_tool_turns_see_the_prompts_image(tmp_path):
    """With tools, each next turn is sampled with the row's image, and the training pass agrees on its tokens."""
    model, processor = BUILDERS["qwen2.5-vl"](0)
    processor.chat_template = processor.tokenizer.chat_template = QWEN_TOOLS
    args = cfg(tmp_path, per_device_train_batch_size=4, num_generations=2, max_completion_length=120)
    rows = image_rows(2)
    trainer = GRPOTrainer(model, length_reward, args, rows, processing_class=processor, tools=[multiply])
    trainer.engine = CallFirst(trainer.engine, trainer.parts.tokenizer)
    rollout = generate(trainer, [0, 0, 1, 1]).rollout
    follow_ups = trainer.engine.follow_ups[0]
    assert [r.prompt.images for r in follow_ups] == [(rows[0]["image"],)] * 2 + [(rows[1]["image"],)] * 2
    assert all(rollout.tool_calls) and rollout.vision[0].images == (rows[0]["image"],)
    batch = collate(rollout, torch.zeros(4), trainer.parts.tokenizer.pad_token_id, False)
    sampled = batch.mask.bool() & (batch.sampling_logps != 0)  # the real engine's turn (the script's logps are 0)
    assert sampled.sum() > 0
    logps = trainer.training_pass.logps(trainer.model, batch, 2)
    torch.testing.assert_close(logps[sampled], batch.sampling_logps[sampled], rtol=1e-5, atol=1e-6)


def test_rendered_turns_hold_the_pictures_and_score_as_sampled(tmp_path):
    """With a template that strips earlier reasoning, a vision-language model's next turn is sampled after the
    conversation as its processor renders it: without the first turn's reasoning, with the prompt's picture and the
    tool's. The rows carry their turns, and the training pass, as trees and as forked rows, scores each sampled token
    as the sampler did."""
    model, processor = BUILDERS["qwen2.5-vl"](0)
    processor.chat_template = processor.tokenizer.chat_template = QWEN_STRIPPING
    tok = processor.tokenizer
    args = cfg(tmp_path, per_device_train_batch_size=4, num_generations=2, max_completion_length=200)
    rows = image_rows(2, with_images={0})
    trainer = GRPOTrainer(model, length_reward, args, rows, processing_class=processor, tools=[picture])
    assert trainer.parts.rollouts.loop.rendered  # turn_context="auto": the template strips earlier reasoning
    trainer.engine = CallFirst(trainer.engine, tok)
    call = '<think>first I look</think><tool_call>{"name": "picture", "arguments": {"name": "x"}}</tool_call>'
    trainer.engine.call = tok(call)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    rollout = generate(trainer, [0, 0, 1, 1]).rollout
    follow_ups = trainer.engine.follow_ups[0]
    assert "first I look" not in tok.decode(list(follow_ups[0].prompt.ids))
    assert [len(r.prompt.images) for r in follow_ups] == [2, 2, 1, 1]
    image_token = trainer.unwrapped_model.config.image_token_id
    shown = Pixels.of(processor, model).layout(picture("x")[0]["image"]).tokens
    for i, turns in enumerate(rollout.turns):
        assert turns is not None and len(turns) == 2  # the reasoning is not in the second turn's context
        (_, end, first_context), (start, _, second_context) = turns
        assert end == start == len(trainer.engine.call)  # the tool's turn is in the rendered history, not appended
        assert list(second_context) == list(follow_ups[i].prompt.ids)
        held = second_context.count(image_token) - first_context.count(image_token)
        assert held == shown  # the tool's picture, expanded in the history
    assert [len(p.images) for p in rollout.vision] == [2, 2, 1, 1]
    batch = collate(rollout, torch.zeros(4), tok.pad_token_id, False)
    sampled = batch.mask.bool() & (batch.sampling_logps != 0)  # the second turns (the first is scripted)
    assert sampled.sum(-1).min() > 0
    for packing in ("tree", "padded"):
        trainer.training_pass.layouts = ("padded", "forked", "trees") if packing == "tree" else ("padded", "forked")
        trainer.training_pass.laid_out.clear()
        logps = trainer.training_pass.logps(trainer.model, batch, 2)
        assert trainer.training_pass.laid_out == ({"trees": 2} if packing == "tree" else {"forked": 2})
        torch.testing.assert_close(logps[sampled], batch.sampling_logps[sampled], rtol=1e-5, atol=1e-6)


def test_a_rendered_history_that_drops_an_image_is_refused(tmp_path):
    """A template that does not render a tool's image: the rendered history would not hold what the turn saw, so
    the tool loop stops with the cause and the fix."""
    model, processor = BUILDERS["qwen2.5-vl"](0)
    blind = QWEN_STRIPPING.replace(
        "{% if c['type'] == 'image' %}", "{% if c['type'] == 'image' and message['role'] != 'tool' %}"
    )
    assert blind != QWEN_STRIPPING
    processor.chat_template = processor.tokenizer.chat_template = blind
    tok = processor.tokenizer
    args = cfg(tmp_path, per_device_train_batch_size=4, num_generations=2, max_completion_length=200)
    trainer = GRPOTrainer(model, length_reward, args, image_rows(2), processing_class=processor, tools=[picture])
    trainer.engine = CallFirst(trainer.engine, tok)
    call = '<think>first I look</think><tool_call>{"name": "picture", "arguments": {"name": "x"}}</tool_call>'
    trainer.engine.call = tok(call)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    with pytest.raises(
        ValueError, match=r"rendered 1 image\(s\) of a conversation holding 2 .* turn_context='appended'"
    ):
        generate(trainer, [0, 0, 1, 1])


@pytest.mark.parametrize("arch", ["qwen2.5-vl", "idefics3"])
def test_a_template_that_renders_no_image_is_one_clear_error(arch, tmp_path):
    """An image prompt whose chat template writes no image placeholder (a text-only template on a vision-language
    model): one error naming the row and the fix, before anything is sampled without the image."""
    trainer = trainer_for(arch, tmp_path, image_rows(2, with_images={1}))
    trainer.processing_class.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}{% if c['type'] == 'text' %}"
        "{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    )
    with pytest.raises(
        ValueError, match=r"rendered 0 image\(s\) of a conversation holding 1 \(train_dataset row 1\)\. Use a chat"
    ):
        generate(trainer, [0, 0, 1, 1])


def test_a_tools_image_reaches_the_next_turn_and_the_training_pass(tmp_path):
    """A tool returns an image: the next turn is sampled seeing it (after the prompt's, or alone on a text-only
    row), and the training pass scores that turn alike, with the image; another image changes its log-probs."""
    rows = image_rows(2, with_images={0})
    trainer = picture_trainer(tmp_path, rows)
    rollout = generate(trainer, [0, 0, 1, 1]).rollout
    shown = picture("x")[0]["image"]
    follow_ups = trainer.engine.follow_ups[0]
    assert [len(r.prompt.images) for r in follow_ups] == [2, 2, 1, 1]
    assert follow_ups[0].prompt.images[1].tobytes() == shown.tobytes()
    image_token = trainer.unwrapped_model.config.image_token_id
    assert all(image_token in ids for ids in rollout.completion_ids)  # the tool's image tokens, in the completion
    assert [len(p.images) for p in rollout.vision] == [2, 2, 1, 1]
    batch = collate(rollout, torch.zeros(4), trainer.parts.tokenizer.pad_token_id, False)
    sampled = batch.mask.bool() & (batch.sampling_logps != 0)
    assert sampled[:, :].sum(-1).min() > 0
    logps = trainer.training_pass.logps(trainer.model, batch, 2)
    torch.testing.assert_close(logps[sampled], batch.sampling_logps[sampled], rtol=1e-5, atol=1e-6)
    other = [dataclasses.replace(p, images=(*p.images[:-1], image(50, *shown.size))) for p in batch.vision]
    changed = trainer.training_pass.logps(trainer.model, dataclasses.replace(batch, vision=other), 2)
    assert (changed[sampled] - logps[sampled]).abs().max() > 1e-5  # 10x the agreement asserted above


def test_a_tools_image_for_a_text_only_model_is_refused(tmp_path):
    tok = make_tokenizer()
    tok.chat_template = CHATML_TOOLS
    args = cfg(tmp_path, per_device_train_batch_size=4, num_generations=2, max_completion_length=200)
    rows = [{"prompt": [{"role": "user", "content": f"Show {i}"}]} for i in range(2)]
    trainer = GRPOTrainer(
        make_model(tok, context=4096), length_reward, args, rows, processing_class=tok, tools=[picture]
    )
    trainer.engine = CallFirst(trainer.engine, tok)
    trainer.engine.call = tok('<tool_call>{"name": "picture", "arguments": {"name": "x"}}</tool_call>')["input_ids"]
    trainer.engine.call += [tok.convert_tokens_to_ids("<|im_end|>")]
    with pytest.raises(ValueError, match="The tool 'picture' returned an image, but the model is text-only"):
        generate(trainer, [0, 0, 1, 1])


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_two_processes_with_images_on_one_only(arch, tmp_path):
    """DDP with the vision tower unused on one process: both end with the same, changed, parameters."""
    torchrun(2, job_script("vision_job.py"), tmp_path, arch, timeout=600)
    first, second = (torch.load(tmp_path / f"params_{rank}.pt") for rank in (0, 1))
    assert first["rows"] == [0, 0, 1, 1] and second["rows"] == [2, 2, 3, 3]
    initial = dict(MODELS[arch](0)[0].named_parameters())
    for name, value in first["params"].items():
        assert torch.equal(value, second["params"][name]), name
    moved = [n for n, v in first["params"].items() if not torch.equal(v, initial[n].detach())]
    assert any("vision" in n or "visual" in n for n in moved) and len(moved) > len(initial) // 2


def test_a_vision_model_loads_from_its_directory_with_its_processor(tmp_path):
    model, processor = BUILDERS["idefics3"](0)
    model.save_pretrained(tmp_path / "idefics3")
    processor.save_pretrained(tmp_path / "idefics3")
    trainer = GRPOTrainer(str(tmp_path / "idefics3"), length_reward, cfg(tmp_path, max_steps=1), image_rows())
    assert type(trainer.unwrapped_model).__name__ == "Idefics3ForConditionalGeneration"
    assert type(trainer.processing_class).__name__ == "Idefics3Processor" and trainer.parts.pixels is not None
    trainer.train()


def test_a_processor_that_needs_torchvision_is_one_clear_error(tmp_path):
    """transformers cannot build a Qwen2.5-VL or Qwen3-VL processor without torchvision (their video processors need
    it), nor import Gemma 4's (its image processor's module imports torchvision): each is one error naming the cause
    and the fix."""
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the processor builds")
    for arch, processor_class in (("qwen2.5-vl", "Qwen2_5_VLProcessor"), ("qwen3-vl", "Qwen3VLProcessor")):
        model, processor = BUILDERS[arch](0)
        model.save_pretrained(tmp_path / arch)
        processor.save_pretrained(tmp_path / arch)
        saved = json.loads((tmp_path / arch / "processor_config.json").read_text())  # as a hub checkpoint names it
        (tmp_path / arch / "processor_config.json").write_text(json.dumps(dict(saved, processor_class=processor_class)))
        with pytest.raises(OSError, match="is a vision-language model, but its processor needs torchvision"):
            GRPOTrainer(str(tmp_path / arch), length_reward, cfg(tmp_path), image_rows())
    try:  # transformers 5.19's module imports torchvision at once; later releases import it when used
        importlib.import_module("transformers.models.gemma4.processing_gemma4")
        return
    except ImportError:
        pass
    model, processor = BUILDERS["gemma4"](0)
    model.save_pretrained(tmp_path / "gemma4")
    processor.tokenizer.save_pretrained(tmp_path / "gemma4")
    (tmp_path / "gemma4" / "processor_config.json").write_text('{"processor_class": "Gemma4Processor"}')
    with pytest.raises(OSError, match="is a vision-language model, but its processor needs torchvision"):
        GRPOTrainer(str(tmp_path / "gemma4"), length_reward, cfg(tmp_path), image_rows())


def test_a_prefix_lm_vision_model_is_refused_before_training():
    """PaliGemma's token_type_ids mark its prompt (a prefix attended both ways) and its completion, not its image
    tokens, which grpo marks: one error names why, before anything runs (`Pixels.of`, which the trainer builds)."""
    from transformers import PaliGemmaForConditionalGeneration

    model, processor = BUILDERS["gemma3"](0)
    paligemma = object.__new__(PaliGemmaForConditionalGeneration)
    object.__setattr__(paligemma, "config", SimpleNamespace(model_type="paligemma", image_token_id=5))
    with pytest.raises(ValueError, match="does not train PaliGemmaForConditionalGeneration on images.*prefix-LM"):
        Pixels.of(processor, paligemma)
    assert Pixels.of(processor, model) is not None  # Gemma 3's token_type_ids mark its image tokens


def test_a_frozen_vision_tower_stays_as_it_was(tmp_path):
    """Full fine-tuning trains the vision tower too (as TRL); `requires_grad_(False)` on it keeps it."""
    model, processor = BUILDERS["idefics3"](0)
    model.model.vision_model.requires_grad_(False)
    before = params(model)
    args = cfg(tmp_path, per_device_train_batch_size=4, num_generations=4, max_steps=2)
    trainer = GRPOTrainer(model, length_reward, args, image_rows(), processing_class=processor)
    trainer.train()
    for name, p in trainer.unwrapped_model.named_parameters():
        assert torch.equal(p.detach(), before[name]) == ("vision_model" in name), name


def test_only_recent_image_prompts_stay_decoded(tmp_path, monkeypatch):
    """Decoded images are large: the prompt source keeps the latest IMAGE_PROMPTS_KEPT image prompts; one read
    again is equal to the first (the same ids, text and pixels)."""
    monkeypatch.setattr(data, "IMAGE_PROMPTS_KEPT", 2)
    trainer = trainer_for("qwen2.5-vl", tmp_path)
    first = [trainer.parts.prompts[row] for row in range(4)]
    assert len(trainer.parts.prompts._image_cache) == 2
    again = trainer.parts.prompts[0]
    assert again is not first[0] and again == first[0] and again.text == first[0].text
