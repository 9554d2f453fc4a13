"""Slow (`make test-slow`): the demo's real learning run on the bundled SmolLM2-135M-Instruct with generation in
vLLM (colocate), the importance-sampling correction on. Greedy accuracy on all 81 digit pairs must rise clearly, as
it does with grpo's own engine (tests/integration/test_bundled_learning.py). The same run from the command line:
`python -m grpo.apps.demo --set use_vllm=true`."""

from __future__ import annotations

import pytest

from grpo.apps import demo
from grpo.models.bundled import BundledModelUnavailable, bundled_model_path


@pytest.mark.slow
def test_the_bundled_model_learns_addition_with_vllm(tmp_path):
    try:
        model = bundled_model_path()
    except BundledModelUnavailable as err:
        pytest.skip(str(err))
    before, after = demo.run(model, str(tmp_path / "demo"), seed=0, steps=36, use_vllm=True)
    assert after >= before + 0.15 and after >= 0.85
