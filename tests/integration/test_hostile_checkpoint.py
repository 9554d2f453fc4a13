"""Resuming from a checkpoint unpacked from a hostile archive: a FIFO where trainer_state.json was, a weight index of
the wrong shape. train() refuses it with the CheckpointError that names the file and the next-newest complete
checkpoint (the reading of each file is tested in tests/unit/test_checkpoint_files.py), and resumes from that one."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from grpo import GRPOTrainer
from grpo.checkpoint import CheckpointError
from support.rewards import length_reward
from support.runs import cfg, chat_dataset

HANG_GUARD_S = 120  # a resume still waiting on the FIFO after this is unblocked (and then fails its assertion)


def train(tiny_model_dir, tmp_path, resume=None, **kw):
    args = cfg(tmp_path, save_strategy="steps", save_steps=1, **kw)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    return trainer.train(resume_from_checkpoint=resume)


def unblock(fifo):
    """The hang guard: a reader blocked opening the FIFO gets a writer, which closes at once (the reader sees an
    empty file)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError as err:  # ENXIO: no reader is waiting on it
        if err.errno != errno.ENXIO:
            raise


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX only")
@pytest.mark.parametrize("name", ["trainer_state.json", "model.safetensors.index.json"])
def test_a_hostile_file_is_named_with_the_checkpoint_to_resume_from_instead(tiny_model_dir, tmp_path, name):
    train(tiny_model_dir, tmp_path, max_steps=2)
    checkpoint = tmp_path / "out" / "checkpoint-2"
    path = checkpoint / name
    if name == "trainer_state.json":
        path.unlink()
        os.mkfifo(path)
        problem = "is a FIFO"
    else:
        path.write_text("[1, 2]")
        problem = "holds a list, not an object"
    guard = threading.Timer(HANG_GUARD_S, unblock, [str(path)])
    guard.start()
    try:
        with pytest.raises(
            CheckpointError, match=rf"{name}: {problem}.*next-newest complete checkpoint is .*checkpoint-1"
        ):
            train(tiny_model_dir, tmp_path, resume=str(checkpoint), max_steps=3)
    finally:
        guard.cancel()
    assert train(tiny_model_dir, tmp_path, resume=str(checkpoint.parent / "checkpoint-1"), max_steps=2).global_step == 2
