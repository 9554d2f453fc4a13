"""vLLM tests (run by `make test` in a pytest process of their own: an in-process vLLM engine initializes
torch.distributed and binds the CPU threads for the rest of the process).

Starting a vLLM engine costs seconds and its first generation more, so one engine per model and dtype serves the
whole session: `shared_llm` replaces `vllm.LLM` with a factory that builds each engine once (from a directory of
its own, so that the directory of the first trainer that asked for it may go) and hands the same engine to every
later trainer; each trainer's `sync_weights` then loads its own policy into it."""

from __future__ import annotations

import os
import shutil
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'grpo[vllm]')")

from support import served, tiny  # noqa: E402

_REAL_LLM = vllm.LLM
_ENGINES: dict[tuple, object] = {}


def vllm_tiny_model(path, seed: int = 0, tied: bool = False) -> str:
    """A 2-layer Llama whose head size vLLM's CPU attention supports (32), with the tiny tokenizer and 2048
    positions (room for a tool loop's schemas: test_vllm_agent.py's server mode runs on the session's server);
    `tied`: its output head shares the input embedding (as SmolLM2's does)."""
    tokenizer = tiny.make_tokenizer()
    model = tiny.make_model(tokenizer, seed, hidden=128, context=2048)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _shared(model: str, **kwargs):
    key = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k != "seed")) + (
        open(os.path.join(model, "config.json")).read(),
    )
    if key not in _ENGINES:
        own = os.path.join(_SESSION_DIR, f"engine{len(_ENGINES)}")
        shutil.copytree(model, own)
        _ENGINES[key] = _REAL_LLM(model=own, **kwargs)
    return _ENGINES[key]


_SESSION_DIR = ""


@pytest.fixture(scope="session", autouse=True)
def shared_llm(tmp_path_factory):
    global _SESSION_DIR
    _SESSION_DIR = str(tmp_path_factory.mktemp("vllm-engines"))
    vllm.LLM = _shared
    yield
    vllm.LLM = _REAL_LLM


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    return vllm_tiny_model(tmp_path_factory.mktemp("tiny-vllm") / "tiny-llama-h128")


@pytest.fixture(scope="session")
def vllm_tied_model_dir(tmp_path_factory):
    return vllm_tiny_model(tmp_path_factory.mktemp("tiny-vllm-tied") / "tiny-llama-h128-tied", tied=True)


@pytest.fixture(scope="session")
def tiny_model_dir_h8(tmp_path_factory):
    """The main suite's tiny Llama (head size 8, which vLLM's CPU attention does not support)."""
    return tiny.save_tiny(tmp_path_factory.mktemp("tiny-h8") / "tiny-llama")


@pytest.fixture(scope="session")
def servers(vllm_model_dir, tmp_path_factory):
    """`grpo vllm-serve` servers of the head-size-32 tiny model, started at once (a start is ~30 s of imports in
    three processes; side by side they share it) and stopped at the end of the session: the ports of `open`
    (float32, no key; its log: `open_log`) and `keyed` (bfloat16, requires served.KEY), and `shards` (float32, in
    two shards: its process; test_server_mode.py kills it). A run connecting to a server takes its weight transfer
    over, so tests use them one run at a time."""
    tmp = tmp_path_factory.mktemp("servers")
    keyed = ("--dtype", "bfloat16", "--api-key", served.KEY)
    procs = [
        served.start(vllm_model_dir, tmp),
        served.start(vllm_model_dir, tmp, *keyed),
        served.start(vllm_model_dir, tmp, "--tensor-parallel-size", "2"),
    ]
    try:
        for proc in procs:
            served.wait(proc)
        yield SimpleNamespace(open=procs[0].port, keyed=procs[1].port, shards=procs[2], open_log=procs[0].log)
    finally:
        for proc in procs:
            served.stop(proc)
