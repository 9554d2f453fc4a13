"""The config is typed where it is read: a misspelled or removed field is a type error (`make lint` runs mypy over
src/grpo), not an AttributeError at the line that reads it, minutes into a run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from grpo import GRPOConfig
from grpo.algo.sampling import SamplingSettings
from grpo.checkpoint.hub import HubSettings
from grpo.observe.diagnostics import Limits
from grpo.rollout.vllm import VLLMSettings

ROOT = Path(__file__).resolve().parents[2]

READS = """
from grpo.config import GRPOConfig, ResolvedConfig


def sampled(args: ResolvedConfig) -> float:
    return args.temperature * args.top_p


def misspelled(args: GRPOConfig) -> float:
    return args.temprature
"""


def test_a_misspelled_config_field_is_a_type_error(tmp_path):
    api = pytest.importorskip("mypy.api")
    snippet = tmp_path / "reads.py"
    snippet.write_text(READS)
    # grpo.config itself is checked; the packages it imports are not followed (a second, not a minute and a half)
    out, err, status = api.run(
        [
            str(snippet),
            str(ROOT / "src" / "grpo" / "config"),
            f"--config-file={ROOT / 'pyproject.toml'}",
            "--follow-imports=skip",
            f"--cache-dir={os.devnull}",
            "--no-incremental",
        ]
    )
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert status == 1 and len(errors) == 1, out + err
    assert 'reads.py:10: error: "GRPOConfig" has no attribute "temprature"' in errors[0]


def test_the_narrow_settings_default_to_the_configs_defaults():
    """The values handed to engines, the Hub and the diagnostics are the config's own: their defaults are
    GRPOConfig's (a test or a script that builds one directly samples as a default run would)."""
    config = GRPOConfig(output_dir="x")
    assert SamplingSettings() == SamplingSettings.of(config)
    assert VLLMSettings() == VLLMSettings.of(config)
    assert HubSettings(output_dir="x") == HubSettings.of(config)
    assert Limits.saved(config.to_dict()) == Limits.of(config)
