"""Trying to break grpo as a careless user or a hostile file would: nothing lost, nothing hangs, nothing runs that
should not. One test (or more) per case of the fault-finding issue; the ones involving signals and exit statuses
are in test_resume.py (SIGTERM between steps and during a hung reward function)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.checkpoint import CheckpointError, CheckpointWriteError
from grpo.models.modeling import ModelLoadError
from grpo.observe.run_dir import OutputDirError, RunDirectoryBusy, RunLock
from grpo.rewards.calling import RewardFunctionError
from support.rewards import length_reward
from support.runs import cfg, chat_dataset
from support.scripted import ScriptedEngine
from support.tiny import make_model, make_tokenizer


def trainer(tiny_model_dir, tmp_path, reward=length_reward, dataset=None, **kw):
    return GRPOTrainer(
        model=tiny_model_dir, reward_funcs=reward, train_dataset=dataset or chat_dataset(), args=cfg(tmp_path, **kw)
    )


def saved_run(tiny_model_dir, tmp_path, steps=3, **kw):
    """A run that saved checkpoint-1 .. checkpoint-<steps>; returns its output_dir."""
    trainer(tiny_model_dir, tmp_path, max_steps=steps, save_strategy="steps", save_steps=1, **kw).train()
    return tmp_path / "out"


def resume(tiny_model_dir, tmp_path, path=True, **kw):
    kw.setdefault("max_steps", 4)
    return trainer(tiny_model_dir, tmp_path, **kw).train(resume_from_checkpoint=path)


# ---- 1. checkpoint rotation never removes the newest --------------------------------------------------------


@pytest.mark.parametrize("limit", [-1, 0])
def test_save_total_limit_below_one_keeps_every_checkpoint(tiny_model_dir, tmp_path, limit):
    assert GRPOConfig(output_dir="x", save_total_limit=limit).save_total_limit is None  # the HF Trainer's meaning
    out = saved_run(tiny_model_dir, tmp_path, save_total_limit=limit)
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint")) == [f"checkpoint-{i}" for i in (1, 2, 3)]


def test_rotation_keeps_the_newest(tiny_model_dir, tmp_path):
    out = saved_run(tiny_model_dir, tmp_path, save_total_limit=1)
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint")) == ["checkpoint-3"]


# ---- 2. nothing in a checkpoint can run code -----------------------------------------------------------------


class Payload:
    """Unpickling this runs code: it creates the file named in the marker."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("name", ["rng_state_0.pt", "optimizer.pt", "scheduler.pt", "rollouts_0.pt"])
def test_a_crafted_pickle_in_a_checkpoint_never_runs(tiny_model_dir, tmp_path, name):
    out = saved_run(tiny_model_dir, tmp_path, steps=1, per_device_train_batch_size=4, steps_per_generation=2)
    marker = tmp_path / "pwned"
    with open(out / "checkpoint-1" / name, "wb") as f:
        pickle.dump({"state": Payload(marker)}, f)
    with pytest.raises(CheckpointError, match=rf"{name} cannot be read as .*There is no older complete checkpoint"):
        resume(tiny_model_dir, tmp_path, per_device_train_batch_size=4, steps_per_generation=2)
    assert not marker.exists()


# ---- 3. one run per output_dir -------------------------------------------------------------------------------


def test_a_second_run_in_the_same_output_dir_is_refused(tiny_model_dir, tmp_path):
    first = trainer(tiny_model_dir, tmp_path)
    lock = RunLock(first.args.output_dir)
    lock.acquire()  # as the other run would hold it while it trains
    try:
        with pytest.raises(RunDirectoryBusy, match=rf"in use by another grpo run \(pid {os.getpid()} on "):
            first.train()
        assert not (tmp_path / "out" / "metrics.jsonl").exists()  # refused before anything was written
    finally:
        lock.release()
    first.train()  # free again
    assert first.state.global_step == 1


