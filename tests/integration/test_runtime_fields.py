"""The runtime fields beyond their one-value checks in field_effects/runtime.py: torch.compile (inductor, loss and
update as without it), TF32, activation checkpointing (transformers 5.24's names, FSDP's own), the DDP and
process-group handlers (and a two-process run that uses them), reward columns under remove_unused_columns,
average_tokens_across_devices' token count, the optimizers `optim` names and the warm-up schedule."""

from __future__ import annotations

import importlib.util
import json
import math
import types
from datetime import timedelta

import pytest
import torch
from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

from grpo import GRPOConfig, GRPOTrainer
from grpo.algo.losses import LossScale
from grpo.base.records import Rollout
from grpo.distributed.handlers import kwargs_handlers
from grpo.models.modeling import enable_checkpointing, recomputes_activations
from grpo.perf import compilation
from grpo.rewards.calling import RewardFunctionError, RewardFunctions
from support.rewards import length_reward
from support.runs import cfg, chat_dataset


def trained(model_dir, tmp_path, name, **kw):
    trainer = GRPOTrainer(
        model=model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=cfg(tmp_path / name, **kw)
    )
    trainer.train()
    return trainer


def weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


# ---- torch.compile ---------------------------------------------------------------------------------------------


def test_inductor_compiled_step_equals_the_eager_one(tiny_model_dir, tmp_path):
    """inductor generates C++ kernels for the decoder stack (g++ here); one step's loss and update equal the
    uncompiled step's within float32 rounding, and the compiled forward is in place only during the passes."""
    from torch._dynamo.utils import counters

    eager = trained(tiny_model_dir, tmp_path, "eager", optim="sgd")  # SGD: the update is lr x the gradient
    frames = counters["frames"]["ok"]
    compiled = trained(tiny_model_dir, tmp_path, "compiled", optim="sgd", torch_compile=True)
    assert counters["frames"]["ok"] > frames and compiled.training_pass.compiled.backend == "inductor"
    assert "forward" not in vars(compiled.training_pass.compiled.module)  # swapped back after the pass
    assert compiled.state.log_history[0]["loss"] == pytest.approx(eager.state.log_history[0]["loss"], abs=1e-6)
    assert compiled.state.log_history[0]["grad_norm"] == pytest.approx(
        eager.state.log_history[0]["grad_norm"], rel=1e-5
    )
    after, before = weights(compiled), weights(eager)
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=1e-5, atol=1e-6)


def test_compile_settings_torch_cannot_use_are_refused(monkeypatch):
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="torch_compile_backend='nope' is not a torch.compile backend"):
        compilation.check_compile_settings("nope", None, cpu)
    with pytest.raises(ValueError, match="torch_compile_mode='default' is an inductor mode.*'aot_eager'"):
        compilation.check_compile_settings("aot_eager", "default", cpu)
    with pytest.raises(ValueError, match="torch_compile_mode='fastest' is not a torch.compile mode"):
        compilation.check_compile_settings("inductor", "fastest", cpu)

    def no_compiler():
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr("torch._inductor.cpp_builder.get_cpp_compiler", no_compiler)
    with pytest.raises(ValueError, match="found no C\\+\\+ compiler.*install g\\+\\+"):
        compilation.check_compile_settings("inductor", None, cpu)
    compilation.check_compile_settings("aot_eager", None, cpu)  # no code generation: no compiler needed
    with pytest.raises(ValueError, match="torch_compile: grpo compiles the decoder stack"):
        compilation.decoder_stack(torch.nn.Linear(2, 2))


def test_torch_compile_is_resolved_from_backend_or_mode(tmp_path):
    assert not GRPOConfig(output_dir=str(tmp_path)).torch_compile
    assert GRPOConfig(output_dir=str(tmp_path), torch_compile_backend="eager").torch_compile
    assert GRPOConfig(output_dir=str(tmp_path), torch_compile_mode="default").torch_compile


