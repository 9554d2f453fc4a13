"""DeepSpeed's config gets its batch values from GRPOConfig; one that disagrees is refused with both values named.
(The DeepSpeed runs themselves are in test_distributed.py and test_resume.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from grpo import GRPOConfig
from grpo.distributed import zero


def accelerator_with(config, processes=2):
    plugin = SimpleNamespace(deepspeed_config=config, gradient_accumulation_steps="auto")
    return SimpleNamespace(
        state=SimpleNamespace(deepspeed_plugin=plugin), num_processes=processes, gradient_accumulation_steps=1
    )


def args(**kw):
    base = dict(
        output_dir="/tmp/unused",
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
    )
    return GRPOConfig(**{**base, **kw})


def test_auto_values_come_from_the_config():
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 3},
    }
    acc = accelerator_with(config)
    zero.configure(acc, args())
    assert config == {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 3},
    }
    assert acc.gradient_accumulation_steps == 2 and acc.state.deepspeed_plugin.gradient_accumulation_steps == 2


def test_a_config_that_disagrees_is_named():
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}
    with pytest.raises(
        ValueError,
        match=r"gradient_accumulation_steps is 1 in the DeepSpeed config and 2 from "
        r"GRPOConfig; gradient_clipping is 1.0 .* and 0.5 .*\"auto\"",
    ):
        zero.configure(accelerator_with(config), args())


def test_nothing_changes_without_deepspeed():
    acc = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None))
    zero.configure(acc, args())
    assert not zero.in_use(acc) and zero.backward_kwargs(acc) == {}
