"""Calling reward functions: async ones concurrently (counted in flight, not timed), sync ones on the calling
thread while the async ones run, and a warning naming the samples no function applies to."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest

from grpo.rewards.calling import RewardFunctionError, score

KW = dict(prompts=["p0", "p1"], completions=["c0", "c1"])


def test_async_reward_functions_are_in_flight_together():
    in_flight, most = 0, []
    everyone_started = None

    def make(k):
        async def reward(completions, **kwargs):
            nonlocal in_flight, everyone_started
            if everyone_started is None:
                everyone_started = asyncio.Event()
            in_flight += 1
            most.append(in_flight)
            if in_flight == 3:
                everyone_started.set()
            # run one at a time, the first would wait here until the timeout and fail the test
            await asyncio.wait_for(everyone_started.wait(), timeout=30)
            in_flight -= 1
            return [float(k)] * len(completions)

        reward.__name__ = f"r{k}"
        return reward

    funcs = [make(k) for k in range(3)]
    rewards = score(funcs, [f.__name__ for f in funcs], KW, 2)
    assert max(most) == 3
    assert rewards.tolist() == [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]


def test_sync_functions_run_on_a_worker_while_async_ones_run_on_the_loop():
    """The sync function waits for a signal the async one sends: sequential calls would never finish. Sync
    functions run on a worker thread while the caller waits (so that a hung one can be reported, and SIGTERM
    seen), one after another."""
    async_started = threading.Event()
    threads = {}

    async def async_reward(completions, **kwargs):
        threads["async"] = threading.current_thread()
        async_started.set()
        await asyncio.sleep(0)
        return [1.0] * len(completions)

    def sync_reward(completions, **kwargs):
        threads["sync"] = threading.current_thread()
        assert async_started.wait(timeout=30), "the async reward did not run while the sync one did"
        return [2.0] * len(completions)

    def second_sync(completions, **kwargs):
        threads["second"] = threading.current_thread()
        assert not threads["sync"].is_alive()  # the first sync function had returned
        return [3.0] * len(completions)

    names = ["sync_reward", "async_reward", "second_sync"]
    rewards = score([sync_reward, async_reward, second_sync], names, KW, 2)
    assert rewards.tolist() == [[2.0, 1.0, 3.0], [2.0, 1.0, 3.0]]
    caller = threading.current_thread()
    assert threads["sync"] is not caller and threads["async"] is not threads["sync"]
    assert threads["sync"].daemon and threads["sync"].name == "grpo-reward-sync_reward"


def test_a_raising_sync_function_is_reported_without_waiting_for_the_async_ones():
    release, started, cancelled = threading.Event(), threading.Event(), threading.Event()

    async def slow(completions, **kwargs):
        started.set()
        try:
            while not release.is_set():
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return [0.0] * len(completions)

    def broken(completions, **kwargs):
        assert started.wait(timeout=30)
        raise KeyError("solution")

    with pytest.raises(RewardFunctionError, match="'broken' raised KeyError") as err:
        score([slow, broken], ["slow", "broken"], KW, 2)
    assert isinstance(err.value.__cause__, KeyError) and not release.is_set()
    assert cancelled.wait(timeout=10)  # the async one was cancelled, not left running
    release.set()


def test_each_function_gets_its_own_copy_of_the_arguments():
    def editor(completions, **kwargs):
        completions.append("extra")
        return [0.0, 0.0]

    def reader(completions, **kwargs):
        return [float(len(completions))] * 2

    kwargs = {"prompts": ["p0", "p1"], "completions": ["c0", "c1"]}

    def fresh():
        return {k: list(v) for k, v in kwargs.items()}

    rewards = score([editor, reader], ["editor", "reader"], fresh, 2)
    assert rewards[:, 1].tolist() == [2.0, 2.0] and kwargs["completions"] == ["c0", "c1"]


def test_rows_no_function_applies_to_are_named_in_a_warning(caplog):
    def math_only(completions, **kwargs):
        return [1.0, None]

    def format_only(completions, **kwargs):
        return [None, None]

    with caplog.at_level("WARNING", logger="grpo"):
        rewards = score([math_only, format_only], ["math_only", "format_only"], KW, 2)
    assert re.search(r"returned None for the following kwargs: sample 1: prompt 'p1', completion 'c1'", caplog.text)
    assert "These 1 sample(s) get advantage 0" in caplog.text
    assert rewards[0, 0] == 1.0 and rewards[1].isnan().all()
