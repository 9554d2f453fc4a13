"""Running user code (reward functions, tools) off the trainer thread: `async def` functions on one event loop on a
daemon thread, sync ones on daemon threads. Daemon threads, because a call that hangs must neither block the trainer
past its time limit nor keep the process alive at exit."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any


class BackgroundLoop:
    """One event loop on a daemon thread, shared by every async call. Running the coroutines there (not with
    asyncio.run) works even when the caller already runs a loop (notebooks)."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def submit(cls, coroutines: list[Coroutine]) -> concurrent.futures.Future:
        """All the coroutines, gathered (exceptions returned as values, in order)."""
        with cls._lock:
            if cls._loop is None:
                cls._loop = asyncio.new_event_loop()
                threading.Thread(target=cls._loop.run_forever, daemon=True, name="grpo-async").start()

        async def gather() -> list:
            return await asyncio.gather(*coroutines, return_exceptions=True)

        return asyncio.run_coroutine_threadsafe(gather(), cls._loop)


class DaemonCall:
    """fn() started on a daemon thread; `join(seconds)` waits for it, `outcome()` returns its value or raises what
    it raised."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self._box: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name=name)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._box["value"] = fn()
        except BaseException as err:  # handed to the waiting thread
            self._box["error"] = err

    def join(self, seconds: float) -> bool:
        """Whether it has finished (waiting up to `seconds`)."""
        self._thread.join(seconds)
        return not self._thread.is_alive()

    def outcome(self) -> Any:
        if "error" in self._box:
            raise self._box["error"]
        return self._box["value"]
