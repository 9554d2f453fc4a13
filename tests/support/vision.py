"""Tiny vision-language models built locally (no hub), random weights: a Qwen2.5-VL, a Qwen3-VL, an Idefics3
(SmolVLM's architecture), a LLaVA, a Gemma 3 (its image tokens attend each other both ways) and a Gemma 4 (both ways
in its sliding layers only), each with a processor made from the tiny character tokenizer plus the model's image
tokens, a chat template that writes image blocks, and the model's PIL image processor (torchvision is not installed
here).

The Qwen2.5-VL and Qwen3-VL processors are transformers' own with their video half left out: transformers 5.19
cannot build a Qwen-VL processor without torchvision (its video processor needs it), and grpo trains on images
only. Gemma 4's processor module cannot even be imported without torchvision, so `Gemma4Images` stands in for its
image half: the same placeholder expansion (begin-of-image, one image token per soft token, end-of-image) and
`mm_token_type_ids`, on transformers' `ProcessorMixin` with Gemma 4's PIL image processor."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from transformers import (
    CLIPImageProcessorPil,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessorPil,
    Gemma3Processor,
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4ImageProcessorPil,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    ProcessorMixin,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessorPil,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
)
from transformers.processing_utils import ProcessingKwargs

from grpo.base.records import Prompt, Rollout
from grpo.learner.batch import collate
from support.tiny import make_tokenizer

_BLOCKS = (
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}IMAGE{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
)
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    + _BLOCKS.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>")
    + "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IDEFICS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] | capitalize }}:"
    + _BLOCKS.replace("IMAGE", "<image>")
    + "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
LLAVA_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    + _BLOCKS.replace("IMAGE", "<image>")
    + "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    + _BLOCKS.replace("IMAGE", "<start_of_image>")
    + "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class QwenImageProcessor(Qwen2_5_VLProcessor):
    """Qwen2.5-VL's processor for images only (see the module docstring)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


class Qwen3Images(Qwen3VLProcessor):
    """Qwen3-VL's processor for images only (see the module docstring)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.vision_start_token, self.vision_end_token = "<|vision_start|>", "<|vision_end|>"
        self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id = (
            tokenizer.convert_tokens_to_ids(
                [self.image_token, self.video_token, self.vision_start_token, self.vision_end_token]
            )
        )
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


class _Gemma4Kwargs(ProcessingKwargs, total=False):
    _defaults = {"text_kwargs": {"padding": True, "return_mm_token_type_ids": True}}  # as Gemma 4's processor


class Gemma4Images(ProcessorMixin):
    """Gemma 4's processor for images only (see the module docstring): each image placeholder becomes
    begin-of-image, as many image tokens as the image processor pools the image into, end-of-image."""

    valid_processor_kwargs = _Gemma4Kwargs

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.boi_token, self.image_token, self.eoi_token = "<|image>", "<|image|>", "<image|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        super().__init__(image_processor, tokenizer, chat_template=chat_template)

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs) -> str:
        tokens = image_inputs["num_soft_tokens_per_image"][image_idx]
        return f"{self.boi_token}{self.image_token * tokens}{self.eoi_token}"

    @property
    def unused_input_names(self) -> list[str]:
        return ["num_soft_tokens_per_image"]


def _tokenizer(extra: list[str]):
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *extra]})
    return tok


def _language(tok, hidden: int, layers: int, **extra) -> dict:
    """A language model's config fields: `layers` layers of width `hidden`, 4 query heads over 2 key-value heads."""
    return dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        **extra,
    )


def qwen_vl(seed: int = 0, hidden: int = 32, layers: int = 2, side: int = 56):
    """(model, processor) of a 2-layer Qwen2.5-VL with a 2-block vision tower: images of up to 56x56 pixels.
    `hidden`, `layers` and `side`: the widths of both towers, their depths and the images' largest side (a bench's
    larger model: bench/tree_images.py)."""
    tok = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=side * side, patch_size=14, merge_size=2)
    processor = QwenImageProcessor(image_processor=images, tokenizer=tok, chat_template=QWEN_TEMPLATE)
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    k = hidden // 32  # the rotary sections (time, height, width) fill half of a head (hidden / 4 heads)
    text = _language(
        tok,
        hidden,
        layers,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "mrope_section": [k, k, 2 * k], "rope_theta": 10000.0},
        **ids,
    )
    vision = dict(
        depth=layers,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_heads=4,
        out_hidden_size=hidden,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        fullatt_block_indexes=[1],
        window_size=56,
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=processor.image_token_id,
        video_token_id=processor.video_token_id,
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        tie_word_embeddings=False,
        **ids,
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config), processor


