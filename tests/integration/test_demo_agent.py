"""`make demo-agent` end to end on a tiny model (files, last line, the saved tokenizer keeps the tool template), its
reward and its held-out split; slow (`make test-slow`): the bundled model learns to use the tool."""

from __future__ import annotations

import json
import os
import re

import pytest

from grpo.agent import CHATML_TOOLS
from grpo.apps import demo_agent
from grpo.models.bundled import BundledModelUnavailable, bundled_model_path
from support.tiny import make_model, make_tokenizer


def test_reward_reads_the_final_assistant_turn():
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "multiply"}}]}
    completions = [
        [
            call,
            {"role": "tool", "name": "multiply", "content": "4148"},
            {"role": "assistant", "content": "It is 4148."},
        ],
        [{"role": "assistant", "content": "4148 or 12"}],
        [call, {"role": "tool", "name": "multiply", "content": "4148"}],  # the exchange ended on a call
    ]
    assert demo_agent.correct_answer(completions, a=[122] * 3, b=[34] * 3) == [1.0, 0.0, 0.0]


def test_heldout_numbers_never_occur_in_training():
    train, held = demo_agent.split_pairs(seed=0)
    assert len(held) == len(set(held)) >= 100
    assert not {a for a, _ in held} & {a for a, _ in train} and not {b for _, b in held} & {b for _, b in train}
    assert demo_agent.split_pairs(seed=1)[1] == held  # the same held-out pairs for every seed


def test_demo_agent_smoke_run(tmp_path, capsys):
    tok = make_tokenizer()
    model_dir = tmp_path / "tiny-long"
    make_model(tok, context=4096).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    out = str(tmp_path / "runs" / "demo-agent")
    demo_agent.main(["--model", str(model_dir), "--steps", "1", "--output", out])
    lines = capsys.readouterr().out.strip().splitlines()
    number = r"[01]\.\d{4}"
    names = ("accuracy_before", "accuracy_after", "tool_calls_before", "tool_calls_after")
    assert re.fullmatch(" ".join(f"{name}={number}" for name in names), lines[-1])
    for name in ("metrics.jsonl", "samples.md", "report.html", "summary.json", "model/config.json"):
        assert os.path.exists(os.path.join(out, name)), name
    with open(os.path.join(out, "model", "tokenizer_config.json")) as f:
        saved = json.load(f).get("chat_template") or open(os.path.join(out, "model", "chat_template.jinja")).read()
    assert saved == CHATML_TOOLS
    assert json.load(open(os.path.join(out, "summary.json")))["heldout_pairs"] == 128


@pytest.mark.slow
def test_the_bundled_model_learns_to_use_the_tool(tmp_path):
    try:
        model = bundled_model_path()
    except BundledModelUnavailable as err:
        pytest.skip(str(err))
    summary = demo_agent.run(model, str(tmp_path / "demo-agent"), seed=0, steps=20)
    assert summary["accuracy_after"] >= 0.9 and summary["tool_calls_after"] >= 0.9
