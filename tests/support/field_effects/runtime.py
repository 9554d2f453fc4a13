"""Effects of the runtime fields: compilation and precision, checkpointing, DDP and the process group, devices and
seeds, reward columns, the optimizer and schedule, batch sizes, and generation (tests/integration/test_runtime_fields.py
tests them further)."""

from __future__ import annotations

import math
import os
import time
import warnings
from datetime import timedelta
from unittest import mock

import pytest
import torch

from support.field_effects import Setting, effect
from support.runs import chat_dataset


class Recorder:
    """A reward function that keeps what it was called with; its reward is the completion's length / 8."""

    __name__ = "recorder"

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.calls.append(dict(prompts=prompts, completion_ids=completion_ids, columns=set(kwargs)))
        return [len(ids) / 8.0 for ids in completion_ids]


def params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def update_norm(before: dict, trainer) -> float:
    after = params(trainer)
    return math.sqrt(sum(float((after[n] - before[n]).pow(2).sum()) for n in before))


def training_pass_dtypes(trainer) -> list[torch.dtype]:
    """The output dtypes of the policy's first linear layer during the training passes of `trainer.train()`."""
    linear = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Linear))
    seen: list[torch.dtype] = []
    original = trainer.training_pass.train

    def train(*args, **kwargs):
        handle = linear.register_forward_hook(lambda module, inputs, out: seen.append(out.dtype))
        try:
            return original(*args, **kwargs)
        finally:
            handle.remove()

    trainer.training_pass.train = train
    trainer.train()
    return seen


def groups_identical(recorder: Recorder, g: int) -> bool:
    ids = [c for call in recorder.calls for c in call["completion_ids"]]
    return all(ids[i] == ids[i - i % g] for i in range(len(ids)))


# ---- compilation and precision ---------------------------------------------------------------------------------


def _dynamo_frames() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"]


@effect("torch_compile", True)
def _torch_compile(s: Setting):
    # the "eager" backend: dynamo captures the stack's graphs without generating code (inductor: the unit tests)
    frames = _dynamo_frames()
    trainer = s.trainer(torch_compile_backend="eager", learning_rate=0.0)
    assert trainer.training_pass.compiled is not None and not trainer.training_pass.lean_blocks
    trainer.train()
    assert _dynamo_frames() > frames
    plain = s.default_trainer(torch_compile_backend=None, learning_rate=0.0)
    plain.train()  # the same seed: the same completions
    assert trainer.state.log_history[0]["loss"] == pytest.approx(plain.state.log_history[0]["loss"], abs=1e-6)


@effect("torch_compile_backend", "aot_eager")
def _torch_compile_backend(s: Setting):
    assert s.config().torch_compile  # setting the backend turns compilation on, as in transformers
    frames = _dynamo_frames()
    trainer = s.train()
    assert trainer.training_pass.compiled.backend == "aot_eager" and _dynamo_frames() > frames
    with pytest.raises(ValueError, match="torch_compile_backend='no_such' is not a torch.compile backend"):
        Setting(s.field, "no_such", s.tmp_path, s.model_dir).trainer()


@effect("torch_compile_mode", "max-autotune-no-cudagraphs")
def _torch_compile_mode(s: Setting):
    assert s.config().torch_compile  # setting the mode turns compilation on
    real = torch.compile
    with mock.patch.object(torch, "compile", side_effect=real) as spy:
        trainer = s.trainer()  # compiled lazily: building the trainer compiles nothing yet
    assert spy.call_args.kwargs == {"backend": "inductor", "mode": "max-autotune-no-cudagraphs"}
    assert trainer.training_pass.compiled.mode == "max-autotune-no-cudagraphs"
    with pytest.raises(ValueError, match="torch_compile_mode='max-autotune-no-cudagraphs' is an inductor mode"):
        s.trainer(torch_compile_backend="eager")


