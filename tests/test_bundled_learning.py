"""Slow (`make test-slow`, not in the default suite): the demo's real learning run on the bundled
SmolLM2-135M-Instruct, about a minute of training on this CPU. Greedy accuracy on all 81 digit pairs must rise
clearly; it measured 0.69 -> 1.00 (seed 0) when this test was written."""

from __future__ import annotations

import pytest

from grpo import demo
from grpo.bundled import BundledModelUnavailable, bundled_model_path


@pytest.mark.slow
def test_the_bundled_model_learns_addition(tmp_path):
    try:
        model = bundled_model_path()
    except BundledModelUnavailable as err:
        pytest.skip(str(err))
    before, after = demo.run(model, str(tmp_path / "demo"), seed=0, steps=36)
    assert after >= before + 0.15 and after >= 0.85
