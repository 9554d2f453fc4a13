"""Trainers on the tiny vision-language models (support.vision): conversational rows with images, a trainer of each
architecture, and tools that show pictures (grpo's tool template with Qwen2.5-VL's image blocks, an engine whose
first turn calls the tool)."""

from __future__ import annotations

from grpo import GRPOConfig, GRPOTrainer
from grpo.agent import CHATML_TOOLS
from grpo.rollout.base import assemble
from support.rewards import length_reward
from support.runs import cfg
from support.vision import BUILDERS, MODELS, image

# grpo's tool template, with a user turn's image blocks written as Qwen2.5-VL writes them
QWEN_TOOLS = CHATML_TOOLS.replace(
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>",
    "{% else %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|>"
    "<|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>",
)


def image_rows(n=4, with_images=None, sizes=True):
    """Conversational rows, each with its own image (of its own size with `sizes`); rows not in `with_images`
    (None: all) have none."""
    rows = []
    for i in range(n):
        has = with_images is None or i in with_images
        size = (24 + 10 * i, 28 + 6 * (i % 3)) if sizes else (40, 32)
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"What is in picture {i}?"}],
                "image": image(i, *size) if has else None,
            }
        )
    return rows


def trainer_for(arch, tmp_path, rows=None, seed=0, peft_config=None, **kw):
    model, processor = MODELS[arch](seed)
    args = cfg(tmp_path, per_device_train_batch_size=4, num_generations=4, **kw)
    return GRPOTrainer(
        model=model,
        processing_class=processor,
        reward_funcs=length_reward,
        train_dataset=rows or image_rows(),
        args=args,
        peft_config=peft_config,
    )


def build(tmp_path, rows, arch="qwen2.5-vl"):
    model, processor = BUILDERS[arch](0)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4)
    return GRPOTrainer(
        model=model, processing_class=processor, reward_funcs=length_reward, train_dataset=rows, args=args
    )


class CallFirst:
    """The first turn of every row is a scripted tool call; every later turn is sampled by `engine` (the real one,
    which needs the row's image on every turn)."""

    name = "call-first"

    def __init__(self, engine, tokenizer):
        self.engine, self.tok = engine, tokenizer
        self.call = tokenizer('<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>')["input_ids"]
        self.call += [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        self.follow_ups = []

    def sync_weights(self, model):
        self.engine.sync_weights(model)

    def generate(self, requests):
        if any("<|im_start|>tool" in self.tok.decode(list(r.prompt.ids)) for r in requests):
            self.follow_ups.append(list(requests))
            return self.engine.generate(requests)
        rows = [r for r in requests for _ in range(r.num_samples)]
        ids = [list(self.call) for _ in rows]
        return assemble(rows, ids, [[0.0] * len(c) for c in ids], {self.call[-1]}, self.tok)


def picture(name: str) -> list:
    """Show a picture.

    Args:
        name: Which picture.
    """
    return [{"type": "image", "image": image(len(name), 28 + 8 * len(name), 30)}, {"type": "text", "text": name}]


def picture_trainer(tmp_path, rows, name="x"):
    model, processor = BUILDERS["qwen2.5-vl"](0)
    processor.chat_template = processor.tokenizer.chat_template = QWEN_TOOLS
    args = cfg(tmp_path, per_device_train_batch_size=4, num_generations=2, max_completion_length=200)
    trainer = GRPOTrainer(model, length_reward, args, rows, processing_class=processor, tools=[picture])
    trainer.engine = CallFirst(trainer.engine, trainer.parts.tokenizer)
    call = f'<tool_call>{{"name": "picture", "arguments": {{"name": "{name}"}}}}</tool_call>'
    trainer.engine.call = trainer.parts.tokenizer(call)["input_ids"] + [
        trainer.parts.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ]
    return trainer


# QWEN_TOOLS with every assistant turn rendered without its reasoning block (support.agent.STRIPPING)
QWEN_STRIPPING = QWEN_TOOLS.replace(
    "<|im_start|>assistant\n{{ message['content'] or '' }}",
    "<|im_start|>assistant\n{{ (message['content'] or '').split('</think>')[-1] | trim }}",
)