@effect("tf32", True)
def _tf32(s: Setting):
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        cuda = torch.cuda.is_available()
        if cuda and torch.cuda.get_device_capability() >= (8, 0):
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
            s.trainer()
            assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        else:
            with pytest.warns(UserWarning, match="tf32=True has no effect"):
                s.trainer(use_cpu=True)
            assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == saved
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@effect("fp16", True)
def _fp16(s: Setting):
    if torch.cuda.is_available():  # float16 autocast with loss scaling
        trainer = s.trainer()
        assert trainer.accelerator.mixed_precision == "fp16" and trainer.accelerator.scaler is not None
        assert set(training_pass_dtypes(trainer)) == {torch.float16}
        return
    # accelerate has no float16 autocast on CPUs: float32 throughout (sampling too), and a warning that says so
    with pytest.warns(UserWarning, match="fp16=True has no effect on a CPU"):
        trainer = s.trainer()
    assert trainer.accelerator.mixed_precision == "no" and trainer.engine.compute_dtype is None
    assert set(training_pass_dtypes(trainer)) == {torch.float32}


@effect("bf16", True)
def _bf16(s: Setting):
    trainer = s.trainer()
    assert trainer.accelerator.mixed_precision == "bf16"
    dtypes = training_pass_dtypes(trainer)
    assert dtypes and set(dtypes) == {torch.bfloat16}


# ---- checkpointing and the KV cache ----------------------------------------------------------------------------


def _layers(trainer):
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in trainer.model.modules() if isinstance(m, GradientCheckpointingLayer)]


@effect("gradient_checkpointing", False)
def _gradient_checkpointing(s: Setting):
    from grpo.models.modeling import recomputes_activations

    trainer = s.trainer()
    assert not recomputes_activations(trainer.model) and not any(m.gradient_checkpointing for m in _layers(trainer))
    assert trainer.training_pass.share_prefix  # without recomputation the rows of a prompt share its pass
    default = s.default_trainer()
    assert recomputes_activations(default.model) and not default.training_pass.share_prefix


@effect("gradient_checkpointing_kwargs", {"use_reentrant": True})
def _gradient_checkpointing_kwargs(s: Setting):
    trainer = s.trainer()
    funcs = [m._gradient_checkpointing_func for m in _layers(trainer)]
    assert funcs and all(f.keywords == {"use_reentrant": True} for f in funcs)
    before = params(trainer)
    trainer.train()  # reentrant checkpointing still reaches every parameter's gradient
    after = params(trainer)
    assert all(not torch.equal(before[n], after[n]) for n in before)


@effect("activation_checkpointing", False)
def _activation_checkpointing(s: Setting):
    from grpo.models.modeling import recomputes_activations

    config = s.config()
    assert config.gradient_checkpointing is False  # the new name wins over TRL's default gradient_checkpointing=True
    assert not recomputes_activations(s.trainer().model)


@effect("activation_checkpointing_kwargs", {"every_n_layers": 2, "use_reentrant": False})
def _activation_checkpointing_kwargs(s: Setting):
    trainer = s.trainer()
    # every_n_layers is an option of transformers' method (layers 0, 2, ... are checkpointed), not a checkpoint() key
    assert [m.gradient_checkpointing for m in _layers(trainer)] == [True, False]
    assert all(m._gradient_checkpointing_func.keywords == {"use_reentrant": False} for m in _layers(trainer))
    trainer.train()


@effect("use_cache", True)
def _use_cache(s: Setting):
    from grpo.models.modeling import unwrap

    def caches_kept(trainer) -> list[bool]:
        """Whether the decoder stack returned a KV cache, in each training forward of one row at a time (the pass
        that shares a prompt across its rows keeps a cache whatever use_cache says)."""
        passes = trainer.training_pass
        passes.layouts = tuple(name for name in passes.layouts if name != "shared_prefix")
        kept: list[bool] = []
        hook = unwrap(trainer.model).base_model.register_forward_hook(
            lambda m, i, out: kept.append(out.past_key_values is not None)
        )
        trainer.train()
        hook.remove()
        return kept

    # as in the HF Trainer it sets the models' config.use_cache, which training forwards of padded rows read (under
    # gradient checkpointing transformers turns it off again in training mode; token trees never keep a cache)
    trainer = s.trainer(gradient_checkpointing=False, beta=0.1, packing="padded")
    assert trainer.unwrapped_model.config.use_cache is True and trainer.ref_model.config.use_cache is True
    assert set(caches_kept(trainer)) == {True}
    assert set(caches_kept(s.default_trainer(gradient_checkpointing=False, packing="padded"))) == {False}