def test_a_lock_left_by_a_killed_run_is_not_in_the_way(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    code = (
        f"from grpo.observe.run_dir import RunLock; RunLock({str(out)!r}).acquire(); print('HELD', flush=True); input()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    assert holder.stdout.readline().strip() == "HELD"
    with pytest.raises(RunDirectoryBusy, match=f"pid {holder.pid}"):
        trainer(tiny_model_dir, tmp_path).train()
    holder.kill()
    holder.wait()
    assert trainer(tiny_model_dir, tmp_path).train().global_step == 1


# ---- 4. a full disk while saving -----------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 1.5 MB tmpfs (root only): room for about two checkpoints of the tiny model."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_removes_the_partial_checkpoint_and_names_the_last_complete_one(tiny_model_dir, small_disk):
    args = cfg(small_disk, output_dir=str(small_disk / "out"), max_steps=8, save_strategy="steps", save_steps=1)
    run = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    with pytest.raises(CheckpointWriteError, match=r"No space left on the device while writing checkpoint-(\d+)") as e:
        run.train()
    failed = int(e.value.args[0].split("checkpoint-")[1].split()[0])
    assert f"the last complete checkpoint is {small_disk / 'out' / f'checkpoint-{failed - 1}'}" in str(e.value)
    left = os.listdir(small_disk / "out")
    assert not [p for p in left if p.startswith(".tmp-")]  # the partial write is gone
    assert f"checkpoint-{failed - 1}" in left
    # and the last complete checkpoint still resumes (after room is made)
    for older in [p for p in left if p.startswith("checkpoint-") and p != f"checkpoint-{failed - 1}"]:
        shutil.rmtree(small_disk / "out" / older)
    args = cfg(small_disk, output_dir=str(small_disk / "out"), max_steps=failed, save_strategy="no")
    again = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    assert again.train(resume_from_checkpoint=True).global_step == failed


# ---- 5, 6. missing, corrupt or hand-edited checkpoint files --------------------------------------------------


def test_a_missing_rollouts_file_mid_cycle_is_refused(tiny_model_dir, tmp_path):
    kw = dict(per_device_train_batch_size=4, steps_per_generation=2)
    out = saved_run(tiny_model_dir, tmp_path, steps=1, **kw)
    os.remove(out / "checkpoint-1" / "rollouts_0.pt")
    with pytest.raises(CheckpointError, match="rollouts_0.pt: missing, but step 1 falls inside a generation cycle"):
        resume(tiny_model_dir, tmp_path, **kw)


@pytest.mark.parametrize(
    "name, content",
    [
        ("optimizer.pt", b"PK\x03\x04 not a zip"),
        ("scheduler.pt", b""),
        ("rng_state_0.pt", b"\x80\x04"),
        ("trainer_state.json", b'{"global_step": '),
        ("model.safetensors", b"\x00" * 10),
    ],
)
def test_a_corrupt_file_is_named_with_the_checkpoint_to_use_instead(tiny_model_dir, tmp_path, name, content):
    out = saved_run(tiny_model_dir, tmp_path, steps=2)
    (out / "checkpoint-2" / name).write_bytes(content)
    with pytest.raises(CheckpointError, match=rf"{name} .*The next-newest complete checkpoint is .*checkpoint-1"):
        resume(tiny_model_dir, tmp_path, path=str(out / "checkpoint-2"))
    assert resume(tiny_model_dir, tmp_path, path=str(out / "checkpoint-1"), max_steps=2).global_step == 2


@pytest.mark.parametrize(
    "step, problem",
    [
        (0, "global_step is 0, but the directory is checkpoint-2"),
        (-1, "global_step is -1; it must be a whole number"),
        ("2", "global_step is '2'; it must be a whole number"),
        (3, "global_step is 3, but the directory is checkpoint-2"),
        (2.0, "global_step is 2.0; it must be a whole number"),
    ],
)
def test_hand_edited_step_numbers_are_refused(tiny_model_dir, tmp_path, step, problem):
    out = saved_run(tiny_model_dir, tmp_path, steps=2)
    path = out / "checkpoint-2" / "trainer_state.json"
    state = json.loads(path.read_text())
    state["global_step"] = step
    path.write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=problem):
        resume(tiny_model_dir, tmp_path)


def test_a_checkpoint_past_max_steps_is_refused(tiny_model_dir, tmp_path):
    saved_run(tiny_model_dir, tmp_path, steps=3)
    with pytest.raises(CheckpointError, match=r"global_step is 3, past this run's max_steps \(2\)"):
        resume(tiny_model_dir, tmp_path, max_steps=2)


# ---- 7. reward functions that hang ---------------------------------------------------------------------------


def test_a_hung_reward_function_is_reported_by_name(tiny_model_dir, tmp_path):
    def stuck_reward(completions, **kwargs):
        time.sleep(60)

    started = time.monotonic()
    with pytest.raises(RewardFunctionError, match=r"'stuck_reward' did not return within 1 s \(GRPOConfig.reward_"):
        trainer(tiny_model_dir, tmp_path, reward=stuck_reward, reward_timeout=1).train()
    assert time.monotonic() - started < 30


def test_a_hung_async_reward_function_is_reported_by_name(tiny_model_dir, tmp_path):
    import asyncio

    async def stuck_async(completions, **kwargs):
        await asyncio.sleep(60)

    with pytest.raises(RewardFunctionError, match=r"'stuck_async' did not return within 1 s"):
        trainer(tiny_model_dir, tmp_path, reward=[length_reward, stuck_async], reward_timeout=1).train()


def test_a_raising_reward_is_reported_without_waiting_for_a_hung_async_one(tiny_model_dir, tmp_path):
    import asyncio

    async def stuck_async(completions, **kwargs):
        await asyncio.sleep(3600)

    def broken(completions, **kwargs):
        raise KeyError("solution")

    started = time.monotonic()
    with pytest.raises(RewardFunctionError, match=r"'broken' raised KeyError"):
        trainer(tiny_model_dir, tmp_path, reward=[stuck_async, broken], reward_timeout=None).train()
    assert time.monotonic() - started < 30


# ---- 8. reward functions cannot change what is trained -------------------------------------------------------


def test_a_reward_that_edits_its_arguments_changes_nothing(tiny_model_dir, tmp_path):
    def vandal(completions, completion_ids, prompts, trainer_state, **kwargs):
        rewards = length_reward(completions)
        for ids in completion_ids:
            ids[:] = [42] * len(ids)
        completions.clear()
        prompts[0].append({"role": "user", "content": "injected"})
        trainer_state.global_step = 1000
        trainer_state.log_history.append({"step": -1})
        return rewards

    def honest(completions, **kwargs):
        return length_reward(completions)

    runs = {}
    for name, rewards in (("vandal", [vandal, honest]), ("honest", [honest, honest])):
        data = [dict(row) for row in chat_dataset()]  # plain dicts: a reward could reach them if handed as they are
        run = trainer(tiny_model_dir, tmp_path / name, reward=rewards, dataset=data, max_steps=2)
        run.engine = ScriptedEngine(run.processing_class)
        run.train()
        runs[name] = run
    assert runs["vandal"].state.global_step == 2 and runs["vandal"].state.log_history[0]["step"] == 1
    assert chat_dataset()[0]["prompt"] == runs["vandal"].train_dataset[0]["prompt"]
    for (name, p), q in zip(runs["vandal"].model.named_parameters(), runs["honest"].model.parameters()):
        assert torch.equal(p, q), name
    # the second function saw the rewards' arguments untouched
    assert (
        runs["vandal"].state.log_history[-1]["rewards/honest/mean"]
        == runs["honest"].state.log_history[-1]["rewards/honest/mean"]
    )


# ---- 9. numbers that are finite in Python but not in float32 -------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("learning_rate", float("inf")),
        ("reward_weights", [float("nan")]),
        ("temperature", float("inf")),
        ("beta", 1e39),
        ("max_grad_norm", -1e40),
    ],
)
def test_config_numbers_must_be_finite_in_float32(field, value):
    with pytest.raises(ValueError, match=rf"GRPOConfig.{field} is .*finite number within float32's range"):
        GRPOConfig(output_dir="x", **{field: value})