# ---- TF32 ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tf32, compile_, fp16, bf16, device, capability, expected, warns",
    [
        (None, False, False, False, "cuda", (8, 0), None, False),  # torch's default
        (None, True, False, False, "cuda", (9, 0), True, False),  # torch_compile turns it on, as in transformers
        (None, True, True, False, "cuda", (8, 0), None, False),  # ... but not for fp16 alone
        (None, True, True, True, "cuda", (8, 0), True, False),
        (True, False, False, False, "cuda", (8, 6), True, False),
        (False, True, False, False, "cuda", (8, 0), False, False),
        (True, False, False, False, "cuda", (7, 5), None, True),  # no TF32 before Ampere
        (True, False, False, False, "cpu", (0, 0), None, True),
        (False, False, False, False, "cpu", (0, 0), None, False),  # nothing computes in TF32 there anyway
        (None, True, False, False, "cpu", (0, 0), None, False),
    ],
)
def test_tf32_decision(tf32, compile_, fp16, bf16, device, capability, expected, warns):
    value, warning = compilation.tf32_decision(tf32, compile_, fp16, bf16, device, capability)
    assert value is expected and (warning is not None) is warns


def test_tf32_sets_torch_switches_on_an_ampere_gpu_and_warns_on_a_cpu(monkeypatch):
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    args = types.SimpleNamespace(tf32=True, torch_compile=False, fp16=False, bf16=False)
    try:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        compilation.set_tf32(args, torch.device("cuda"))
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        compilation.set_tf32(types.SimpleNamespace(**dict(vars(args), tf32=False)), torch.device("cuda"))
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        with pytest.warns(UserWarning, match="tf32=True has no effect.*no CUDA device"):
            compilation.set_tf32(args, torch.device("cpu"))
        assert not torch.backends.cuda.matmul.allow_tf32  # left as it was
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ---- activation checkpointing ----------------------------------------------------------------------------------


def test_activation_checkpointing_is_the_name_that_wins(tmp_path):
    """transformers 5.24: activation_checkpointing(_kwargs) set wins over its alias gradient_checkpointing(_kwargs);
    unset, TRL's gradient_checkpointing=True decides."""
    out = str(tmp_path)
    assert GRPOConfig(output_dir=out).gradient_checkpointing is True
    assert GRPOConfig(output_dir=out, activation_checkpointing=False).gradient_checkpointing is False
    both = GRPOConfig(output_dir=out, gradient_checkpointing=False, activation_checkpointing=True)
    assert both.gradient_checkpointing is True
    kwargs = GRPOConfig(
        output_dir=out, gradient_checkpointing_kwargs={"use_reentrant": True}, activation_checkpointing_kwargs={}
    )
    assert kwargs.gradient_checkpointing_kwargs == {}
    parsed = GRPOConfig(output_dir=out, activation_checkpointing_kwargs='{"every_n_layers": 2}')
    assert parsed.gradient_checkpointing_kwargs == {"every_n_layers": 2}