def qwen3_vl(seed: int = 0, hidden: int = 32, layers: int = 2, side: int = 96):
    """(model, processor) of a 2-layer Qwen3-VL with a 2-block vision tower of 16-pixel patches: images resized to
    between 2048 pixels and 96x96 (4 to 9 image tokens, in a grid of the image's shape), the first block's features
    also added to the first language layer's image tokens (DeepStack), multimodal RoPE with interleaved sections.
    `hidden`, `layers` and `side`: as `qwen_vl`'s."""
    tok = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    images = Qwen2VLImageProcessorPil(min_pixels=2 * 32 * 32, max_pixels=side * side, patch_size=16, merge_size=2)
    processor = Qwen3Images(image_processor=images, tokenizer=tok, chat_template=QWEN_TEMPLATE)
    # the rotary sections (time, height, width) fill half of a head (hidden / 4 heads)
    text = _language(tok, hidden, layers, head_dim=hidden // 4, **_interleaved_rope(hidden // 32))
    return _qwen3_family(Qwen3VLConfig, Qwen3VLForConditionalGeneration, seed, processor, text, hidden, layers)


def qwen3_5(seed: int = 0, hidden: int = 32, side: int = 96):
    """(model, processor) of a 2-layer Qwen3.5 (a gated delta-rule linear-attention layer, recurrent, then a gated
    full-attention one with partial rotary embeddings) with Qwen3-VL's processor and a 2-block vision tower as
    `qwen3_vl`'s: its image rows keep padded rows (trees refuse recurrent layers). `hidden` and `side`: as
    `qwen3_vl`'s."""
    _, processor = qwen3_vl(seed, hidden, 2, side)
    text = _language(
        processor.tokenizer,
        hidden,
        2,
        head_dim=hidden,  # heads of `hidden`, a quarter of each rotated: the rotary half is hidden / 8 wide
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=hidden // 8,
        linear_value_head_dim=hidden // 8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        **_interleaved_rope(hidden // 32, partial_rotary_factor=0.25),
    )
    return _qwen3_family(Qwen3_5Config, Qwen3_5ForConditionalGeneration, seed, processor, text, hidden, 2)


def _interleaved_rope(k: int, **extra) -> dict:
    """Qwen3-VL's multimodal RoPE fields: interleaved sections of 2k (time), k (height) and k (width) frequencies."""
    rope = {"rope_type": "default", "mrope_section": [2 * k, k, k], "mrope_interleaved": True, "rope_theta": 1e4}
    return dict(max_position_embeddings=2048, rope_parameters={**rope, **extra})


def _qwen3_family(config_class, model_class, seed: int, processor, text: dict, hidden: int, depth: int):
    """(model, processor): a Qwen3-VL-family model with the language model `text` and a vision tower of `depth`
    blocks of width `hidden`, 16-pixel patches merged 2x2 (DeepStack from its first block, where the config has it)."""
    tok = processor.tokenizer
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    vision = dict(
        depth=depth,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_heads=4,
        out_hidden_size=hidden,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0],
    )
    config = config_class(
        text_config=dict(text, **ids),
        vision_config=vision,
        image_token_id=processor.image_token_id,
        video_token_id=processor.video_token_id,
        vision_start_token_id=processor.vision_start_token_id,
        vision_end_token_id=processor.vision_end_token_id,
        tie_word_embeddings=False,
        **ids,
    )
    torch.manual_seed(seed)
    return model_class(config), processor


def idefics3(seed: int = 0, hidden: int = 32):
    """(model, processor) of a 2-layer Idefics3 (SmolVLM): images split into 32x32 tiles plus a global view.
    `hidden`: the language model's width (4 heads; vLLM's CPU attention needs heads of 32: hidden=128)."""
    tok = _tokenizer(["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"])
    images = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    processor = Idefics3Processor(
        image_processor=images, tokenizer=tok, chat_template=IDEFICS_TEMPLATE, image_seq_len=4
    )
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    text = _language(tok, hidden, 2, model_type="llama", max_position_embeddings=1024, tie_word_embeddings=False, **ids)
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
    config = Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
        vocab_size=len(tok),
        **ids,
    )
    torch.manual_seed(seed)
    return Idefics3ForConditionalGeneration(config), processor


