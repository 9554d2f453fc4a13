"""docs/config.md, the configuration reference, is generated from GRPOConfig's fields by
scripts/config_reference.py: the committed page must be what the script writes, so a field added, renamed or
re-documented without regenerating the page fails here, with the command that fixes it."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from grpo import GRPOConfig

ROOT = Path(__file__).resolve().parents[2]


def generator():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_is_up_to_date():
    script = generator()
    assert (ROOT / "docs" / "config.md").read_text() == script.render(), (
        f"docs/config.md is out of date with GRPOConfig: run `{script.COMMAND}` and commit docs/config.md"
    )


def test_every_field_has_a_row_and_a_verdict_against_trl():
    page = generator().render()
    rows = {line.split("|")[1].strip(" `"): line for line in page.splitlines() if line.startswith("| `")}
    assert {f.name for f in dataclasses.fields(GRPOConfig)} <= set(rows)
    differs = [name for name, row in rows.items() if "**differs**" in row]
    assert {"max_completion_length", "bf16", "enable_jit_checkpoint", "average_tokens_across_devices"} <= set(differs)
    assert "**grpo only**" in rows["packing"] and "as TRL" in rows["num_generations"]
