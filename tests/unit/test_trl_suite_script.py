"""scripts/trl_suite.py, the harness that runs TRL's GRPO test file against grpo: the one-line import swap, the
junit outcomes it reads and the README table it writes (TRL's test file itself is not in this repository)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import trl_suite  # noqa: E402


def make_tests_folder(tmp_path, import_line=trl_suite.IMPORT_LINE):
    folder = tmp_path / "trl-tests"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / "conftest.py").write_text("")
    (folder / "testing_utils.py").write_text("X = 1\n")
    (folder / "test_grpo_trainer.py").write_text(f"import torch\n{import_line}\n\n\ndef test_x():\n    pass\n")
    return folder


def test_only_the_trainer_import_changes(tmp_path):
    folder = make_tests_folder(tmp_path)
    grpo_file = trl_suite.prepare(folder, tmp_path / "work", "grpo")
    trl_file = trl_suite.prepare(folder, tmp_path / "work", "trl")
    original = (folder / "test_grpo_trainer.py").read_text()
    assert trl_file.read_text() == original
    assert grpo_file.read_text() == original.replace(
        "from trl import GRPOConfig, GRPOTrainer", "from grpo import GRPOConfig, GRPOTrainer"
    )
    assert (grpo_file.parent / "testing_utils.py").read_text() == "X = 1\n"
    with pytest.raises(SystemExit, match="no line"):
        trl_suite.prepare(make_tests_folder(tmp_path / "other", "from trl import GRPOTrainer"), tmp_path / "w2", "grpo")


def test_outcomes_and_the_table(tmp_path):
    junit = tmp_path / "r.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="tests.test_grpo_trainer.TestGRPOTrainer" name="test_a"/>'
        '<testcase classname="tests.test_grpo_trainer.TestGRPOTrainer" name="test_b">'
        '<failure message="KeyError: &apos;x&apos;">tb</failure></testcase>'
        '<testcase classname="tests.test_grpo_trainer.TestGRPOTrainer" name="test_c"><skipped message="gpu"/>'
        "</testcase></testsuite></testsuites>"
    )
    found = trl_suite.outcomes(junit)
    assert found == {
        "TestGRPOTrainer::test_a": ("passed", ""),
        "TestGRPOTrainer::test_b": ("failed", "KeyError: 'x'"),
        "TestGRPOTrainer::test_c": ("skipped", "gpu"),
    }
    table = {n: {"trl": ("passed", ""), "grpo": o} for n, o in found.items()}
    text = trl_suite.markdown(table, ("trl", "grpo"))
    assert "test_a" not in text and "| `TestGRPOTrainer::test_b` | passed | failed | KeyError: 'x' |" in text
    assert "test_c" in text  # TRL passed, grpo skipped: shown