# ---- DDP, the process group, devices, seeds --------------------------------------------------------------------


@effect("ddp_find_unused_parameters", True)
def _ddp_find_unused_parameters(s: Setting):
    # the handler accelerate wraps the policy in DDP with (several processes: tests/integration/test_runtime_fields.py)
    assert s.trainer().accelerator.ddp_handler.find_unused_parameters is True
    assert s.default_trainer().accelerator.ddp_handler is None  # DDP's own defaults


@effect("ddp_bucket_cap_mb", 5)
def _ddp_bucket_cap_mb(s: Setting):
    assert s.trainer().accelerator.ddp_handler.to_kwargs() == {"bucket_cap_mb": 5}


@effect("ddp_broadcast_buffers", False)
def _ddp_broadcast_buffers(s: Setting):
    assert s.trainer().accelerator.ddp_handler.to_kwargs() == {"broadcast_buffers": False}


@effect("ddp_static_graph", True)
def _ddp_static_graph(s: Setting):
    assert s.trainer().accelerator.ddp_handler.to_kwargs() == {"static_graph": True}


@effect("ddp_backend", "gloo")
def _ddp_backend(s: Setting):
    assert s.trainer().accelerator.init_handler.backend == "gloo"
    assert "backend" not in s.default_trainer().accelerator.init_handler.to_kwargs()  # accelerate chooses


@effect("ddp_timeout", 60)
def _ddp_timeout(s: Setting):
    assert s.trainer().accelerator.init_handler.timeout == timedelta(seconds=60)
    assert s.default_trainer().accelerator.init_handler.timeout == timedelta(seconds=1800)


@effect("use_cpu", True)
def _use_cpu(s: Setting):
    trainer = s.train()
    assert trainer.accelerator.device.type == "cpu" and next(trainer.model.parameters()).device.type == "cpu"
    if torch.cuda.is_available():  # where there is a GPU, the default uses it
        assert next(s.default_trainer().model.parameters()).device.type == "cuda"


@effect("local_rank", 1)
def _local_rank(s: Setting):
    saved = os.environ.pop("LOCAL_RANK", None)
    try:
        with pytest.warns(UserWarning, match=r"local_rank=1 \(no launcher set LOCAL_RANK.*has no effect"):
            s.config()
        os.environ["LOCAL_RANK"] = "0"
        with pytest.warns(UserWarning, match=r"local_rank=1 \(the launcher's LOCAL_RANK=0 is used\)"):
            s.config()
    finally:
        os.environ.pop("LOCAL_RANK", None)
        if saved is not None:
            os.environ["LOCAL_RANK"] = saved


@effect("seed", 7)
def _seed(s: Setting):
    def completions(trainer_of) -> list:
        recorder = Recorder()
        trainer_of(reward_funcs=recorder).train()
        return recorder.calls[0]["completion_ids"]

    first, again = completions(s.trainer), completions(s.trainer)
    assert first == again  # generation is seeded by `seed` ...
    assert first != completions(s.default_trainer)  # ... and another seed samples other completions


@effect("remove_unused_columns", True)
def _remove_unused_columns(s: Setting):
    from grpo.rewards.calling import RewardFunctionError

    recorder = Recorder()
    s.train(reward_funcs=recorder)
    assert "solution" not in recorder.calls[0]["columns"]  # only the prompt (and image) columns, as in TRL

    def needs_solution(completions, solution, **kwargs):
        return [1.0] * len(completions)

    with pytest.raises(RewardFunctionError, match="'needs_solution' takes the dataset column 'solution'.*False"):
        s.train(reward_funcs=needs_solution)
    default = Recorder()
    s.default_trainer(reward_funcs=default).train()
    assert "solution" in default.calls[0]["columns"]