def test_checkpointing_under_fsdp_is_the_plugin_s_or_grpo_s_not_both(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    plugin = types.SimpleNamespace(activation_checkpointing=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    on = types.SimpleNamespace(gradient_checkpointing=True, gradient_checkpointing_kwargs=None)
    with pytest.raises(ValueError, match="FSDP plugin's activation_checkpointing are both on.*twice"):
        enable_checkpointing(model, on, plugin)
    enable_checkpointing(model, types.SimpleNamespace(gradient_checkpointing=False), plugin)
    assert not recomputes_activations(model)  # the plugin wraps the layers when accelerate shards the model
    enable_checkpointing(model, on, types.SimpleNamespace(activation_checkpointing=False))
    assert recomputes_activations(model)


def test_fsdp_plugin_checkpoint_wrappers_count_as_recomputation(tiny_model_dir):
    """accelerate's FSDP activation checkpointing wraps each layer in torch's CheckpointWrapper: the training pass
    must then not share prompts through a KV cache (the recomputation would write it twice)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from grpo.learner.prefix import prefix_sharing_unsupported_reason

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not recomputes_activations(model) and prefix_sharing_unsupported_reason(model) is None
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
    assert recomputes_activations(model) and prefix_sharing_unsupported_reason(model) is not None


# ---- DDP and the process group ---------------------------------------------------------------------------------


def ddp_args(**kw):
    base = dict(
        ddp_find_unused_parameters=None,
        ddp_bucket_cap_mb=None,
        ddp_broadcast_buffers=None,
        ddp_static_graph=None,
        ddp_backend=None,
        ddp_timeout=1800,
    )
    return types.SimpleNamespace(**dict(base, **kw))


def test_kwargs_handlers_map_the_fields_as_the_hf_trainer():
    (group,) = kwargs_handlers(ddp_args())
    assert group.to_kwargs() == {"timeout": timedelta(seconds=1800)}  # always passed; torch's NCCL default: 600 s
    ddp, group = kwargs_handlers(
        ddp_args(
            ddp_find_unused_parameters=True,
            ddp_bucket_cap_mb=7,
            ddp_broadcast_buffers=False,
            ddp_static_graph=True,
            ddp_backend="gloo",
            ddp_timeout=90,
        )
    )
    assert isinstance(ddp, DistributedDataParallelKwargs) and isinstance(group, InitProcessGroupKwargs)
    expected = dict(find_unused_parameters=True, bucket_cap_mb=7, broadcast_buffers=False, static_graph=True)
    assert ddp.to_kwargs() == expected
    assert group.to_kwargs() == {"backend": "gloo", "timeout": timedelta(seconds=90)}
    assert kwargs_handlers(ddp_args(), cpu_deepspeed=True)[0].backend == "gloo"  # DeepSpeed on CPUs
    assert kwargs_handlers(ddp_args(ddp_backend="mpi"), cpu_deepspeed=True)[0].backend == "mpi"


def test_a_one_process_accelerator_gets_the_handlers(tmp_path):
    from grpo.learner.acceleration import make_accelerator

    accelerator = make_accelerator(cfg(tmp_path, ddp_find_unused_parameters=True, ddp_bucket_cap_mb=3, ddp_timeout=60))
    assert accelerator.ddp_handler.to_kwargs() == {"find_unused_parameters": True, "bucket_cap_mb": 3}
    assert accelerator.init_handler.timeout == timedelta(seconds=60)


def test_two_processes_use_the_ddp_fields_and_their_own_token_counts(tiny_model_dir, tmp_path):
    """torchrun, 2 CPU processes: DDP is built with the fields' values, the process group with gloo and the
    timeout, and with average_tokens_across_devices=False each process's loss divides by its own token count
    (num_items_in_batch = its tokens x 2 processes, which LossScale divides by 2)."""
    from support.launch import job_script, torchrun

    torchrun(2, job_script("ddp_fields_job.py"), tmp_path, tiny_model_dir)
    rows = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for row in rows:
        assert (row["world"], row["wrapper"], row["steps"]) == (2, "DistributedDataParallel", 1)
        assert row["find_unused_parameters"] is True and row["broadcast_buffers"] is False
        assert row["bucket_bytes_cap"] == 1024 * 1024
        assert (row["backend"], row["timeout_s"]) == ("gloo", 123.0)
        ((local, items),) = row["counted"]
        assert items == 2 * local and LossScale(items, processes=2).token_divisor() == local


def test_loss_tokens_across_processes_or_each_process_s_own():
    from grpo.distributed.collectives import loss_tokens

    class TwoProcesses:  # this process has 3 trained tokens, the other 5
        num_processes = 2

        def reduce(self, tensor, reduction):
            assert reduction == "sum"
            return tensor + 5

    # dapo divides a process's token sum by N / P x GA / steps_per_generation
    assert LossScale(loss_tokens(TwoProcesses(), torch.tensor(3.0), True), processes=2).token_divisor() == 4.0
    assert LossScale(loss_tokens(TwoProcesses(), torch.tensor(3.0), False), processes=2).token_divisor() == 3.0


# ---- reward columns --------------------------------------------------------------------------------------------


def score(rewards: RewardFunctions, examples):
    n = len(examples)
    rollout = Rollout(
        prompt_ids=[[1]] * n, completion_ids=[[2, 3]] * n, sampling_logps=[[0.0, 0.0]] * n, truncated=[False] * n
    )
    state = types.SimpleNamespace(log_history=[], global_step=0)
    return rewards(examples, rollout, state, lambda *a: None, lambda *a: None)


def test_remove_unused_columns_keeps_only_prompt_and_image_columns():
    seen = {}

    def spy(completions, **kwargs):
        seen.update(kwargs)
        return [1.0] * len(completions)

    examples = [{"prompt": "p", "image": "img", "solution": "4"}] * 2
    score(RewardFunctions([spy], None, keep_columns=("image", "images")), examples)
    assert "image" in seen and "solution" not in seen and "prompts" in seen
    seen.clear()
    score(RewardFunctions([spy], None), examples)
    assert seen["solution"] == ["4", "4"]

    def optional(completions, solution=None, **kwargs):  # a default: the function expects it may be absent
        assert solution is None
        return [0.0] * len(completions)

    score(RewardFunctions([optional], None, keep_columns=("image",)), examples)

    def reads(completions, **kwargs):
        return [float(s) for s in kwargs["solution"]]

    with pytest.raises(RewardFunctionError, match=r"'reads' raised KeyError: 'solution'.*remove_unused_columns=False"):
        score(RewardFunctions([reads], None, keep_columns=("image",)), examples)


# ---- optimizers and schedule -----------------------------------------------------------------------------------


def optimizer_for(tiny_model_dir, tmp_path, **kw):
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=cfg(tmp_path, **kw)
    )
    return trainer.optimizer.optimizer


@pytest.mark.parametrize(
    "optim, optim_args, cls, expected",
    [
        ("adamw_torch", None, "AdamW", {"fused": None, "betas": (0.9, 0.999)}),
        ("adamw_torch_fused", None, "AdamW", {"fused": True}),
        ("sgd", "momentum=0.9", "SGD", {"momentum": 0.9}),
        ("adagrad", None, "Adagrad", {"lr": 1e-2}),
        ("rmsprop", "alpha=0.9", "RMSprop", {"alpha": 0.9}),
        ("adafactor", None, "Adafactor", {"relative_step": False, "scale_parameter": False}),
    ],
)
def test_optim_builds_the_named_optimizer(tiny_model_dir, tmp_path, optim, optim_args, cls, expected):
    optimizer = optimizer_for(tiny_model_dir, tmp_path, optim=optim, optim_args=optim_args, weight_decay=0.1)
    assert type(optimizer).__name__ == cls
    assert {k: optimizer.defaults[k] for k in expected} == expected
    decays = sorted({g["weight_decay"] for g in optimizer.param_groups})
    assert decays == [0.0, 0.1]  # no decay on biases and norms


def test_unsupported_and_missing_optimizers_are_clear_errors(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="optim='lomo' is not supported by grpo"):
        cfg(tmp_path, optim="lomo")
    with pytest.raises(ValueError, match="optim='adamw_torh' is not an optimizer name; did you mean 'adamw_torch'"):
        cfg(tmp_path, optim="adamw_torh")
    with pytest.raises(ValueError, match="SGD takes no argument 'betas'"):
        optimizer_for(tiny_model_dir, tmp_path, optim="sgd", optim_args="betas=1")
    if importlib.util.find_spec("bitsandbytes") is None:
        with pytest.raises(ValueError, match="optim='adamw_8bit' needs a package that is not installed.*bitsandbytes"):
            optimizer_for(tiny_model_dir, tmp_path, optim="adamw_8bit")


@pytest.mark.parametrize(
    "kw, expected",
    [
        (dict(warmup_steps=0.3), [0, 1 / 3, 2 / 3, 1, 6 / 7, 5 / 7, 4 / 7, 3 / 7, 2 / 7, 1 / 7]),  # ceil(0.3 x 10) = 3
        (dict(warmup_ratio=0.1), [0, 1, 8 / 9, 7 / 9, 6 / 9, 5 / 9, 4 / 9, 3 / 9, 2 / 9, 1 / 9]),  # 1 step
        (dict(warmup_steps=2, lr_scheduler_type="constant_with_warmup"), [0, 0.5, 1, 1, 1, 1, 1, 1, 1, 1]),
        (
            dict(lr_scheduler_type="cosine", lr_scheduler_kwargs={"num_cycles": 1.0}),
            [0.5 * (1 + math.cos(2 * math.pi * k / 10)) for k in range(10)],
        ),
    ],
)
def test_schedule_values(tiny_model_dir, tmp_path, kw, expected):
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, max_steps=10, **kw),
    )
    factor = trainer.lr_scheduler.lr_lambdas[0]
    assert [factor(k) for k in range(10)] == pytest.approx(expected, abs=1e-12)