def llava(seed: int = 0, hidden: int = 32, layers: int = 2, side: int = 28):
    """(model, processor) of a 2-layer LLaVA (a Llama language model) with a 2-layer CLIP vision tower: images
    resized and cropped to 28x28, in patches of 7 pixels: 16 image tokens each (the class token dropped), no tokens
    around them, positions as text."""
    tok = _tokenizer(["<image>"])
    images = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=7,
        vision_feature_select_strategy="default",
        chat_template=LLAVA_TEMPLATE,
        image_token="<image>",
        num_additional_image_tokens=1,
    )
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    text = dict(model_type="llama", **_language(tok, hidden, layers, max_position_embeddings=1024, **ids))
    vision = dict(
        model_type="clip_vision_model",
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        image_size=side,
        patch_size=7,
        projection_dim=hidden,
    )
    config = LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=processor.image_token_id,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
        **ids,
    )
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(config), processor


def gemma3(seed: int = 0, hidden: int = 32, layers: int = 2, side: int = 28, tokens: int = 4):
    """(model, processor) of a 2-layer Gemma 3 (a sliding-window layer and a global one) with a 2-layer SigLIP:
    images resized to 28x28, 4 image tokens each, which attend each other both ways (`token_type_ids`). `hidden`,
    `layers`, `side` and `tokens`: the widths of both towers, their depths (sliding and global layers alternate),
    the side images are resized to (in patches of 7 pixels, 14 from 56 on) and the image tokens each image is
    pooled into (a square number: bench/tree_images.py's larger model)."""
    tok = _tokenizer(["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    # Gemma's tokenizer names its image tokens; the processor reads them from it
    tok.boi_token, tok.eoi_token, tok.image_token = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
    tok.boi_token_id, tok.image_token_id = tok.convert_tokens_to_ids([tok.boi_token, tok.image_token])
    images = Gemma3ImageProcessorPil(size={"height": side, "width": side})
    processor = Gemma3Processor(
        image_processor=images, tokenizer=tok, chat_template=GEMMA_TEMPLATE, image_seq_length=tokens
    )
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    text = _language(
        tok,
        hidden,
        layers,
        head_dim=hidden // 4,
        max_position_embeddings=1024,
        sliding_window=512,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
        **ids,
    )
    patch = 7 if side < 56 else 14
    vision = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        image_size=side,
        patch_size=patch,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=tokens,
        image_token_id=tok.image_token_id,
        boi_token_id=tok.boi_token_id,
        eoi_token_id=tok.convert_tokens_to_ids(tok.eoi_token),
        tie_word_embeddings=False,
        **ids,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # transformers starts the projection from the vision tower at zero: no image would matter
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.1)
    return model, processor


def gemma4(seed: int = 0, hidden: int = 32, layers: int = 3, bidirectional: str | None = "vision", patch: int = 2):
    """(model, processor) of a 3-layer Gemma 4 (global, sliding-window, global: a global layer that later layers read,
    so where image tokens attend each other both ways shows; per-layer inputs) with a 3-layer vision tower of
    2x2-pixel patches pooled 3x3: each image resized to about 70 image tokens (64 for a square), which attend each
    other both ways in the sliding layers only (`bidirectional`: the language model's `use_bidirectional_attention`,
    "vision" as in the larger Gemma 4 models; None as in the smaller ones: causal). `hidden` and `layers`: the
    widths of both towers and their depths (global and sliding layers alternate; the last is global); `patch`: the
    patches' side (an image is resized to about 630 patches whatever its size: 16, Gemma 4's, for 384x384)."""
    tok = _tokenizer(["<|image>", "<|image|>", "<image|>", "<|video|>"])
    images = Gemma4ImageProcessorPil(patch_size=patch, max_soft_tokens=70, pooling_kernel_size=3)
    processor = Gemma4Images(
        image_processor=images, tokenizer=tok, chat_template=GEMMA_TEMPLATE.replace("<start_of_image>", "<|image|>")
    )
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    text = _language(
        tok,
        hidden,
        layers,
        head_dim=hidden // 4,
        global_head_dim=hidden // 2,  # the global layers' heads are wider, as Gemma 4's
        max_position_embeddings=1024,
        sliding_window=512,
        layer_types=[("full_attention", "sliding_attention")[i % 2] for i in range(layers - 1)] + ["full_attention"],
        use_bidirectional_attention=bidirectional,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=len(tok),
        **ids,
    )
    vision = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=hidden // 4,
        patch_size=patch,
        pooling_kernel_size=3,
        position_embedding_size=64,
    )
    config = Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        image_token_id=processor.image_token_id,
        boi_token_id=tok.convert_tokens_to_ids(processor.boi_token),
        eoi_token_id=tok.convert_tokens_to_ids(processor.eoi_token),
        video_token_id=tok.convert_tokens_to_ids("<|video|>"),
        tie_word_embeddings=False,
        **ids,
    )
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config)
    with torch.no_grad():  # at transformers' scales random images pool into nearly equal features: none would matter
        model.model.vision_tower.patch_embedder.input_proj.weight.normal_(0.0, 0.3)
        model.model.embed_vision.embedding_projection.weight.normal_(0.0, 0.1)
    return model, processor


