"""Asynchronous generation (`grpo.rounds.asynchronous`): the producer thread samples round q from the learner's policy
of round q - max_staleness, so a run does not depend on timing; the behaviour policy's log-probs are the old_logps; a
resume is bit-identical whenever the run was killed (SIGKILL or SIGTERM, at random moments); a producer that fails or
stalls stops training with one error; every trainer feature runs async."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import tempfile
import threading
import time

import pytest
import torch

from grpo import GRPOTrainer
from grpo.checkpoint import CheckpointError
from grpo.config.grpo_fields import LOSS_TYPES
from grpo.learner.optimization import TrainingError
from support import zygote
from support.launch import ahead, job_env, job_script
from support.rewards import length_reward, text_of
from support.runs import cfg, chat_dataset, params, untimed

JOB = job_script("async_job.py")


def run(tmp_path, name, reward=length_reward, dataset=None, prepare=None, **kw):
    args = cfg(tmp_path / name, **{"max_steps": 4, "logging_steps": 1, "async_generation": True, **kw})
    trainer = GRPOTrainer(model=MODEL[0], reward_funcs=reward, train_dataset=dataset or chat_dataset(), args=args)
    if prepare is not None:
        prepare(trainer)
    trainer.train()
    return trainer


MODEL: list[str] = []


@pytest.fixture(autouse=True)
def _model(tiny_model_dir):
    MODEL[:] = [tiny_model_dir]


def assert_same_run(a, b, resumed=False):
    pa, pb = params(a.model), params(b.model)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert untimed(a.state.log_history, resumed) == untimed(b.state.log_history, resumed)


def jittered(trainer):
    """Random sleeps in the producer's generations and the learner's micro-steps: other timings, same run."""
    jitter = random.Random(1)
    engine = trainer.parts.rounds.producer.engine
    generate, loss = engine.generate, trainer._loss_and_backward
    engine.generate = lambda requests: time.sleep(jitter.uniform(0, 0.05)) or generate(requests)
    trainer._loss_and_backward = lambda batch: time.sleep(jitter.uniform(0, 0.05)) or loss(batch)


def test_the_same_seed_gives_the_same_run_whatever_the_timing(tmp_path):
    plain = run(tmp_path, "a", max_steps=5, max_staleness=2)
    shaken = run(tmp_path, "b", max_steps=5, max_staleness=2, prepare=jittered)
    assert_same_run(plain, shaken)
    assert any(row["loss"] != 0 for row in plain.state.log_history if "loss" in row)


def test_round_q_samples_the_policy_the_learner_had_at_round_q_minus_s(tmp_path):
    seen = []

    def reward(completions, trainer_state, **kwargs):
        seen.append(trainer_state.global_step)  # the publication's state: its optimizer step
        return length_reward(completions)

    trainer = run(tmp_path, "a", reward=reward, max_steps=6, max_staleness=2)
    assert seen[:6] == [0, 0, 0, 1, 2, 3]  # round q: the policy after step max(q - 2, 0)
    rows = [row for row in trainer.state.log_history if "sample/staleness_mean" in row]
    assert [row["sample/staleness_mean"] for row in rows] == [0, 1, 2, 2, 2, 2]
    assert all(row["sample/staleness_max"] == row["sample/staleness_mean"] for row in rows)
    assert all(row["timing/learner_wait_s"] >= 0 and row["timing/producer_wait_s"] >= 0 for row in rows)


def test_the_behaviour_policy_is_the_old_policy_importance_weights_one_on_policy(tmp_path):
    trainer = run(tmp_path, "a", max_staleness=0)
    rows = [row for row in trainer.state.log_history if "sample/importance_weight_mean" in row]
    assert rows and all(abs(row["sample/importance_weight_max"] - 1) < 1e-4 for row in rows)  # float32 rounding only
    stale = run(tmp_path, "b", max_staleness=1)
    weights = [row["sample/importance_weight_max"] for row in stale.state.log_history[1:-1]]
    assert any(abs(w - 1) > 1e-3 for w in weights)  # one step behind: the weight sees the update


def test_the_learner_trains_on_the_behaviour_log_probs_not_its_own(tmp_path):
    trainer = GRPOTrainer(
        model=MODEL[0],
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, async_generation=True, max_staleness=1),
    )
    taken = []
    original = trainer._add_old_and_ref_logps
    trainer._add_old_and_ref_logps = lambda batch, old=True: taken.append(original(batch, old)) or taken[-1]
    passes = []
    for training_pass in (trainer.training_pass, trainer.parts.rounds.training_pass):  # the learner's, the producer's
        logps = training_pass.logps
        training_pass.logps = lambda model, *a, logps=logps: passes.append(model) or logps(model, *a)
    trainer.train()
    batch = taken[0]
    assert batch.old_logps is not None and batch.old_logps.shape == batch.completion_ids.shape
    assert trainer.model not in passes  # the producer scored the snapshot; the learner ran no old-policy pass
    assert trainer.parts.rounds.snapshot in passes


def test_the_samplers_log_probs_as_the_behaviour_policy_skip_the_producers_pass(tmp_path):
    trainer = GRPOTrainer(
        model=MODEL[0],
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, max_steps=3, async_generation=True, async_behaviour_logps="sampler"),
    )
    taken, passes = [], []
    original = trainer._add_old_and_ref_logps
    trainer._add_old_and_ref_logps = lambda batch, old=True: taken.append(original(batch, old)) or taken[-1]
    for training_pass in (trainer.training_pass, trainer.parts.rounds.training_pass):  # the learner's, the producer's
        logps = training_pass.logps
        training_pass.logps = lambda model, *a, logps=logps: passes.append(model) or logps(model, *a)
    trainer.train()
    assert passes == []  # no training pass outside the gradient pass: neither the producer's nor the learner's
    for batch in taken:  # the learner's old policy is the sampler's
        assert torch.equal(batch.old_logps * batch.mask, batch.sampling_logps * batch.mask)
    # the float32 fast engine's log-probs are the training pass's up to rounding: the weight stays near 1 on-policy
    assert abs(trainer.state.log_history[0]["sample/importance_weight_max"] - 1) < 1e-4
    with pytest.raises(ValueError, match="async_behaviour_logps.*'training' or 'sampler'"):
        cfg(tmp_path, async_behaviour_logps="vllm")


def test_a_resume_from_any_checkpoint_is_exact(tmp_path):
    straight = run(tmp_path, "a", max_steps=6, max_staleness=2, save_strategy="steps", save_steps=1)
    checkpoint = os.path.join(straight.args.output_dir, "checkpoint-3")
    saved = json.load(open(os.path.join(checkpoint, "inflight_0.json")))
    assert saved["max_staleness"] == 2 and sorted(saved["publications"]) == ["1", "2"]  # rounds 3, 4 sample them
    args = cfg(tmp_path / "b", max_steps=6, logging_steps=1, async_generation=True, max_staleness=2)
    resumed = GRPOTrainer(model=MODEL[0], reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert_same_run(straight, resumed, resumed=True)


def test_a_checkpoint_resumes_with_its_staleness_or_not_at_all(tmp_path):
    straight = run(tmp_path, "a", max_steps=3, max_staleness=2, save_strategy="steps", save_steps=1)
    checkpoint = os.path.join(straight.args.output_dir, "checkpoint-2")
    args = cfg(tmp_path / "b", max_steps=3, async_generation=True, max_staleness=1)
    other = GRPOTrainer(model=MODEL[0], reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    with pytest.raises(CheckpointError, match="inflight_0.json.*max_staleness=2, this run has 1"):
        other.train(resume_from_checkpoint=checkpoint)
    from safetensors.torch import load_file, save_file

    path = os.path.join(checkpoint, "inflight_0.tensors")
    tensors = load_file(path)
    save_file({("0/not.a.parameter" if i == 0 else k): t for i, (k, t) in enumerate(tensors.items())}, path)
    args = cfg(tmp_path / "c", max_steps=3, async_generation=True, max_staleness=2)
    crafted = GRPOTrainer(model=MODEL[0], reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    with pytest.raises(CheckpointError, match="'0/not.a.parameter'.*not a trained parameter"):
        crafted.train(resume_from_checkpoint=checkpoint)


def test_a_reward_function_that_raises_in_the_producer_stops_training_naming_it(tmp_path):
    def failing(completions, trainer_state, **kwargs):
        if trainer_state.global_step >= 1:
            raise RuntimeError("the grader is down")
        return length_reward(completions)

    with pytest.raises(TrainingError, match="rollout producer failed while generating round 2.*the grader is down"):
        run(tmp_path, "a", reward=failing, max_staleness=1)


def test_a_producer_that_makes_no_progress_stops_training_after_the_heartbeat(tmp_path):
    def stall(trainer):
        engine = trainer.parts.rounds.producer.engine
        generate = engine.generate
        calls = []

        def stuck(requests):
            calls.append(1)
            if len(calls) == 3:
                time.sleep(4)  # no check, no token: a hang
            return generate(requests)

        engine.generate = stuck

    with pytest.raises(TrainingError, match="no progress for .* while generating round 2.*heartbeat_stale_after_s=0.5"):
        run(tmp_path, "a", prepare=stall, heartbeat_stale_after_s=0.5)


def test_a_reward_function_that_hangs_in_the_producer_is_a_stall(tmp_path):
    """Waiting on a hung reward function is no progress: the producer's stall is reported after
    heartbeat_stale_after_s, long before reward_timeout (600 s) would end it."""
    release, calls = threading.Event(), []

    def hangs_in_round_2(completions, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the producer's third round
            release.wait(60)
        return length_reward(completions)

    start = time.monotonic()
    try:
        with pytest.raises(TrainingError, match="no progress for .* while generating round 2"):
            run(tmp_path, "a", reward=hangs_in_round_2, heartbeat_stale_after_s=1.0, reward_timeout=600)
    finally:
        release.set()
    assert time.monotonic() - start < 60  # the stall, not the reward's release or its timeout, ended it


def test_a_slow_reward_function_that_returns_is_progress(tmp_path):
    """Reward functions that each return within heartbeat_stale_after_s, but take longer together, are progress."""

    def slow(completions, **kwargs):
        time.sleep(0.4)
        return length_reward(completions)

    trainer = run(tmp_path, "a", reward=[slow, slow, slow], max_steps=2, heartbeat_stale_after_s=1.0)
    assert trainer.state.global_step == 2


def test_a_stateful_reward_with_evaluations_gives_the_same_run_whatever_the_timing(tmp_path):
    """A reward function that counts its calls, an evaluation every step, max_staleness=2: the producer has made
    every round it may before each evaluation, so the calls come in one order, whether the producer runs ahead (a
    slow learner) or behind (a slow generation)."""

    def counting():
        calls = []

        def reward(completions, **kwargs):
            calls.append(1)
            return [len(calls) % 3 + 0.01 * len(text_of(c)) for c in completions]

        return reward

    def slow_learner(trainer):
        loss = trainer._loss_and_backward
        trainer._loss_and_backward = lambda batch: time.sleep(0.3) or loss(batch)

    def slow_producer(trainer):
        engine = trainer.parts.rounds.producer.engine
        generate = engine.generate
        engine.generate = lambda requests: time.sleep(0.3) or generate(requests)

    evaluated = dict(eval_strategy="steps", eval_steps=1, max_staleness=2, max_steps=4)
    runs = []
    for name, prepare in (("ahead", slow_learner), ("behind", slow_producer)):
        args = cfg(tmp_path / name, logging_steps=1, async_generation=True, **evaluated)
        trainer = GRPOTrainer(
            model=MODEL[0],
            reward_funcs=counting(),
            train_dataset=chat_dataset(),
            eval_dataset=chat_dataset(2),
            args=args,
        )
        prepare(trainer)
        trainer.train()
        runs.append(trainer)
    assert_same_run(*runs)


# ---- killed at random moments, then resumed (separate processes) ----------------------------------------------


def job(out, resume, kill=None, delay=0.0):
    """async_job.py (a process forked from the session's zygote); with `kill`, that signal once checkpoint-1 exists
    and `delay` more seconds have passed. Returns (status, stderr, seconds from checkpoint-1 to the end)."""
    argv = [JOB, str(out), MODEL[0], str(int(resume))]
    env = job_env()
    with tempfile.TemporaryFile("w+") as stderr:
        proc = zygote.fork(argv, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        first = os.path.join(out, "checkpoint-1")
        while not os.path.exists(first) and proc.poll() is None:
            time.sleep(0.005)
        saved = time.monotonic()
        if kill is not None:
            time.sleep(delay)
            proc.send_signal(kill)
        proc.wait(timeout=600)
        stderr.seek(0)
        return proc.returncode, stderr.read(), time.monotonic() - saved


def outcome(out):
    rows = json.load(open(os.path.join(out, "log_history.json")))
    return torch.load(os.path.join(out, "final_params.pt")), untimed(rows, resumed=True)


@pytest.fixture(scope="module")
def straight_job(tiny_model_dir, tmp_path_factory):
    MODEL[:] = [tiny_model_dir]
    out = tmp_path_factory.mktemp("straight")
    status, stderr, seconds = job(out, False)
    assert status == 0, stderr[-3000:]
    return outcome(out), seconds


SEEDS = [0, 1, 2, 3]
KILLS = [signal.SIGKILL, signal.SIGTERM]


@pytest.fixture(scope="module")
def killed_runs(request, tmp_path_factory, straight_job):
    """Every kill-and-resume scenario of the tests this session runs, two at a time (`support.ahead`): the killed
    run's (status, stderr, seconds), the resumed one's, and the run's directory."""
    _, seconds = straight_job

    def scenario(kill, seed):
        out = tmp_path_factory.mktemp("run") / "run"
        delay = random.Random(seed).uniform(0, 0.8 * seconds)  # a moment of steps 2-8 (generation, step, save, ...)
        return lambda: (job(out, False, kill, delay), job(out, True), out)

    return ahead(
        request,
        {
            f"test_killed_at_a_random_moment_then_resumed_is_bit_identical[{int(kill)}-{seed}]": scenario(kill, seed)
            for kill in KILLS
            for seed in SEEDS
        },
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kill", KILLS)
def test_killed_at_a_random_moment_then_resumed_is_bit_identical(request, straight_job, killed_runs, seed, kill):
    (params_ref, rows_ref), _ = straight_job
    (status, stderr, _), resumed_job, out = killed_runs[request.node.name].result()
    # SIGTERM while training saves and exits 143; one after training (the final files) ends the process as usual
    assert status in ((-signal.SIGKILL,) if kill == signal.SIGKILL else (143, -signal.SIGTERM)), stderr[-3000:]
    status, stderr, _ = resumed_job
    assert status == 0, stderr[-3000:]
    resumed, rows = outcome(out)
    assert all(torch.equal(resumed[n], params_ref[n]) for n in params_ref)
    assert rows == rows_ref


# ---- every trainer feature, async: the same run twice, the second with other timings ---------------------------


def lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")


FEATURES = {
    **{f"loss {name}": dict(loss_type=name) for name in LOSS_TYPES if name not in ("luspo", "vespo")},
    "loss luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "loss vespo": dict(loss_type="vespo"),
    "dapo with clip-higher": dict(loss_type="dapo", epsilon_high=0.28),
    "sequence-level (GSPO)": dict(importance_sampling_level="sequence"),
    "beta": dict(beta=0.04),
    "reused batches": dict(num_iterations=2, steps_per_generation=2, per_device_train_batch_size=4),
    "accumulation": dict(gradient_accumulation_steps=2, per_device_train_batch_size=4),
    "dynamic sampling": dict(dynamic_sampling=True),
    "weight_sync_steps": dict(weight_sync_steps=2, max_staleness=1),
    "sampler log-probs": dict(async_behaviour_logps="sampler"),
    "bf16": dict(bf16=True),
    "evaluation": dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8),
    "LoRA": dict(peft_config=lora()),
}
TRAINER_ARGS = ("peft_config",)


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_every_feature_trains_async_and_reproducibly(tmp_path, feature):
    kw = dict(FEATURES[feature])
    extra = {k: kw.pop(k) for k in TRAINER_ARGS if k in kw}
    if feature == "evaluation":
        extra["eval_dataset"] = chat_dataset(4)

    def make(name, prepare=None):
        args = cfg(tmp_path / name, max_steps=4, logging_steps=1, async_generation=True, **kw)
        trainer = GRPOTrainer(
            model=MODEL[0], reward_funcs=length_reward, train_dataset=chat_dataset(), args=args, **extra
        )
        before = params(trainer.model)
        if prepare is not None:
            prepare(trainer)
        trainer.train()
        return trainer, before

    first, before = make("a")
    second, _ = make("b", jittered)
    assert_same_run(first, second)
    after = params(first.model)
    assert any(not torch.equal(after[n], before[n]) for n in before)
    rows = [row for row in first.state.log_history if "loss" in row]
    assert len(rows) == 4 and all(math.isfinite(row["loss"]) for row in rows)
    assert "sample/staleness_mean" in rows[0] and "sample/importance_weight_mean" in rows[-1]
    if feature == "evaluation":
        assert sum("eval_reward" in row for row in first.state.log_history) == 2


def test_tools_and_environments_run_in_the_producer(tmp_path):
    from support.agent import Counter, dataset, multiply, tool_tokenizer
    from support.scripted import TurnScript
    from support.tiny import make_model

    def script(text, turn, j):
        return '<tool_call>{"name": "add", "arguments": {"n": ' + str(j) + "}}</tool_call>" if turn == 0 else "done"

    def make(name):
        tok = tool_tokenizer()
        trainer = GRPOTrainer(
            model=make_model(tok, context=4096),
            processing_class=tok,
            reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
            train_dataset=dataset(),
            args=cfg(tmp_path / name, max_steps=3, async_generation=True),
            tools=[multiply],
            environment_factory=Counter,
        )
        trainer.parts.rounds.producer.own_engine = TurnScript(tok, script)  # the producer's engine, scripted
        trainer.train()
        return trainer

    first, second = make("a"), make("b")
    assert_same_run(first, second)
    rows = [row for row in first.state.log_history if "tools/call_frequency" in row]
    assert rows and rows[0]["tools/call_frequency"] == 1.0  # every completion called `add` once
    # the producer's tool loop asks only its own process whether rows still call tools: the learner's loop asks
    # every process (a collective, which a producer thread must not make beside the learner's)
    loop, learners = first.parts.rounds.producer.rollouts.loop, first.parts.rollouts.loop
    assert loop is not learners and loop.any_process is bool and learners.any_process is not bool


def test_image_prompts_train_async_on_the_plain_engine(tmp_path):
    from support.vision import BUILDERS
    from support.vision_runs import image_rows

    def make(name, prepare=None):
        model, processor = BUILDERS["qwen2.5-vl"](0)
        args = cfg(tmp_path / name, per_device_train_batch_size=4, num_generations=4, max_steps=3, logging_steps=1)
        args.async_generation = True
        trainer = GRPOTrainer(
            model=model, processing_class=processor, reward_funcs=length_reward, train_dataset=image_rows(), args=args
        )
        assert trainer.parts.rounds.lock_rng  # transformers' generate draws from torch's global generator
        if prepare is not None:
            prepare(trainer)
        trainer.train()
        return trainer

    assert_same_run(make("a"), make("b", jittered))


# ---- TRL's asynchronous API -------------------------------------------------------------------------------------

TRL_ASYNC_DEFAULTS = dict(  # TRL 1.16's AsyncGRPOConfig, read from its wheel
    max_staleness=4,
    weight_sync_steps=1,
    heartbeat_stale_after_s=300.0,
    learning_rate=1e-6,
    logging_steps=1,
    lr_scheduler_type="constant",
    ignore_data_skip=True,
    dtype="float32",
    max_inflight_tasks=-1,
    queue_maxsize=1024,
    token_budget=None,
    fork_threshold_tokens=1024,
    request_timeout=600,
    weight_sync_timeout=1800,
    vllm_server_base_url=None,
)
TRL_ASYNC_TRAINER_ARGS = [
    "model",
    "reward_funcs",
    "args",
    "train_dataset",
    "processing_class",
    "callbacks",
    "optimizers",
    "peft_config",
    "tools",
    "environment_factory",
    "rollout_worker",
    "weight_transfer",
]


def test_async_grpo_config_has_trls_fields_and_defaults(tmp_path):
    from grpo import AsyncGRPOConfig

    config = AsyncGRPOConfig(output_dir=str(tmp_path))
    for name, default in TRL_ASYNC_DEFAULTS.items():
        if name != "vllm_server_base_url":  # grpo's (GRPOConfig's) default: the host/port fields decide
            assert getattr(config, name) == default, name
    assert config.async_generation and config.model_init_kwargs == {"dtype": "float32"}
    with pytest.raises(ValueError, match="max_inflight_tasks=8 .*; token_budget=4096 .*Leave these at TRL's defaults"):
        AsyncGRPOConfig(output_dir=str(tmp_path), max_inflight_tasks=8, token_budget=4096)
    with pytest.raises(TypeError, match="AsyncGRPOConfig got an unknown argument 'max_stalenes'; did you mean"):
        AsyncGRPOConfig(output_dir=str(tmp_path), max_stalenes=2)
    with pytest.raises(ValueError, match="max_staleness.*>= 0"):
        AsyncGRPOConfig(output_dir=str(tmp_path), max_staleness=-1)


def test_async_grpo_trainer_takes_trls_arguments_and_trains(tmp_path):
    import inspect

    from grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    assert list(inspect.signature(AsyncGRPOTrainer.__init__).parameters)[1:] == TRL_ASYNC_TRAINER_ARGS
    from support.runs import BASE

    args = AsyncGRPOConfig(**{**BASE, "output_dir": str(tmp_path / "out"), "max_steps": 3, "max_staleness": 1})
    trainer = AsyncGRPOTrainer(MODEL[0], length_reward, args=args, train_dataset=chat_dataset())
    trainer.train()
    staleness = [row["sample/staleness_mean"] for row in trainer.state.log_history if "sample/staleness_mean" in row]
    assert staleness == [0, 1, 1]
    with pytest.raises(ValueError, match="rollout_worker .*no counterpart"):
        AsyncGRPOTrainer(MODEL[0], length_reward, args=args, train_dataset=chat_dataset(), rollout_worker=object())


def test_torch_compile_trains_async_with_a_compiled_snapshot_and_reproducibly(tmp_path):
    """The producer's behaviour pass runs the snapshot's own compiled stack (inductor), never swapping the
    learner's forward from its thread; on-policy the importance weight is 1 up to rounding; timing changes nothing."""
    first = run(tmp_path, "a", max_steps=3, max_staleness=0, torch_compile=True)
    learner, producer = first.training_pass.compiled, first.parts.rounds.training_pass.compiled
    assert producer is not None and producer.module is not learner.module
    assert any(m is producer.module for m in first.parts.rounds.snapshot.modules())
    assert "forward" not in vars(learner.module) and "forward" not in vars(producer.module)  # swapped back
    rows = [row for row in first.state.log_history if "sample/importance_weight_max" in row]
    assert len(rows) == 3 and all(abs(row["sample/importance_weight_max"] - 1) < 1e-4 for row in rows)
    second = run(tmp_path, "b", max_steps=3, max_staleness=0, torch_compile=True, prepare=jittered)
    assert_same_run(first, second)


def test_what_async_does_not_do_yet_is_refused_by_name(tmp_path):
    from types import SimpleNamespace

    from grpo.rounds.asynchronous import refuse

    def trainer(processes, **kw):
        args = cfg(tmp_path, async_generation=True, **kw)
        return SimpleNamespace(
            args=args, accelerator=SimpleNamespace(num_processes=processes, state=None), policy=torch.nn.Linear(1, 1)
        )

    refuse(trainer(2))  # an engine per process: several processes run async
    refuse(trainer(2, use_vllm=True, vllm_mode="server"))  # one server: the producers go in lockstep
    with pytest.raises(
        ValueError, match="does not support vllm_tensor_parallel_size=2 with 2 processes .*a vLLM server"
    ):
        refuse(trainer(2, use_vllm=True, vllm_mode="colocate", vllm_tensor_parallel_size=2))


@pytest.mark.parametrize("slow", ["callback", "evaluation"])
def test_a_producer_waiting_for_the_learner_is_not_a_stall(tmp_path, slow):
    """A slow learner (a callback, an evaluation) leaves the producer waiting: no heartbeat alarm (max_staleness 0:
    the learner then waits for each round at once)."""
    from transformers import TrainerCallback

    class Slow(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(1.0)

    def slow_in_evaluation(completions, trainer_state, **kwargs):
        if len(completions) == 2:  # the evaluation's batch (training rounds have 8 rows)
            time.sleep(1.0)
        return length_reward(completions)

    evaluating = slow == "evaluation"
    args = cfg(tmp_path, max_steps=3, async_generation=True, max_staleness=0, heartbeat_stale_after_s=0.5)
    if evaluating:
        args.eval_strategy, args.eval_steps, args.num_generations_eval = "steps", 1, 1
    trainer = GRPOTrainer(
        model=MODEL[0],
        reward_funcs=slow_in_evaluation,
        train_dataset=chat_dataset(),
        eval_dataset=chat_dataset(2) if evaluating else None,
        args=args,
        callbacks=[] if evaluating else [Slow()],
    )
    time.sleep(1.0)  # built, then trained a while later
    trainer.train()
    assert trainer.state.global_step == 3
    assert sum("eval_reward" in row for row in trainer.state.log_history) == (3 if evaluating else 0)
