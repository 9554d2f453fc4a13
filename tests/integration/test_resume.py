"""Checkpoints resume exactly: a run killed (SIGKILL) right after checkpoint-3, or in the middle of writing a
checkpoint, or preempted with SIGTERM, then resumed, ends with parameters bit-identical to a straight run, and
the resumed process trains (and logs) only the remaining steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time

import pytest
import torch
from safetensors.torch import load_file

from grpo import GRPOTrainer
from grpo.checkpoint import CheckpointMismatchError
from support import zygote
from support.launch import ahead, job_env, job_script, needs_deepspeed, torchrun
from support.rewards import length_reward
from support.runs import cfg, chat_dataset
from support.tiny import make_model, make_tokenizer

JOB = job_script("resume_job.py")


def job(out, model, spg, resume, *extra, wait_for=None, send=signal.SIGKILL, status=0):
    """Run resume_job.py (a process forked from the session's zygote); with `wait_for`, send `send` once it prints
    that line. Returns (stderr, seconds from the signal to the exit); the exit status must be `status` (-SIGKILL
    when killed)."""
    argv = [JOB, str(out), model, str(spg), str(int(resume)), *extra]
    env = job_env()
    with tempfile.TemporaryFile("w+") as stderr:
        if wait_for is None:
            proc = zygote.fork(argv, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
            sent = time.monotonic()
        else:
            r, w = os.pipe()
            proc = zygote.fork(argv, env=env, stdout=w, stderr=stderr)
            os.close(w)
            sent = None
            with os.fdopen(r) as stdout:
                for line in stdout:  # to the end: what the job prints after the signal still has a reader
                    if sent is None and line.strip() == wait_for:
                        proc.send_signal(send)
                        sent = time.monotonic()
            if sent is None:  # it ended without printing the line: the status check below says so
                sent = time.monotonic()
        proc.wait(timeout=600)
        stderr.seek(0)
        text = stderr.read()
    expected = status if wait_for is None or send != signal.SIGKILL else -signal.SIGKILL
    assert proc.returncode == expected, text[-3000:]
    return text, (time.monotonic() - sent if wait_for is not None else 0.0)


def two_processes(out, model, spg, resume, *extra):
    """resume_job.py in 2 processes (gloo)."""
    torchrun(2, JOB, out, model, spg, int(resume), *extra, timeout=600)


def steps_logged(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


def final_params(out):
    return torch.load(os.path.join(out, "final_params.pt"))


HUNG = [(1, 3), (2, 5)]  # (steps_per_generation, the step whose reward function hangs)


@pytest.fixture(scope="module")
def runs(request, tiny_model_dir, tmp_path_factory):
    """The processes of this module's one-process tests, two at a time (`support.ahead`), the straight runs first:
    each test's scenario returns the run's directory and what it saw between the killed run and the resumed one."""

    def scenario(name, run, *args):
        out = tmp_path_factory.mktemp(name) / "run"
        return lambda: (out, run(out, tiny_model_dir, *args))

    first = {f"straight{spg}": scenario("straight", straight_run, spg) for spg in (1, 2)}
    scenarios = {
        f"test_sigkill_after_checkpoint_then_resume_is_exact[{spg}]": scenario("sigkill", sigkill_after_checkpoint, spg)
        for spg in (1, 2)
    }
    scenarios["test_kill_while_writing_a_checkpoint_resumes_from_the_previous_one"] = scenario(
        "writing", kill_while_writing
    )
    scenarios["test_sigterm_saves_and_exits_cleanly_then_resumes_exactly"] = scenario("sigterm", sigterm_between_steps)
    for spg, hang_at in HUNG:
        name = f"test_sigterm_during_a_hung_reward_ends_promptly_and_resumes_exactly[{spg}-{hang_at}]"
        scenarios[name] = scenario("hung", sigterm_during_a_hung_reward, spg, hang_at)
    return ahead(request, scenarios, first)


def straight_run(out, model, spg):
    job(out, model, spg, False)
    return final_params(out)


@pytest.fixture(scope="module")
def straight(runs):
    """The uninterrupted 6-step runs, per steps_per_generation."""
    return {spg: runs[f"straight{spg}"].result()[1] for spg in (1, 2)}


def assert_bit_identical(resumed, reference, initial_dir):
    assert resumed.keys() == reference.keys()
    for name in reference:
        assert torch.equal(resumed[name], reference[name]), name


def sigkill_after_checkpoint(out, model, spg):
    job(out, model, spg, False, "--pause-after", "3", wait_for="SAVED")
    killed = dict(files=os.listdir(out), steps=steps_logged(out))
    killed["rollouts"] = os.path.exists(out / "checkpoint-3" / "rollouts_0.pt")
    job(out, model, spg, True)
    return killed


@pytest.mark.parametrize("spg", [1, 2])
def test_sigkill_after_checkpoint_then_resume_is_exact(request, tiny_model_dir, tmp_path, runs, straight, spg):
    out, killed = runs[request.node.name].result()
    # nothing else is left (the report's page is there only if a logging step before the kill had time for it)
    left = sorted(set(killed["files"]) - {"report.html"})
    assert left == [".grpo.lock", "checkpoint-3", "metrics.jsonl", "run_info.json"]
    assert killed["steps"] == [1, 2, 3]
    if spg == 2:  # step 3 is the first half of a generation cycle: the rest of the batch was saved
        assert killed["rollouts"]
    assert steps_logged(out) == [1, 2, 3, 4, 5, 6]  # the resumed process appended steps 4-6 only
    resumed = final_params(out)
    at_3 = GRPOTrainer(
        model=str(out / "checkpoint-3"),
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path / "unused"),
    ).model
    assert any(not torch.equal(resumed[n], p) for n, p in at_3.named_parameters())  # steps 4-6 moved them
    assert_bit_identical(resumed, straight[spg], tiny_model_dir)


def kill_while_writing(out, model):
    job(out, model, 1, False, "--block-writing", "6", wait_for="WRITING")
    killed = dict(files=os.listdir(out), steps=steps_logged(out))
    job(out, model, 1, True)
    return killed


def test_kill_while_writing_a_checkpoint_resumes_from_the_previous_one(request, tiny_model_dir, runs, straight):
    out, killed = runs[request.node.name].result()
    assert "checkpoint-6" not in killed["files"] and ".tmp-checkpoint-6" in killed["files"]
    assert killed["steps"] == [1, 2, 3, 4, 5, 6]
    assert steps_logged(out) == [1, 2, 3, 4, 5, 6]  # rows after checkpoint-3 were dropped, then rewritten
    assert_bit_identical(final_params(out), straight[1], tiny_model_dir)


def sigterm_between_steps(out, model):
    stderr, _ = job(out, model, 1, False, "--term-at", "2", status=143)
    stopped = dict(stderr=stderr, files=os.listdir(out), steps=steps_logged(out))
    stopped["status"] = json.loads((out / "run_info.json").read_text())["status"]
    job(out, model, 1, True)
    return stopped


def test_sigterm_saves_and_exits_cleanly_then_resumes_exactly(request, tiny_model_dir, runs, straight):
    """Preempted between steps: the step finishes, is saved, and the process exits with status 143 (not 0: a
    `train && upload` script must not upload an unfinished run)."""
    out, stopped = runs[request.node.name].result()
    stderr = stopped["stderr"]
    assert "SIGTERM received: the newest checkpoint is" in stderr and "Traceback" not in stderr
    assert "checkpoint-2" in stderr and "status 143" in stderr
    files = [".grpo.lock", "checkpoint-2", "metrics.jsonl", "report.html", "run_info.json"]
    assert sorted(stopped["files"]) == files and stopped["steps"] == [1, 2]
    assert stopped["status"] == "stopped"  # and the report says so
    assert steps_logged(out) == [1, 2, 3, 4, 5, 6]
    assert_bit_identical(final_params(out), straight[1], tiny_model_dir)


def sigterm_during_a_hung_reward(out, model, spg, hang_at):
    stderr, seconds = job(
        out, model, spg, False, "--hang-reward-at", str(hang_at), wait_for="HUNG", send=signal.SIGTERM, status=143
    )
    stopped = dict(stderr=stderr, seconds=seconds, files=os.listdir(out), steps=steps_logged(out))
    job(out, model, spg, True)
    return stopped


@pytest.mark.parametrize("spg, hang_at", HUNG)
def test_sigterm_during_a_hung_reward_ends_promptly_and_resumes_exactly(
    request, tiny_model_dir, runs, straight, spg, hang_at
):
    """The reward function hangs in step N (no time limit would end it soon: the default is 600 s); SIGTERM ends
    the process within seconds with status 143, having saved the state at the end of step N-1 (nothing of step N
    was applied), and resuming from it ends bit-identical to a straight run."""
    out, stopped = runs[request.node.name].result()
    assert stopped["seconds"] < 15, stopped["seconds"]
    assert "SIGTERM received during a step" in stopped["stderr"] and f"checkpoint-{hang_at - 1}" in stopped["stderr"]
    assert f"checkpoint-{hang_at - 1}" in stopped["files"]
    assert stopped["steps"] == list(range(1, hang_at))
    assert steps_logged(out) == [1, 2, 3, 4, 5, 6]
    assert_bit_identical(final_params(out), straight[spg], tiny_model_dir)


def test_checkpoint_that_does_not_fit_is_named(tiny_model_dir, tmp_path):
    args = cfg(tmp_path, save_strategy="steps", save_steps=1)
    GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args).train()
    with pytest.raises(CheckpointMismatchError, match=r"num_generations: checkpoint 4, now 2"):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            args=cfg(tmp_path, num_generations=2, max_steps=2),
        ).train(resume_from_checkpoint=True)
    other = make_model(make_tokenizer(), hidden=64)
    with pytest.raises(CheckpointMismatchError, match=r"does not match the model: shape .*model.embed_tokens.weight"):
        GRPOTrainer(
            model=other,
            processing_class=make_tokenizer(),
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            args=cfg(tmp_path, max_steps=2),
        ).train(resume_from_checkpoint=True)
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        GRPOTrainer(
            model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=cfg(tmp_path / "empty")
        ).train(resume_from_checkpoint=True)


@pytest.mark.parametrize(
    "stage, spg", [(0, 1), pytest.param(2, 1, marks=needs_deepspeed), pytest.param(3, 2, marks=needs_deepspeed)]
)
def test_two_process_checkpoint_resumes_exactly(tiny_model_dir, tmp_path, stage, spg):
    """2 processes (DDP; DeepSpeed ZeRO-2; ZeRO-3): a run that ends abruptly right after checkpoint-3 (under
    DeepSpeed, its optimizer partitions written by every process), resumed by a fresh launch, ends bit-identical
    to the straight 6-step run at the same settings (with steps_per_generation 2, the checkpoint holds the
    buffered rollouts). The learning-rate schedule advances once per step, as in one process."""
    zero = ("--zero", str(stage)) if stage else ()
    straight_out, out = tmp_path / "straight", tmp_path / "run"
    two_processes(straight_out, tiny_model_dir, spg, False, *zero)
    two_processes(out, tiny_model_dir, spg, False, *zero, "--stop-after", "3")
    assert steps_logged(out) == [1, 2, 3] and os.path.isdir(out / "checkpoint-3" / "deepspeed") is bool(stage)
    at_3 = load_file(str(out / "checkpoint-3" / "model.safetensors"))
    two_processes(out, tiny_model_dir, spg, True, *zero)
    assert steps_logged(out) == [1, 2, 3, 4, 5, 6]
    with open(out / "metrics.jsonl") as f:  # linear decay from 1e-2 over 6 steps, logged after each step
        assert [json.loads(line)["learning_rate"] for line in f] == pytest.approx(
            [1e-2 * (6 - k) / 6 for k in range(1, 7)]
        )
    resumed = final_params(out)
    assert any(not torch.equal(resumed[n], t) for n, t in at_3.items())  # steps 4-6 moved them
    assert_bit_identical(resumed, final_params(straight_out), tiny_model_dir)