def test_a_reward_beyond_float32_is_an_error_and_metrics_stay_valid_json(tiny_model_dir, tmp_path):
    def huge(completions, **kwargs):
        return [1e39] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"'huge' returned 1e\+39 for sample 0; .*finite in float32"):
        trainer(tiny_model_dir, tmp_path, reward=huge).train()

    def logs_infinity(completions, log_metric, **kwargs):
        log_metric("my/infinite", float("inf"))
        return length_reward(completions)

    trainer(tiny_model_dir, tmp_path, reward=logs_infinity).train()
    text = (tmp_path / "out" / "metrics.jsonl").read_text()
    row = json.loads(text.splitlines()[-1], parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))
    assert row["my/infinite"] is None


# ---- 10. dataset problems, found before training -------------------------------------------------------------


def rows(n=8, **changes):
    data = [{"prompt": [{"role": "user", "content": f"Solve {i}+1"}]} for i in range(n)]
    for i, row in changes.items():
        data[int(i[1:])] = row
    return data


@pytest.mark.parametrize(
    "dataset, problem",
    [
        (rows(r3={"prompt": ""}), "row 3: the prompt is empty"),
        (rows(r5={"question": "hi"}), "row 5 has no 'prompt'"),
        (rows(r2={"prompt": [{"role": "user"}]}), r"row 2: message 0 of the prompt \(user\) has no text 'content'"),
        (rows(r1={"prompt": [{"content": "hi"}]}), "row 1: message 0 of the prompt has no 'role'"),
        (rows(r4={"prompt": 42}), "row 4: the prompt is int 42"),
        (Dataset.from_list([{"prompt": "hi", "completions": "x"}] * 8), "has a 'completions' column, but reward"),
    ],
)
def test_dataset_problems_are_named_at_construction(tiny_model_dir, tmp_path, dataset, problem):
    with pytest.raises(ValueError, match=problem):
        trainer(tiny_model_dir, tmp_path, dataset=dataset)