@effect("average_tokens_across_devices", False)
def _average_tokens_across_devices(s: Setting):
    from grpo.distributed import collectives

    seen = []
    real = collectives.loss_tokens
    with mock.patch.object(collectives, "loss_tokens", side_effect=lambda *a: seen.append(a[2]) or real(*a)):
        s.train()
    assert seen == [False]

    class TwoProcesses:  # this process counts 3 tokens, the other 5
        num_processes = 2

        def reduce(self, tensor, reduction):
            return tensor + 5

    assert real(TwoProcesses(), torch.tensor(3.0), False) == 6.0  # its own tokens, x processes (LossScale / 2)
    assert real(TwoProcesses(), torch.tensor(3.0), True) == 8.0  # every process's


# ---- optimizer and schedule ------------------------------------------------------------------------------------


@effect("max_grad_norm", 0.01)
def _max_grad_norm(s: Setting):
    trainer = s.trainer(optim="sgd", learning_rate=0.1, lr_scheduler_type="constant")
    before = params(trainer)
    trainer.train()
    assert trainer.state.log_history[0]["grad_norm"] > 0.01  # the logged norm is the norm before clipping
    assert update_norm(before, trainer) == pytest.approx(0.1 * 0.01, rel=1e-3)  # SGD: lr x the clipped gradient


@effect("learning_rate", 0.05)
def _learning_rate(s: Setting):
    trainer = s.trainer(optim="sgd", max_grad_norm=0.0, lr_scheduler_type="constant")
    before = params(trainer)
    trainer.train()
    row = trainer.state.log_history[0]
    assert row["learning_rate"] == 0.05
    assert update_norm(before, trainer) == pytest.approx(0.05 * row["grad_norm"], rel=1e-4)


@effect("lr_scheduler_type", "constant")
def _lr_scheduler_type(s: Setting):
    trainer = s.train(max_steps=2)
    assert [row["learning_rate"] for row in trainer.state.log_history] == [1e-2, 1e-2]  # linear: 5e-3, 0


@effect("lr_scheduler_kwargs", {"num_cycles": 1.0})
def _lr_scheduler_kwargs(s: Setting):
    factor = s.trainer(lr_scheduler_type="cosine", max_steps=4).lr_scheduler.lr_lambdas[0]
    assert factor(2) == pytest.approx(0.0, abs=1e-12)  # a whole cosine cycle: 0 half-way (half a cycle: 0.5)
    assert s.default_trainer(lr_scheduler_type="cosine", max_steps=4).lr_scheduler.lr_lambdas[0](2) == 0.5


@effect("warmup_steps", 0.5)
def _warmup_steps(s: Setting):
    factor = s.trainer(max_steps=4).lr_scheduler.lr_lambdas[0]  # ceil(0.5 x 4) = 2 warm-up steps, then linear
    assert [factor(k) for k in range(5)] == [0.0, 0.5, 1.0, 0.5, 0.0]


@effect("warmup_ratio", 0.25)
def _warmup_ratio(s: Setting):
    assert s.config().warmup_steps == 0.25
    factor = s.trainer(max_steps=4).lr_scheduler.lr_lambdas[0]  # ceil(0.25 x 4) = 1 warm-up step
    assert [factor(k) for k in range(5)] == [0.0, 1.0, 2 / 3, 1 / 3, 0.0]


@effect("weight_decay", 0.1)
def _weight_decay(s: Setting):
    # AdamW's decoupled decay: the same gradient step as without it, plus -lr x decay x weight on matrices only
    lr = 1e-2
    with_decay = s.trainer()  # each trainer seeds torch when it is built: build, train, then the next
    start = params(with_decay)
    with_decay.train()
    without = s.default_trainer()
    without.train()
    decayed, plain = params(with_decay), params(without)
    for name, w in start.items():
        expected = plain[name] - lr * 0.1 * w if w.dim() >= 2 else plain[name]
        torch.testing.assert_close(decayed[name], expected, rtol=1e-5, atol=1e-7)


def _adam_group(s: Setting) -> dict:
    trainer = s.train()
    return trainer.optimizer.param_groups[0]


@effect("adam_beta1", 0.5)
def _adam_beta1(s: Setting):
    assert _adam_group(s)["betas"] == (0.5, 0.999)