BUILDERS = {
    "qwen2.5-vl": qwen_vl,
    "qwen3-vl": qwen3_vl,
    "idefics3": idefics3,
    "llava": llava,
    "gemma3": gemma3,
    "gemma4": gemma4,
}
# architectures whose image rows keep padded rows (trees refuse their recurrent layers): test_vision's tests run them
# beside BUILDERS; the tree tests run BUILDERS only
PADDED_ONLY = {"qwen3.5": qwen3_5}
MODELS = {**BUILDERS, **PADDED_ONLY}


def image(seed: int, width: int = 40, height: int = 32) -> Image.Image:
    """A random RGB image."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def image_batch(processor, prompts=2, group=4, side=56, lengths=(4, 24), text_only=1, seed=0):
    """A training batch without sampling: `prompts` chat prompts, each with a `side` x `side` image but the last
    `text_only` (text-only rows among image rows), each followed by `group` completions of random letters
    (`lengths`: their range); the rows of a prompt are a group. For the equivalence tests on any device and
    bench/tree_images.py."""
    tok = processor.tokenizer
    rng = np.random.default_rng(seed)
    letters = tok("abcdefghijklmnopqrstuvwxyz ")["input_ids"]
    prompt_ids, completions, vision, groups = [], [], [], []
    for p in range(prompts):
        pictures = [image(seed + p, side, side)] if p < prompts - text_only else []
        content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": f"What is in picture {p}?"}]
        messages = [{"role": "user", "content": content}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = processor(text=[text], images=[pictures] if pictures else None, add_special_tokens=False)["input_ids"][0]
        prompt = Prompt(ids=tuple(ids), images=tuple(pictures) or None, text=text)
        for _ in range(group):
            prompt_ids.append(list(ids))
            completions.append([int(rng.choice(letters)) for _ in range(int(rng.integers(*lengths)))])
            vision.append(prompt)
            groups.append(p)
    advantages = torch.from_numpy(rng.standard_normal(len(completions))).float()
    return collated(tok, prompt_ids, completions, vision, groups, advantages=advantages)


def collated(tok, prompt_ids, completions, vision, group=None, turns=None, advantages=None):
    """A training batch of these rows (sampling log-probs 0; `advantages` 0 unless given), in groups `group` (None:
    each row its own), with `turns` (None: none)."""
    rollout = Rollout(
        prompt_ids=prompt_ids,
        completion_ids=completions,
        sampling_logps=[[0.0] * len(c) for c in completions],
        truncated=[False] * len(completions),
        vision=vision,
        turns=turns or [],
    )
    advantages = torch.zeros(len(completions)) if advantages is None else advantages
    group = torch.tensor(group) if group is not None else None
    return collate(rollout, advantages, tok.pad_token_id, False, group=group)


def tokens_of(processor, pieces):
    """The tokens of `pieces`: text as the tokenizer reads it, a picture as the processor expands it."""
    out = []
    for piece in pieces:
        if isinstance(piece, str):
            out += processor.tokenizer(piece, add_special_tokens=False)["input_ids"]
        else:
            out += list(
                processor(text=[processor.image_token], images=[[piece]], add_special_tokens=False)["input_ids"][0]
            )
    return out


def look_prompts(processor, shown):
    """Two chat prompts: one with picture `shown`, one text-only: (ids, pictures, rendered text) each."""
    prompts = []
    for p, pictures in enumerate([[shown], []]):
        content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": f"Look {p}"}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        ids = processor(text=[text], images=[pictures] if pictures else None, add_special_tokens=False)["input_ids"]
        prompts.append((list(ids[0]), pictures, text))
    return prompts


def completion_pictures_batch(processor, side=28):
    """Rows whose completions hold a picture (as a tool's image sits there: the row's images are its prompt's and
    then the picture). Group 0 has a prompt image; its rows' completions: "ab", picture A, "cd"; "ab", A, "ef"
    (A shared); "ab", another picture of A's size (the same token ids), "cd"; "ab", "xyz". Group 1, a text prompt:
    "q", A, "r"; "q", "s"."""
    tok = processor.tokenizer
    shown, first, other = image(1, side, side), image(2, side, side), image(3, side, side)
    prompts = look_prompts(processor, shown)
    rows = [  # (group, completion pieces: text or a picture)
        (0, ["ab", first, "cd"]),
        (0, ["ab", first, "ef"]),
        (0, ["ab", other, "cd"]),
        (0, ["ab", "xyz"]),
        (1, ["q", first, "r"]),
        (1, ["q", "s"]),
    ]
    prompt_ids, completions, vision = [], [], []
    for group, pieces in rows:
        ids, pictures, text = prompts[group]
        tokens = tokens_of(processor, pieces)
        later = [piece for piece in pieces if not isinstance(piece, str)]
        prompt_ids.append(ids)
        completions.append(tokens)
        vision.append(Prompt(ids=tuple(ids), images=tuple(pictures + later) or None, text=text))
    return collated(tok, prompt_ids, completions, vision, group=[g for g, _ in rows])


def turn_pictures_batch(processor, side=28):
    """Multi-turn rows with pictures, as rendered turns make them: a tool's picture ends a turn, and the next turn
    continues the conversation as rendered, its first sampled letter dropped (a stripped reasoning block), the
    prompt's and the tool's pictures kept. Group 0 has a prompt picture: "ab" + picture A then "cd" after it;
    "ab" + A then "ef" (the same history); "ab" + picture B (A's size) then "cd"; and a row of one turn. Group 1,
    a text prompt: "q" + A then "r"; and one turn. Also each turn as a row of its own, with the pictures its tokens
    hold, and where each of the batch's positions sits among them (`support.layouts.turns_batch`'s reference)."""
    tok = processor.tokenizer
    shown, first, other = image(1, side, side), image(2, side, side), image(3, side, side)
    prompts = look_prompts(processor, shown)
    rows = [  # (group, [(dropped, kept, picture) of each turn ending in a tool's picture], the last turn's text)
        (0, [("a", "b", first)], "cd"),
        (0, [("a", "b", first)], "ef"),
        (0, [("a", "b", other)], "cd"),
        (0, [], "ab xyz"),
        (1, [("q", "", first)], "r"),
        (1, [], "q s"),
    ]
    prompt_ids, completions, vision, turns, forks, where = [], [], [], [], [], []
    for i, (group, tool_turns, last) in enumerate(rows):
        ids, pictures, text = prompts[group]
        context, tokens, done, seen = list(ids), [], [], list(pictures)
        for dropped, kept, shown in tool_turns:
            span = tokens_of(processor, [dropped + kept, shown])
            done.append((len(tokens), len(tokens) + len(span), tuple(context)))
            forks.append((list(context), span, tuple(seen + [shown])))
            tokens += span
            seen.append(shown)
            context = context + tokens_of(processor, [kept, shown, "\n"] if kept else [shown, "\n"])
        span = tokens_of(processor, [last])
        done.append((len(tokens), len(tokens) + len(span), tuple(context)))
        forks.append((list(context), span, tuple(seen)))
        tokens += span
        for start, end, _ in done:
            where.append((i, start, end, len(where)))
        prompt_ids.append(ids)
        completions.append(tokens)
        vision.append(Prompt(ids=tuple(ids), images=tuple(seen) or None, text=text))
        turns.append(tuple(done) if len(done) > 1 else None)
    batch = collated(tok, prompt_ids, completions, vision, [g for g, _, _ in rows], turns)
    alone = [Prompt(ids=tuple(c), images=p or None, text=processor.image_token * len(p)) for c, _, p in forks]
    singles = collated(tok, [c for c, _, _ in forks], [t for _, t, _ in forks], alone)
    return batch, singles, where