def test_a_tool_calling_turn_without_content_is_a_valid_prompt_message():
    from grpo.data.prompts import check_dataset

    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
    check_dataset(rows(r0={"prompt": [{"role": "user", "content": "hi"}, call, {"role": "tool", "content": "1"}]}))


def test_a_prompt_longer_than_the_context_is_named(tiny_model_dir, tmp_path, caplog):
    long = rows(r6={"prompt": "x" * 600})  # character-level tokenizer, 512 positions
    run = trainer(tiny_model_dir, tmp_path, dataset=long, max_steps=4, shuffle_dataset=False)
    with pytest.raises(ValueError, match="row 6: the prompt is 600 tokens, but the model's context is 512"):
        run.train()
    near = rows(r0={"prompt": "x" * 500})
    with caplog.at_level("WARNING", logger="grpo"):
        trainer(tiny_model_dir, tmp_path / "b", dataset=near, shuffle_dataset=False, max_completion_length=32).train()
    assert "row 0: the prompt (500 tokens) plus max_completion_length (32) exceeds the model's context" in caplog.text


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_completions_are_capped_at_the_positions_a_prompt_leaves(tmp_path, caplog, positions):
    """A prompt near the context: completions stop at the last position (a learned 64-position table has no row
    past it; a RoPE model was never trained there), said once; training goes on."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from support.tiny import make_model, make_tokenizer

    tok = make_tokenizer()
    if positions == "learned":
        ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tok), n_positions=64, **ids))
        context, prompt_length = 64, 60
    else:
        model, context, prompt_length = make_model(tok, context=512), 512, 511
    data = Dataset.from_list([{"prompt": "x" * prompt_length}] * 8)
    args = cfg(tmp_path, max_completion_length=8, max_steps=1, shuffle_dataset=False)
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=length_reward, train_dataset=data, args=args)
    seen = []
    take = trainer.parts.rounds._take
    trainer.parts.rounds._take = lambda *a: (produced := take(*a), seen.append(produced.scored.rollout))[0]
    with caplog.at_level("WARNING", logger="grpo"):
        trainer.train()
    assert trainer.state.global_step == 1
    rollout = seen[0]
    assert all(len(p) + len(c) <= context for p, c in zip(rollout.prompt_ids, rollout.completion_ids))
    assert max(map(len, rollout.completion_ids)) == context - len(rollout.prompt_ids[0]) < 8
    assert caplog.text.count("capped at the positions left") == 1


def test_a_completion_column_is_said_not_to_reach_rewards(tiny_model_dir, tmp_path):
    data = Dataset.from_list([{"prompt": f"p{i}", "completion": "c"} for i in range(8)])
    with pytest.warns(UserWarning, match="'completion' column is not passed to reward functions"):
        trainer(tiny_model_dir, tmp_path, dataset=data)


# ---- 11. output_dir ------------------------------------------------------------------------------------------


def test_an_output_dir_that_is_a_file_or_not_writable_fails_before_any_work(tiny_model_dir, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputDirError, match="is a file, not a directory"):
        trainer(tiny_model_dir, tmp_path, output_dir=str(tmp_path / "file"))
    with pytest.raises(OutputDirError, match="is not writable"):
        trainer(tiny_model_dir, tmp_path, output_dir="/proc/grpo-test/out")


# ---- 12. model and tokenizer -----------------------------------------------------------------------------------


def test_a_mistyped_path_says_no_such_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the relative paths must not exist (`make demo` writes runs/demo/model here)
    started = time.monotonic()
    for path in ("./runs/my-model", str(tmp_path / "missing"), "runs/demo/model"):
        with pytest.raises(ModelLoadError, match="no such directory"):
            GRPOTrainer(model=path, reward_funcs=length_reward, train_dataset=chat_dataset(), args=cfg(tmp_path))
    assert time.monotonic() - started < 10


def test_a_missing_hub_id_fails_fast_and_says_so(tmp_path):
    """Offline (HF_HUB_OFFLINE unset, no network here): one clear error in seconds, without the hub client's
    retries (transformers' adapter lookup ignored local_files_only: 23 s of retried requests)."""
    code = (
        "import time; from grpo.models.modeling import load_causal_lm\nstart = time.monotonic()\n"
        "try:\n    load_causal_lm('no-such-org/no-such-model', None, False)\nexcept OSError as err:\n"
        "    print(type(err).__name__, err)\nprint('SECONDS', time.monotonic() - start)"
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(env, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    assert "ModelLoadError Could not load the model 'no-such-org/no-such-model'" in done.stdout, done.stderr[-2000:]
    assert "Retrying" not in done.stderr
    assert float(done.stdout.split("SECONDS")[-1]) < 10


def test_a_tokenizer_without_pad_or_eos_is_refused_at_construction(tmp_path):
    tok = make_tokenizer()
    tok.pad_token = None
    tok.eos_token = None
    with pytest.raises(ValueError, match="neither a pad token nor an EOS token"):
        GRPOTrainer(
            model=make_model(make_tokenizer()),
            processing_class=tok,
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            args=cfg(tmp_path),
        )


def test_sharded_checkpoint_metadata_is_read_without_running_code(tmp_path):
    """torch.distributed.checkpoint pickles its metadata; grpo reads it back with an unpickler that builds only
    metadata classes (the 2-process FSDP resume test reads a real one)."""
    import io

    from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

    from grpo.distributed.sharding import _RestrictedUnpickler

    properties = TensorProperties(dtype=torch.float32)
    real = Metadata({"w": TensorStorageMetadata(properties, torch.Size([2, 3]), [])})
    assert _RestrictedUnpickler(io.BytesIO(pickle.dumps(real))).load() == real
    marker = tmp_path / "pwned"
    with pytest.raises(pickle.UnpicklingError, match="is not part of a checkpoint's metadata"):
        _RestrictedUnpickler(io.BytesIO(pickle.dumps(Payload(marker)))).load()
    assert not marker.exists()


def test_deepspeed_checkpoint_files_are_read_weights_only(tmp_path):
    """DeepSpeed reads its engine checkpoint with torch.load(weights_only=False); grpo's load makes every such call
    weights-only, with DeepSpeed's own state classes allowed by name (the ZeRO resume tests read real ones)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    from grpo.distributed.zero import _weights_only_torch_load

    original = torch.load
    torch.save({"loss_scaler": LossScaler(1.0), "w": torch.ones(2)}, tmp_path / "ok.pt")
    with open(tmp_path / "bad.pt", "wb") as f:
        pickle.dump(Payload(tmp_path / "pwned"), f)
    with _weights_only_torch_load():
        assert isinstance(torch.load(tmp_path / "ok.pt", weights_only=False)["loss_scaler"], LossScaler)
        with pytest.raises(pickle.UnpicklingError):
            torch.load(tmp_path / "bad.pt", weights_only=False)
    assert not (tmp_path / "pwned").exists() and torch.load is original  # restored after the block


@pytest.mark.parametrize("which", ["fast", "plain"])
def test_sigterm_ends_a_long_generation_at_the_next_token(which):
    """Inside `preemption_guard`, SIGTERM (sent here from the model's 5th forward, so it always lands mid-rollout)
    makes either engine raise `Preempted` at the next token, not at the end of a 4000-token rollout."""
    import signal

    from grpo.algo.sampling import SamplingSettings
    from grpo.base.records import Request
    from grpo.data.prompts import end_of_turn_ids, make_prompt
    from grpo.rollout.fast import FastEngine
    from grpo.rollout.plain import TransformersEngine
    from grpo.rounds.preemption import Preempted, preemption_guard

    tok = make_tokenizer()
    model = make_model(tok).eval()
    model.config.max_position_embeddings = 8192
    sampling = SamplingSettings(max_completion_length=4000)  # what the engines take
    stops = torch.tensor(end_of_turn_ids(tok, model.generation_config.eos_token_id))
    forwards = []

    def hook(module, inputs, output):
        forwards.append(1)
        if len(forwards) == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return output.index_fill(-1, stops, -1e4)  # never stops by itself

    model.lm_head.register_forward_hook(hook)
    engine_type = FastEngine if which == "fast" else TransformersEngine
    engine = engine_type(model, tok, sampling, end_of_turn_ids(tok), **({"lean": False} if which == "fast" else {}))
    with preemption_guard(), pytest.raises(Preempted):
        engine.generate([Request(make_prompt("Tell me a long story.", tok), num_samples=2)])
    assert len(forwards) <= 7  # the signal's token, and at most one more
