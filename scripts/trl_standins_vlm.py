"""Local stand-ins for the tiny vision-language models TRL's tests load from ``trl-internal-testing`` (called by
``trl_standins.build``).

Each stand-in is a small, randomly initialised model of the hub model's own architecture class, saved with
``save_pretrained`` next to a processor, so that ``AutoModelForImageTextToText.from_pretrained(<dir>)`` and
``AutoProcessor.from_pretrained(<dir>)`` load it with no code of ours imported. The text side is SmolLM2's tokenizer
(see ``trl_standins.make_tokenizer``) with the family's image tokens and the chat template TRL ships for it; the
vision side is sized so that an image of 32-64 pixels becomes a handful of image tokens.

torchvision is not installed here, and transformers 5.19 cannot build any processor that holds a video processor
without it (``ProcessorMixin`` looks its class up among the torchvision-only objects). That rules out the real
processors of Qwen2-VL, Qwen2.5-VL, Qwen3.5 (``Qwen3VLProcessor``), Gemma 4 and SmolVLM (which also needs
``num2words``). So:

- Qwen families: when ``LOADABLE_SUBSTITUTES`` is true, the processor saved is ``PaddleOCRVLProcessor``, which is
  transformers' images-only processor of the same scheme (each ``<|image_pad|>`` becomes
  ``image_grid_thw.prod() // merge_size**2`` tokens, ``mm_token_type_ids`` returned), around the family's own
  ``Qwen2VLImageProcessorPil``; for images its output is the same as the real processor's. When false, the real
  class is recorded and loading needs torchvision.
- SmolVLM: ``Idefics3Processor`` (SmolVLM's first release ships it; its image handling is SmolVLM's) with the
  SmolVLM model class.
- Gemma 4: ``Gemma4Processor`` cannot even be imported without torchvision, and no other transformers processor
  writes Gemma 4's variable-length image blocks, so the real class is recorded (with the audio feature extractor
  and video processor sections it saves) and ``AutoProcessor`` fails here.

``images_only_processor(path)`` builds a working images-only processor for the stand-ins that record a real class
(Gemma 4; the Qwen families too when ``LOADABLE_SUBSTITUTES`` is false), in a process that imports this module.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoImageProcessor, AutoTokenizer, ProcessorMixin
from transformers.processing_utils import ProcessingKwargs

ORG = "trl-internal-testing"
LOADABLE_SUBSTITUTES = True

# A llava-1.5 style template (TRL ships none for llava-1.5): "USER: <image>\n<text> ASSISTANT: <reply></s>".
LLAVA_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for block in message['content'] %}{{ block['text'] }}{% endfor %}{% endif %}{{ '\n' }}"
    "{% else %}{{ message['role'] | upper }}{{ ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}"
    "{% for block in message['content'] if block['type'] == 'image' %}{{ '<image>\n' }}{% endfor %}"
    "{% for block in message['content'] if block['type'] == 'text' %}{{ block['text'] }}{% endfor %}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ ' ' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

QWEN_NAMED = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}


def _template(name: str) -> str:
    from trl_standins import trl_template

    return trl_template(name)


def _tokenizer(make_tokenizer, template: str, eos: str, named: dict[str, str] | None = None, extra=()):
    """`make_tokenizer`'s tokenizer, plus named multimodal tokens (``tokenizer.image_token`` and the like, which the
    processors read) saved in its config as the hub tokenizers do."""
    named = named or {}
    tok = make_tokenizer(template, eos, extra=tuple(extra) + tuple(named.values()))
    if not named:
        return tok
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        return AutoTokenizer.from_pretrained(tmp, model_specific_special_tokens=named)


def _token_ids(tok) -> dict:
    return dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)


def _id(tok, token: str) -> int:
    return tok.convert_tokens_to_ids(token)


def _images_only(processor_class):
    """A Qwen-family `processor_class` (``__init__(image_processor, tokenizer, video_processor, chat_template)``)
    without its video processor: ``ProcessorMixin`` takes its sub-processors from the subclass's signature, so the
    video processor the parent passes on is dropped."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        processor_class.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(f"{processor_class.__name__}ImagesOnly", (processor_class,), {"__init__": __init__})