@effect("adam_beta2", 0.9)
def _adam_beta2(s: Setting):
    assert _adam_group(s)["betas"] == (0.9, 0.9)


@effect("adam_epsilon", 1.0)
def _adam_epsilon(s: Setting):
    # Adam's first step moves each weight by lr x g / (|g| + eps): with eps = 1 (>> |g|) far less than lr
    trainer = s.trainer()
    before = params(trainer)
    trainer.train()
    assert trainer.optimizer.param_groups[0]["eps"] == 1.0
    largest = max(float((params(trainer)[n] - before[n]).abs().max()) for n in before)
    assert largest < 1e-2 * 0.5


@effect("optim", "sgd")
def _optim(s: Setting):
    trainer = s.trainer()
    assert type(trainer.optimizer.optimizer) is torch.optim.SGD
    assert type(s.default_trainer().optimizer.optimizer) is torch.optim.AdamW


@effect("optim_args", "momentum=0.9,nesterov=True")
def _optim_args(s: Setting):
    group = s.trainer(optim="sgd").optimizer.param_groups[0]
    assert (group["momentum"], group["nesterov"]) == (0.9, True)


# ---- batch sizes and lengths -----------------------------------------------------------------------------------


@effect("per_device_train_batch_size", 4)
def _per_device_train_batch_size(s: Setting):
    recorder = Recorder()
    trainer = s.train(reward_funcs=recorder)
    assert trainer.args.generation_batch_size == 4 and [len(c["completion_ids"]) for c in recorder.calls] == [4]


@effect("gradient_accumulation_steps", 2)
def _gradient_accumulation_steps(s: Setting):
    recorder = Recorder()
    trainer = s.train(reward_funcs=recorder)
    assert trainer.parts.loop.micro_step == 2 and trainer.state.global_step == 1
    assert [len(c["completion_ids"]) for c in recorder.calls] == [16]  # one generation feeds both micro-steps


@effect("num_train_epochs", 2.0)
def _num_train_epochs(s: Setting):
    # 8 prompts, 2 per generation of 8 completions: 4 steps an epoch
    assert s.trainer(max_steps=-1).parts.max_steps == 8
    assert s.default_trainer(max_steps=-1).parts.max_steps == 12


@effect("max_steps", 2)
def _max_steps(s: Setting):
    assert s.train().state.global_step == 2


# ---- generation ------------------------------------------------------------------------------------------------


@effect("num_generations", 2)
def _num_generations(s: Setting):
    recorder = Recorder()
    s.train(reward_funcs=recorder)
    prompts = [str(p) for p in recorder.calls[0]["prompts"]]
    assert len(prompts) == 8 and len(set(prompts)) == 4  # 4 prompts, 2 completions each
    assert all(prompts[i] == prompts[i + 1] for i in range(0, 8, 2))


@effect("shuffle_dataset", False)
def _shuffle_dataset(s: Setting):
    recorder = Recorder()
    s.train(reward_funcs=recorder, max_steps=4)  # one epoch: 4 generations of 2 prompts
    firsts = [call["prompts"][0][0]["content"] for call in recorder.calls]
    assert firsts == ["Solve 0+1", "Solve 2+1", "Solve 4+1", "Solve 6+1"]


@effect("generation_batch_size", 16)
def _generation_batch_size(s: Setting):
    recorder = Recorder()
    trainer = s.train(reward_funcs=recorder, max_steps=2)
    assert trainer.args.steps_per_generation == 2
    assert [len(c["completion_ids"]) for c in recorder.calls] == [16]  # one generation for both steps


@effect("steps_per_generation", 2)
def _steps_per_generation(s: Setting):
    recorder = Recorder()
    trainer = s.train(reward_funcs=recorder, max_steps=2)
    assert trainer.args.generation_batch_size == 16
    assert [len(c["completion_ids"]) for c in recorder.calls] == [16]


