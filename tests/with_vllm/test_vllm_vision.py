"""Image prompts through vLLM on this CPU (issue 20), colocate and server mode, on the tiny Idefics3 (SmolVLM's
architecture; its language model 128 wide, whose heads vLLM's CPU attention supports). vLLM gets the template's token
ids and the images and expands them itself; the sampled tokens' log-probs it returns match the training pass's, which
sees the images (tests/integration/test_vision.py: those change when an image does), so vLLM saw them too."""

from __future__ import annotations

import pytest
import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.agent import CHATML_TOOLS
from grpo.learner.batch import collate
from grpo.models.vision import language_model
from support.rewards import length_reward
from support.runs import generate, params
from support.served import Server
from support.vision import idefics3, image
from support.vision_runs import CallFirst, image_rows, picture

ROWS = [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-vlm") / "idefics3-h128"
    model, processor = idefics3(0, hidden=128)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def dataset():
    """Rows with one image, none, two (of different sizes), one."""
    rows = image_rows(4, with_images={0, 2, 3})
    images = [[rows[0]["image"]], [], [rows[2]["image"], image(7, 50, 20)], [rows[3]["image"]]]
    return [{"prompt": r["prompt"], "images": i} for r, i in zip(rows, images)]


def trainer(vlm_dir, tmp_path, **kw):
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=2,
        max_completion_length=8,
        learning_rate=1e-2,
        bf16=False,
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        use_vllm=True,
        **kw,
    )
    return GRPOTrainer(model=vlm_dir, reward_funcs=length_reward, train_dataset=dataset(), args=args)


def assert_engine_matches_training_pass(t):
    t.engine.sync_weights(t.unwrapped_model)
    generated = generate(t, ROWS)
    assert [bool(p.images) for p in generated.rollout.vision] == [True, True, False, False, True, True, True, True]
    batch = collate(generated.rollout, torch.zeros(len(ROWS)), t.parts.tokenizer.pad_token_id, False)
    mask = batch.completion_attention.bool()
    logps = t.training_pass.logps(t.model, batch, 4)
    assert (logps[mask] - batch.sampling_logps[mask]).abs().max() < 1e-4


def test_colocate_vllm_samples_image_prompts_and_trains(vlm_dir, tmp_path):
    t = trainer(vlm_dir, tmp_path, max_steps=2)
    language = {id(p) for p in language_model(t.unwrapped_model).parameters()}
    before = params(t.unwrapped_model)
    t.train()
    unchanged = [n for n, p in t.unwrapped_model.named_parameters() if id(p) in language and torch.equal(p, before[n])]
    assert not unchanged
    assert t.state.log_history[-1]["sampling/sampling_logp_difference/max"] < 1e-4
    assert_engine_matches_training_pass(t)  # after the updates: the synced weights, with the images


def test_server_mode_sends_the_images(vlm_dir, tmp_path):
    """Image prompts on vLLM's own server (its token-in route, with the images, which it expands itself; the
    expansion checked against the processor's): the sampled tokens' log-probs are the training pass's, which sees
    the images."""
    server = Server(vlm_dir)
    try:
        t = trainer(vlm_dir, tmp_path, max_steps=1, vllm_mode="server", vllm_server_port=server.port)
        routes = []
        client = t.engine.servers[0]
        original = client.while_alive

        def recorded(method, path, body=None, **options):
            routes.append(path)
            return original(method, path, body, **options)

        client.while_alive = recorded
        t.train()
        assert t.state.log_history[-1]["sampling/sampling_logp_difference/max"] < 1e-4
        assert_engine_matches_training_pass(t)
        assert "/inference/v1/generate" in routes and "/v1/completions" in routes  # the row without an image
    finally:
        server.kill()


# grpo's tool template, with image blocks written as Idefics3 writes them
IDEFICS_TOOLS = CHATML_TOOLS.replace(
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>",
    "{% else %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>",
)


# IDEFICS_TOOLS with every assistant turn rendered without its reasoning block (support.agent.STRIPPING)
IDEFICS_STRIPPING = IDEFICS_TOOLS.replace(
    "<|im_start|>assistant\n{{ message['content'] or '' }}",
    "<|im_start|>assistant\n{{ (message['content'] or '').split('</think>')[-1] | trim }}",
)


@pytest.mark.parametrize("turn_context", ["appended", "rendered"])
def test_a_tools_image_reaches_vllms_next_turn(tmp_path, turn_context):
    """A tool returns an image: vLLM samples the next turn with it (given the turn's tokens with one placeholder per
    image), and the training pass, which sees the same images, agrees on that turn's log-probs. With rendered turns
    (a template that strips the first turn's reasoning) the next turn follows the rendered history, pictures
    included, and the training pass scores it there."""
    model, processor = idefics3(0, hidden=128)
    rendered = turn_context == "rendered"
    processor.chat_template = processor.tokenizer.chat_template = IDEFICS_STRIPPING if rendered else IDEFICS_TOOLS
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=200,
        bf16=False,
        use_vllm=True,
        turn_context=turn_context,
    )
    rows = image_rows(2, with_images={0})
    trainer = GRPOTrainer(model, length_reward, args, rows, processing_class=processor, tools=[picture])
    trainer.engine = CallFirst(trainer.engine, trainer.parts.tokenizer)
    think = "<think>first I look</think>" if rendered else ""  # appended, it would leave no room for the picture
    call = think + '<tool_call>{"name": "picture", "arguments": {"name": "x"}}</tool_call>'
    trainer.engine.call = trainer.parts.tokenizer(call)["input_ids"] + [
        trainer.parts.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ]
    trainer.engine.sync_weights(trainer.unwrapped_model)
    rollout = generate(trainer, [0, 0, 1, 1]).rollout
    assert [len(p.images) for p in rollout.vision] == [2, 2, 1, 1]
    assert all((turns is not None) == rendered for turns in rollout.turns)
    batch = collate(rollout, torch.zeros(4), trainer.parts.tokenizer.pad_token_id, False)
    sampled = batch.mask.bool() & (batch.sampling_logps != 0)  # vLLM's turn (the script's log-probs are 0)
    assert sampled.sum(-1).min() > 0
    for packing in ("tree", "padded"):
        trainer.training_pass.layouts = ("padded", "forked", "trees") if packing == "tree" else ("padded", "forked")
        logps = trainer.training_pass.logps(trainer.model, batch, 2)
        assert (logps[sampled] - batch.sampling_logps[sampled]).abs().max() < 1e-4
