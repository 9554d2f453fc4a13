"""Producers in lockstep (several processes on one vLLM server) never leave one of them in a collective the others
will not join: process 0's producer reaches its next weight change and waits for the others, while process 1's
is stopped mid-round (SIGTERM, or an error) and ends. Before, process 0's producer waited in a barrier for ever and
the process group could not be torn down at exit (the two-process async SIGTERM hang); now process 1's producer
meets it once more on its way out, and both stop.

The producer thread is `AsyncRounds._run` itself; only what it produces is replaced (`_rounds_from`)."""

from __future__ import annotations

import os
import threading

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo.base import sigterm
from grpo.rounds.asynchronous import AsyncRounds


def _producer(rank: int, group) -> AsyncRounds:
    rounds = AsyncRounds.__new__(AsyncRounds)  # the fields `_run` and `_lockstep` read, no trainer
    rounds.group, rounds.stop, rounds.voted, rounds.error = group, threading.Event(), False, None
    rounds.cond, rounds.snapshot, rounds.heartbeat = threading.Condition(), torch.nn.Linear(1, 1), 0.0

    class Pushing:  # the server's client: it holds weights 0; the next round's are 1
        version = 0

        def sync(self, model, key, group):
            raise AssertionError("process 1's producer ended: this one must not push alone")

    rounds.producer, rounds.loaded = Pushing(), 1

    def rounds_from(first):
        if rank == 0:
            rounds._load(1)  # the next round needs new weights: wait for every producer
            raise AssertionError("unreachable")
        rounds.stop.set()  # stopped mid-round (its learner halted it)
        raise sigterm.Cancelled("stopped")

    rounds._rounds_from = rounds_from
    return rounds


def _process(rank: int, init: str, results) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")
    rounds = _producer(rank, group)
    thread = threading.Thread(target=rounds._run, args=(0, 1), daemon=True)
    thread.start()
    thread.join(timeout=15)
    results[rank] = (not thread.is_alive(), rounds.voted, repr(rounds.error))
    if not thread.is_alive():  # a producer left in a collective would hang the teardown
        dist.destroy_process_group()
    os._exit(0)


def test_a_producer_stopped_mid_round_stops_the_one_waiting_at_the_next_weight_change(tmp_path):
    results = mp.Manager().dict()
    init = f"file://{tmp_path / 'store'}"
    processes = [mp.get_context("spawn").Process(target=_process, args=(r, init, results)) for r in (0, 1)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=90)
        assert p.exitcode == 0, "a process did not end: a producer is still in its collective"
    # both producers ended, having decided together to stop; neither ended with an error
    assert dict(results) == {0: (True, True, "None"), 1: (True, True, "None")}