@effect("temperature", 0.5)
def _temperature(s: Setting):
    from transformers import TemperatureLogitsWarper

    trainer = s.train()
    assert trainer.training_pass.temperature == 0.5  # the trained log-probs are of the sampled distribution
    assert [p.temperature for p in trainer.engine.processors if isinstance(p, TemperatureLogitsWarper)] == [0.5]


@effect("top_p", 0.01)
def _top_p(s: Setting):
    recorder = Recorder()
    s.train(reward_funcs=recorder)  # only the most likely token is left: every group samples one completion
    assert groups_identical(recorder, 4)
    default = Recorder()
    s.default_trainer(reward_funcs=default).train()
    assert not groups_identical(default, 4)


@effect("top_k", 1)
def _top_k(s: Setting):
    recorder = Recorder()
    s.train(reward_funcs=recorder)
    assert groups_identical(recorder, 4)


@effect("min_p", 1.0)
def _min_p(s: Setting):
    recorder = Recorder()
    s.train(reward_funcs=recorder)  # only tokens as likely as the most likely one
    assert groups_identical(recorder, 4)


@effect("generation_kwargs", {"max_new_tokens": 3})
def _generation_kwargs(s: Setting):
    recorder = Recorder()
    trainer = s.train(reward_funcs=recorder)
    assert trainer.engine.name != "fast"  # the plain engine applies arbitrary generation parameters
    assert max(len(ids) for ids in recorder.calls[0]["completion_ids"]) == 3


@effect("chat_template_kwargs", {"hint": "THINK"})
def _chat_template_kwargs(s: Setting):
    from grpo import GRPOTrainer
    from support.tiny import make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.chat_template = "{% if hint %}{{ hint }}{% endif %}" + tokenizer.chat_template

    def first_prompt(config) -> str:
        trainer = GRPOTrainer(
            model=s.model_dir,
            reward_funcs=Recorder(),
            train_dataset=chat_dataset(tasks=False),
            args=config,
            processing_class=tokenizer,
        )
        return tokenizer.decode(trainer.parts.prompts[0].ids)

    assert first_prompt(s.config()).startswith("THINK<|im_start|>user")
    assert first_prompt(s.default_config()).startswith("<|im_start|>user")


@effect("repetition_penalty", 2.0)
def _repetition_penalty(s: Setting):
    from transformers import RepetitionPenaltyLogitsProcessor

    trainer = s.train()
    (penalty,) = [p for p in trainer.engine.processors if isinstance(p, RepetitionPenaltyLogitsProcessor)]
    assert penalty.penalty == 2.0 and trainer.engine.needs_history  # the prompt and completion so far are penalized


@effect("cache_implementation", "static")
def _cache_implementation(s: Setting):
    trainer = s.train()
    assert trainer.engine.name != "fast"  # the fast engine has its own dynamic cache; model.generate honours it
    assert trainer.engine.config.cache_implementation == "static"


@effect("reward_timeout", 0.5)
def _reward_timeout(s: Setting):
    from grpo.rewards.calling import RewardFunctionError

    def slow(completions, **kwargs):
        time.sleep(3)
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"'slow' did not return within 0.5 s"):
        s.train(reward_funcs=slow)


@effect("dynamic_sampling", True)
def _dynamic_sampling(s: Setting):
    def constant(completions, **kwargs):  # no group has spread: every round's groups are dropped
        return [1.0] * len(completions)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = s.train(reward_funcs=constant)
    row = trainer.state.log_history[0]
    assert row["dynamic_sampling/rounds"] == 4 and row["dynamic_sampling/groups_dropped"] == 8


@effect("dynamic_sampling_max_attempts", 2)
def _dynamic_sampling_max_attempts(s: Setting):
    trainer = s.train(dynamic_sampling=True, dynamic_sampling_std_threshold=1e9)  # every group is dropped
    assert trainer.state.log_history[0]["dynamic_sampling/rounds"] == 2


@effect("dynamic_sampling_std_threshold", 1e9)
def _dynamic_sampling_std_threshold(s: Setting):
    # length rewards have spread; a threshold above any spread drops every group anyway
    trainer = s.train(dynamic_sampling=True)
    assert trainer.state.log_history[0]["dynamic_sampling/groups_dropped"] == 8
