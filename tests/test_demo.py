"""The demo pipeline end to end on a tiny model: files written, fresh output directory, last line format."""

from __future__ import annotations

import os
import re

from grpo import demo


def test_reward_reads_the_last_integer():
    completions = [
        [{"role": "assistant", "content": "3 + 4 = 7"}],
        [{"role": "assistant", "content": "7 or 8"}],
        [{"role": "assistant", "content": "seven"}],
        "The sum is 12.",
    ]
    assert demo.correctness_reward(completions, a=[3, 3, 3, 5], b=[4, 4, 4, 7]) == [1.0, 0.0, 0.0, 1.0]
    assert demo.last_integer("a -3 b") == -3 and demo.last_integer("none") is None


def test_demo_smoke_run(tiny_model_dir, tmp_path, capsys):
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