# ---------------------------------------------------------------------------------------------------------------
# Qwen2-VL, Qwen2.5-VL, Qwen3.5 (dense and MoE): patches of 8 px merged 2x2, so a 40x32 image is 4-6 tokens.
# ---------------------------------------------------------------------------------------------------------------

QWEN_PATCH = 8


def _qwen_image_processor():
    from transformers import Qwen2VLImageProcessorPil

    side = QWEN_PATCH * 2
    return Qwen2VLImageProcessorPil(
        patch_size=QWEN_PATCH,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": side * side, "longest_edge": 4 * side * 4 * side},
    )


QWEN_VIDEO = {
    "Qwen2VLProcessor": "Qwen2VLVideoProcessor",
    "Qwen2_5_VLProcessor": "Qwen2VLVideoProcessor",
    "Qwen3VLProcessor": "Qwen3VLVideoProcessor",
}


def _qwen_processor(real_class: str, tok, template: str):
    """(processor, real class or None, extra processor config sections) of a Qwen-family stand-in."""
    import transformers

    images = _qwen_image_processor()
    if LOADABLE_SUBSTITUTES:
        from transformers import PaddleOCRVLProcessor

        return PaddleOCRVLProcessor(image_processor=images, tokenizer=tok, chat_template=template), None, {}
    video = dict(
        video_processor_type=QWEN_VIDEO[real_class],
        patch_size=QWEN_PATCH,
        merge_size=2,
        temporal_patch_size=2,
        size=dict(images.size),
    )
    cls = _images_only(getattr(transformers, real_class))
    processor = cls(image_processor=images, tokenizer=tok, chat_template=template)
    return processor, real_class, {"video_processor": video}


def _qwen_vl_tokenizer(make_tokenizer, template_name: str):
    template = _template(template_name)
    return _tokenizer(make_tokenizer, template, "<|im_end|>", named=QWEN_NAMED), template


def _qwen_ids(tok) -> dict:
    return dict(
        image_token_id=_id(tok, "<|image_pad|>"),
        video_token_id=_id(tok, "<|video_pad|>"),
        vision_start_token_id=_id(tok, "<|vision_start|>"),
        vision_end_token_id=_id(tok, "<|vision_end|>"),
    )


def _qwen_vl_text(tok) -> dict:
    """The text config Qwen2-VL and Qwen2.5-VL share here (multimodal RoPE over 3 sections)."""
    rope = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}
    return dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_parameters=rope,
        **_token_ids(tok),
    )


def build_qwen2_vl(make_tokenizer):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tok, template = _qwen_vl_tokenizer(make_tokenizer, "qwen2_5_vl")
    text = _qwen_vl_text(tok)
    vision = dict(
        depth=2,
        embed_dim=16,
        hidden_size=32,
        mlp_ratio=2,
        num_heads=4,
        patch_size=QWEN_PATCH,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    config = Qwen2VLConfig(text_config=text, vision_config=vision, **_qwen_ids(tok), **_token_ids(tok))
    return Qwen2VLForConditionalGeneration(config), _qwen_processor("Qwen2VLProcessor", tok, template)


def build_qwen2_5_vl(make_tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok, template = _qwen_vl_tokenizer(make_tokenizer, "qwen2_5_vl")
    text = _qwen_vl_text(tok)
    vision = dict(
        depth=2,
        hidden_size=16,
        intermediate_size=32,
        num_heads=4,
        out_hidden_size=32,
        patch_size=QWEN_PATCH,
        spatial_merge_size=2,
        temporal_patch_size=2,
        fullatt_block_indexes=[1],
        window_size=4 * QWEN_PATCH,
    )
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_qwen_ids(tok), **_token_ids(tok))
    return Qwen2_5_VLForConditionalGeneration(config), _qwen_processor("Qwen2_5_VLProcessor", tok, template)


def _qwen3_5(make_tokenizer, template_name: str, moe: bool):
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    tok, template = _qwen_vl_tokenizer(make_tokenizer, template_name)
    text = dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=2048,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 1.0,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        **_token_ids(tok),
    )
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
        del text["intermediate_size"]
    vision = dict(
        depth=2,
        hidden_size=16,
        intermediate_size=32,
        num_heads=4,
        patch_size=QWEN_PATCH,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=32,
        num_position_embeddings=64,
    )
    config_class, model_class = (
        (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration)
        if moe
        else (Qwen3_5Config, Qwen3_5ForConditionalGeneration)
    )
    config = config_class(text_config=text, vision_config=vision, **_qwen_ids(tok), **_token_ids(tok))
    return model_class(config), _qwen_processor("Qwen3VLProcessor", tok, template)


