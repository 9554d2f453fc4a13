"""The demo pipeline end to end on a tiny model: files written, fresh output directory, last line format; its greedy
evaluation against `model.generate`, and its progress line."""

from __future__ import annotations

import io
import os
import re

import pytest

from grpo.apps import demo
from grpo.data.prompts import tokenize_prompts
from grpo.rollout.cpu import packed, panels
from support.tiny import make_model, make_tokenizer

PACKED_LINEAR = packed.packed_linear
PANEL_LINEAR = panels.panel_linear


def test_reward_reads_the_last_integer():
    completions = [
        [{"role": "assistant", "content": "3 + 4 = 7"}],
        [{"role": "assistant", "content": "7 or 8"}],
        [{"role": "assistant", "content": "seven"}],
        "The sum is 12.",
    ]
    assert demo.correctness_reward(completions, a=[3, 3, 3, 5], b=[4, 4, 4, 7]) == [1.0, 0.0, 0.0, 1.0]
    assert demo.last_integer("a -3 b") == -3 and demo.last_integer("none") is None


def test_demo_smoke_run(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # what the demo sets (then it is this test's, undone after it)
    out = str(tmp_path / "runs" / "demo")
    demo.main(["--model", tiny_model_dir, "--steps", "2", "--output", out])
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"accuracy_before=[01]\.\d{4} accuracy_after=[01]\.\d{4}", lines[-1])
    for name in (
        "metrics.jsonl",
        "samples.md",
        "report.html",
        "summary.json",
        "model/config.json",
        "model/tokenizer_config.json",
    ):
        assert os.path.exists(os.path.join(out, name)), name
    assert len(open(os.path.join(out, "metrics.jsonl")).read().splitlines()) == 2
    demo.main(["--model", tiny_model_dir, "--steps", "1", "--output", out])
    said = capsys.readouterr().out
    assert f"Moved the previous run in {out} to {out}.previous" in said
    assert len(open(os.path.join(out, "metrics.jsonl")).read().splitlines()) == 1
    assert len(open(os.path.join(out + ".previous", "metrics.jsonl")).read().splitlines()) == 2


@pytest.mark.parametrize("kernel", ["panels", "mkl"])
def test_greedy_completions_equal_model_generate(monkeypatch, kernel):
    """The fast engine's greedy decoding (lean decoder, float32: the panel kernel, or MKL's packed weights, once
    the 24-token completions of a random model run on) gives model.generate's texts, chunk by chunk."""
    made = []
    monkeypatch.setattr(packed, "packed_linear", lambda *a: made.append(a) or PACKED_LINEAR(*a))
    monkeypatch.setattr(panels, "panel_linear", lambda *a: made.append(a) or PANEL_LINEAR(*a))
    if kernel == "mkl":
        monkeypatch.setattr(panels, "available", lambda weight: False)
    tok = make_tokenizer()
    tok.padding_side = "left"
    model = make_model(tok, hidden=64)
    prompts = tokenize_prompts([demo.chat(demo.TRAIN_TEMPLATE, a, b) for a, b in demo.PAIRS], tok)
    done = []
    fast = demo.greedy_completions(model, tok, prompts, 24, progress=done.append)
    plain = demo._generate(model, tok, prompts, 24, "cpu")
    assert fast == plain
    assert done == [demo.EVAL_CHUNK]
    assert max(len(t) for t in fast) == 24  # (the character tokenizer: 24 tokens, 24 characters)
    if panels.available(model.lm_head.weight):
        assert len(made) == 2 * 4 + 1  # 2 layers of 4 linears in panels, and the output head
    elif packed.available(model.lm_head.weight):
        assert len(made) == 2 * 2 + 1  # 2 layers of 2 packed linears (the MLP), and the output head


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_eval_progress_is_a_live_bar_on_a_terminal_and_plain_lines_elsewhere():
    log = io.StringIO()
    progress = demo.EvalProgress("Greedy evaluation before training", 162, stream=log)
    for _ in range(6):
        progress(27)
    progress.close()
    lines = log.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "Greedy evaluation before training: 81/162 prompts",
        "Greedy evaluation before training: 162/162 prompts",
    ]
    term = FakeTerminal()
    progress = demo.EvalProgress("Greedy evaluation after training", 162, stream=term)
    progress(81)
    progress.close()
    drawn = term.getvalue()
    assert drawn.endswith("\x1b[2K")  # drawn in place, then cleared (transient) for the result line
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn)  # without its colours and cursor moves
    assert "Greedy evaluation after training" in text and "81/162 prompts" in text
