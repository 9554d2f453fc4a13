"""The CPU allocator policy (`grpo.perf.allocator.keep_freed_memory`): once the heap has settled, freed large blocks are
reused without faulting their pages in again. Counted in a fresh process that has imported what a training process
imports (the trainer: `import grpo` alone no longer does), by minor page faults (not time). (Measured: in a process
that imported only torch and numpy the 64 MiB blocks faulted in again even under the policy; with transformers
imported, as in every run, none did.)"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from support.launch import side_by_side

JOB = """
import resource, sys, torch
import grpo.trainer  # a training process's imports
from grpo.perf import allocator
if sys.argv[1] == "1":
    assert allocator.keep_freed_memory()
def faults_of_fresh_block():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(16 * 2**20)  # 64 MiB, every page written
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    del block
    return after - before
for _ in range(4):  # the heap settles within a few rounds (a freed block may not fit the next one exactly)
    faults_of_fresh_block()
print("faults", sum(faults_of_fresh_block() for _ in range(4)))
"""


def faults(policy: bool) -> int:
    done = subprocess.run(
        [sys.executable, "-c", JOB, str(int(policy))],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": ":".join(sys.path), "PATH": ""},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split("faults")[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_freed_blocks_are_reused_without_faulting_again():
    pages = 16 * 2**20 * 4 // 4096  # of one block; 4 blocks are counted
    system, kept = side_by_side(lambda: faults(policy=False), lambda: faults(policy=True))  # a process each
    assert system > 2 * pages  # the system policy unmaps each block and faults the next one in
    assert kept < pages // 50  # kept: each new block reuses a freed one's pages


def test_the_trainer_applies_the_policy_unless_turned_off(tiny_model_dir, tmp_path, monkeypatch):
    import grpo.assembly
    from grpo import GRPOTrainer
    from support.rewards import token_count_reward
    from support.runs import cfg, chat_dataset

    calls = []
    monkeypatch.setattr(grpo.assembly.allocator, "keep_freed_memory", lambda: calls.append(1) or True)
    GRPOTrainer(model=tiny_model_dir, reward_funcs=token_count_reward, train_dataset=chat_dataset(), args=cfg(tmp_path))
    assert calls == [1]
    GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=token_count_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, cpu_keep_freed_memory=False),
    )
    assert calls == [1]