def build_qwen3_5(make_tokenizer):
    return _qwen3_5(make_tokenizer, "qwen3_5_nothink", moe=False)


def build_qwen3_5_moe(make_tokenizer):
    return _qwen3_5(make_tokenizer, "qwen3_6", moe=True)


# ---------------------------------------------------------------------------------------------------------------
# Gemma 3 and Gemma 4
# ---------------------------------------------------------------------------------------------------------------


def build_gemma3(make_tokenizer):
    """32x32 images in 8 px patches, pooled 2x2: 4 image tokens per image."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor

    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    template = _template("gemma3")
    tok = _tokenizer(make_tokenizer, template, "<end_of_turn>", named=named)
    text = dict(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=2048,
        **_token_ids(tok),
    )
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        vision_use_head=False,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id,
        image_token_index=tok.image_token_id,
        **_token_ids(tok),
    )
    model = Gemma3ForConditionalGeneration(config)
    # The projection starts at zero, which would keep the vision tower's gradients at zero until its first update.
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.02)
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = Gemma3Processor(image_processor=images, tokenizer=tok, chat_template=template, image_seq_length=4)
    return model, (processor, None, {})


# Gemma 4's turn, reasoning and tool markers (one token each, as on the real tokenizer).
GEMMA4_TOKENS = (
    "<|turn>",
    "<turn|>",
    "<|channel>",
    "<channel|>",
    "<|tool>",
    "<tool|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    '<|"|>',
    "<|video|>",
)
GEMMA4_NAMED = {
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "image_token": "<|image|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "audio_token": "<|audio|>",
}


class _Gemma4Kwargs(ProcessingKwargs, total=False):
    _defaults = {"text_kwargs": {"padding": True, "return_mm_token_type_ids": True}}


class Gemma4ImagesProcessor(ProcessorMixin):
    """Gemma 4's processor for images only: transformers' ``Gemma4Processor`` cannot even be imported without
    torchvision. Each ``<|image|>`` of a prompt becomes ``<|image>``, one ``<|image|>`` per soft token of that
    image, ``<image|>``; ``mm_token_type_ids`` marks the soft tokens."""

    valid_processor_kwargs = _Gemma4Kwargs

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, image_seq_length=280, **kwargs):
        self.image_seq_length = image_seq_length
        self.image_token, self.image_token_id = tokenizer.image_token, tokenizer.image_token_id
        self.boi_token, self.eoi_token = tokenizer.boi_token, tokenizer.eoi_token
        super().__init__(image_processor, tokenizer, chat_template=chat_template)

    def prepare_inputs_layout(self, images=None, text=None, **kwargs):
        from transformers.image_utils import make_nested_list_of_images

        images, text, videos, audio = super().prepare_inputs_layout(images=images, text=text, **kwargs)
        if images is not None:
            images = make_nested_list_of_images(images)
            if not text:
                text = [" ".join([self.image_token] * len(group)) for group in images]
        return images, text, videos, audio

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs) -> str:
        count = int(image_inputs["num_soft_tokens_per_image"][image_idx])
        return f"{self.boi_token}{self.image_token * count}{self.eoi_token}"

    @property
    def model_input_names(self):
        return super().model_input_names + ["mm_token_type_ids"]

    @property
    def unused_input_names(self) -> list[str]:
        return ["num_soft_tokens_per_image"]


def build_gemma4(make_tokenizer):
    """Patches of 4 px pooled 2x2, at most 70 image tokens per image (the smallest budget Gemma 4 supports)."""
    from transformers import (
        Gemma4AudioFeatureExtractor,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4ImageProcessorPil,
    )

    template = _template("gemma4")
    tok = _tokenizer(make_tokenizer, template, "<turn|>", named=GEMMA4_NAMED, extra=GEMMA4_TOKENS)
    text = dict(
        vocab_size=len(tok),
        vocab_size_per_layer_input=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=8,
        hidden_size_per_layer_input=8,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=64,
        num_kv_shared_layers=0,
        max_position_embeddings=2048,
        **_token_ids(tok),
    )
    patch, pool, budget = 4, 2, 70
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=4,
        patch_size=patch,
        pooling_kernel_size=pool,
        position_embedding_size=128,
    )
    config = Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        boi_token_id=tok.boi_token_id,
        eoi_token_id=tok.eoi_token_id,
        image_token_id=tok.image_token_id,
        video_token_id=_id(tok, "<|video|>"),
        boa_token_id=tok.boa_token_id,
        eoa_token_index=tok.eoa_token_id,
        audio_token_id=tok.audio_token_id,
        **_token_ids(tok),
    )
    model = Gemma4ForConditionalGeneration(config)
    images = Gemma4ImageProcessorPil(patch_size=patch, pooling_kernel_size=pool, max_soft_tokens=budget)
    processor = Gemma4ImagesProcessor(images, tok, chat_template=template, image_seq_length=budget)
    # What transformers' Gemma4Processor saves besides: its audio feature extractor and video processor.
    sections = {
        "feature_extractor": json.loads(Gemma4AudioFeatureExtractor().to_json_string()),
        "video_processor": {
            "video_processor_type": "Gemma4VideoProcessor",
            "patch_size": patch,
            "pooling_kernel_size": pool,
            "max_soft_tokens": budget,
        },
    }
    return model, (processor, "Gemma4Processor", sections)


# ---------------------------------------------------------------------------------------------------------------
# LLaVA 1.5 and LLaVA-NeXT: CLIP towers on 32x32 images in 8 px patches (16 tokens, CLS dropped).
# ---------------------------------------------------------------------------------------------------------------

CLIP_VISION = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
)


def _llava_text(tok, model_type: str) -> dict:
    return dict(
        model_type=model_type,
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        max_position_embeddings=2048,
        **_token_ids(tok),
    )


def build_llava(make_tokenizer):
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tok = _tokenizer(make_tokenizer, LLAVA_TEMPLATE, "</s>", named={"image_token": "<image>"}, extra=("<s>",))
    config = LlavaConfig(
        text_config=_llava_text(tok, "llama"),
        vision_config=dict(model_type="clip_vision_model", **CLIP_VISION),
        image_token_index=tok.image_token_id,
        image_seq_length=16,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        **_token_ids(tok),
    )
    images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_TEMPLATE,
    )
    return LlavaForConditionalGeneration(config), (processor, None, {})


def build_llava_next(make_tokenizer):
    """Images tiled on a 32 px grid of up to 2x2 tiles plus the 32 px overview."""
    from transformers import (
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessorPil,
        LlavaNextProcessor,
    )

    template = _template("llava_next")
    tok = _tokenizer(make_tokenizer, template, "</s>", named={"image_token": "<image>"}, extra=("<s>",))
    pinpoints = [[32, 64], [64, 32], [64, 64]]
    config = LlavaNextConfig(
        text_config=_llava_text(tok, "mistral"),
        vision_config=dict(model_type="clip_vision_model", **CLIP_VISION),
        image_token_index=tok.image_token_id,
        image_grid_pinpoints=pinpoints,
        image_seq_length=16,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        **_token_ids(tok),
    )
    images = LlavaNextImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, image_grid_pinpoints=pinpoints
    )
    processor = LlavaNextProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=template,
    )
    return LlavaNextForConditionalGeneration(config), (processor, None, {})


# ---------------------------------------------------------------------------------------------------------------
# SmolVLM: images split into 32 px tiles plus a global view, each tile 4 tokens (8 px patches, pixel shuffle 2).
# ---------------------------------------------------------------------------------------------------------------


def build_smolvlm(make_tokenizer):
    from transformers import (
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )

    template = _template("smolvlm")
    extra = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>")
    tok = _tokenizer(make_tokenizer, template, "<end_of_utterance>", extra=extra)
    text = dict(
        model_type="llama",
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        max_position_embeddings=2048,
        **_token_ids(tok),
    )
    vision = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
    config = SmolVLMConfig(
        text_config=text,
        vision_config=vision,
        scale_factor=2,
        image_token_id=_id(tok, "<image>"),
        vocab_size=len(tok),
        **_token_ids(tok),
    )
    images = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    processor = Idefics3Processor(image_processor=images, tokenizer=tok, chat_template=template, image_seq_len=4)
    return SmolVLMForConditionalGeneration(config), (processor, None, {})


# name -> builder returning (model, (processor, the hub's processor class when it differs, its extra config sections))
VLMS: dict[str, Callable] = {
    "tiny-Gemma3ForConditionalGeneration": build_gemma3,
    "tiny-Gemma4ForConditionalGeneration": build_gemma4,
    "tiny-LlavaNextForConditionalGeneration": build_llava_next,
    "tiny-LlavaForConditionalGeneration": build_llava,
    "tiny-Qwen2_5_VLForConditionalGeneration": build_qwen2_5_vl,
    "tiny-Qwen2VLForConditionalGeneration": build_qwen2_vl,
    "tiny-Qwen3_5ForConditionalGeneration-NoThink": build_qwen3_5,
    "tiny-Qwen3_5MoeForConditionalGeneration-3.6": build_qwen3_5_moe,
    "tiny-SmolVLMForConditionalGeneration": build_smolvlm,
}


def _save(path: Path, model, processor, real_class: str | None, sections: dict) -> None:
    model.save_pretrained(path)
    processor.save_pretrained(path)
    tok = processor.tokenizer
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = tok.eos_token_id, tok.pad_token_id, tok.bos_token_id
    gen.save_pretrained(path)
    if real_class is None:
        return
    # Record the processor the hub model has, with the sub-processors that cannot be built here.
    for name in ("processor_config.json", "tokenizer_config.json"):
        file = path / name
        config = json.loads(file.read_text())
        if name == "processor_config.json":
            config.update(sections)
            config["processor_class"] = real_class
        elif "processor_class" in config:
            config["processor_class"] = real_class
        file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def images_only_processor(path: str | Path):
    """The processor of a stand-in whose hub processor cannot be built here (see the module docstring), without
    its video (and audio) half: for a process that imports this module."""
    import transformers

    path = Path(path)
    config = json.loads((path / "processor_config.json").read_text())
    real_class = config.pop("processor_class")
    if real_class == "Gemma4Processor":
        cls = Gemma4ImagesProcessor
    else:
        cls = _images_only(getattr(transformers, real_class))
    kwargs = {key: value for key, value in config.items() if not isinstance(value, dict)}
    template = path / "chat_template.jinja"
    if template.exists():
        kwargs["chat_template"] = template.read_text()
    images = AutoImageProcessor.from_pretrained(path)
    return cls(image_processor=images, tokenizer=AutoTokenizer.from_pretrained(path), **kwargs)


def build_vlms(org_dir: Path, make_tokenizer, log) -> None:
    """Build every VLM stand-in under `org_dir` (``<root>/trl-internal-testing``)."""
    org_dir = Path(org_dir)
    for name, builder in VLMS.items():
        log(f"stand-in {ORG}/{name}")
        torch.manual_seed(0)
        model, (processor, real_class, sections) = builder(make_tokenizer)
        _save(org_dir / name, model, processor, real_class, sections)
