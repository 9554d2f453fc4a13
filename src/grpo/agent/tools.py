"""Tools the policy may call: Python functions (sync or `async def`) described to the model by the JSON schema
transformers builds from their type hints and Google-style docstring, and run for a turn's parsed calls.

    tools = ToolSet.of([multiply])                    # checks every function, builds its schema once
    results = run_calls([calls_of_row_0, ...], [tools_of_row_0, ...], timeout=60.0)

Every call of one tool round (all rows of this process) runs at the same time: `async def` tools on one background
event loop, sync tools each on a daemon thread, each under `timeout` seconds. A call that raises, runs past the
limit (it is abandoned: a thread cannot be killed, so a sync tool that never returns keeps its thread), names an
unknown tool or gets arguments that do not fit its signature becomes a tool message saying so, and counts as a
failure. Nothing a tool does stops training. Results come back in call order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from grpo.base import sigterm
from grpo.base.background import BackgroundLoop, DaemonCall

logger = logging.getLogger("grpo")


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters", ...}}
    is_async: bool

    @property
    def parameters(self) -> dict:
        return self.schema["function"].get("parameters", {}).get("properties", {})


def make_tool(fn: Any, where: str = "tools") -> Tool:
    """A Tool from a function or bound method; one clear error when transformers cannot describe it."""
    from transformers.utils import get_json_schema

    if not callable(fn) or not hasattr(fn, "__name__"):
        raise ValueError(
            f"{where} entry {fn!r:.80} is not a function: a tool is a Python function (sync or async def) with "
            "type hints and a Google-style docstring."
        )
    try:
        schema = get_json_schema(fn)
    except Exception as err:  # transformers' DocstringParsingException / TypeHintParsingException
        raise ValueError(
            f"{where}: cannot describe the tool '{fn.__name__}' to the model: {err} A tool needs a type hint on "
            "every argument and a Google-style docstring with a description and an 'Args:' section naming each "
            "argument (see the multiply example in docs/agents.md)."
        ) from err
    return Tool(fn.__name__, fn, schema, inspect.iscoroutinefunction(fn))


class ToolSet:
    """The tools one rollout may call, by name."""

    def __init__(self, tools: Sequence[Tool]) -> None:
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"Two tools are named '{tool.name}': give each tool a distinct function name.")
            self.tools[tool.name] = tool

    @classmethod
    def of(cls, functions: Sequence[Any], where: str = "tools") -> ToolSet:
        return cls([make_tool(fn, where) for fn in functions])

    def __bool__(self) -> bool:
        return bool(self.tools)

    def __add__(self, other: ToolSet) -> ToolSet:
        return ToolSet([*self.tools.values(), *other.tools.values()])

    @property
    def schemas(self) -> list[dict]:
        """What the chat template renders (apply_chat_template(tools=...))."""
        return [tool.schema for tool in self.tools.values()]


@dataclass
class CallResult:
    name: str
    content: Any  # a string, or a list of content blocks as the tool returned it
    failed: bool


def run_calls(
    calls: Sequence[Sequence[Any]], toolsets: Sequence[ToolSet], timeout: float | None
) -> list[list[CallResult]]:
    """The results of each row's calls (parsed tool calls, {"type": "function", "function": {"name", "arguments"}}),
    every call started at once and each waited for at most `timeout` seconds (None or 0: no limit)."""
    started = [[_start(call, tools, timeout) for call in row] for row, tools in zip(calls, toolsets)]
    pending = [p for row in started for p in row if isinstance(p, _Pending)]
    deadline = time.monotonic() + timeout + 0.5 if timeout else None  # the async ones time out on their own
    while pending:
        sigterm.check(progress=False)  # SIGTERM is seen while a tool runs; waiting on it is no progress
        before = len(pending)
        pending = [p for p in pending if not p.join(0.02)]
        if len(pending) < before:  # a call finished
            sigterm.check()
        if deadline is not None and time.monotonic() > deadline:
            break
    return [[p.result(timeout) if isinstance(p, _Pending) else p for p in row] for row in started]


class _Pending:
    """A call in flight: a daemon thread (sync tool) or a future on the background loop (async tool)."""

    def __init__(self, tool: Tool, arguments: dict, timeout: float | None) -> None:
        self.name = tool.name
        self.future: concurrent.futures.Future | None = None  # exactly one of the two is set
        self.thread: DaemonCall | None = None
        if tool.is_async:
            self.future = BackgroundLoop.submit([asyncio.wait_for(tool.fn(**arguments), timeout or None)])
        else:
            self.thread = DaemonCall(lambda: tool.fn(**arguments), f"grpo-tool-{tool.name}")

    def join(self, seconds: float) -> bool:
        if self.thread is not None:
            return self.thread.join(seconds)
        assert self.future is not None
        try:
            self.future.result(timeout=seconds)
        except Exception:  # not done yet, or done with an error (read in `result`)
            return self.future.done()
        return True

    def result(self, timeout: float | None) -> CallResult:
        if not self.join(0):
            _warn_abandoned(self.name, timeout)
            return _failure(self.name, f"Tool {self.name} did not return within {timeout:g} s.")
        try:
            if self.thread is not None:
                value = self.thread.outcome()
            else:
                assert self.future is not None
                value = self.future.result()[0]
            if isinstance(value, BaseException):  # gathered with return_exceptions=True
                raise value
            return CallResult(self.name, value if isinstance(value, list) else str(value), False)
        except (asyncio.TimeoutError, TimeoutError):
            _warn_abandoned(self.name, timeout)
            return _failure(self.name, f"Tool {self.name} did not return within {timeout:g} s.")
        except KeyboardInterrupt:
            raise
        except BaseException as err:  # SystemExit from a tool, or a result whose str() raises: the tool's failure
            return _failure(self.name, str(err) or type(err).__name__)


def _start(call: Any, tools: ToolSet, timeout: float | None) -> _Pending | CallResult:
    """The call started, or its failure when it cannot be started."""
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        kind = call.get("type") if isinstance(call, dict) else type(call).__name__
        return _failure(_call_name(call), f"Unsupported tool call type: {kind}")
    function = call.get("function", call)
    name, arguments = function.get("name"), function.get("arguments") or {}
    tool = tools.tools.get(name)
    if tool is None:
        return _failure(str(name), f"Tool {name} not found.")
    if isinstance(arguments, str):  # some formats write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return _failure(name, f"The arguments of {name} must be a JSON object, got {arguments!r:.100}.")
    arguments = coerce_arguments(arguments, tool.parameters)
    signature = inspect.signature(tool.fn)
    try:
        signature.bind(**arguments)
    except TypeError as err:
        expected = ", ".join(signature.parameters)
        return _failure(name, f"Arguments {arguments!r:.100} do not fit {name}({expected}): {err}.")
    return _Pending(tool, arguments, timeout)


def coerce_arguments(arguments: dict, parameters: dict) -> dict:
    """String values of integer/number/boolean parameters converted ("7" -> 7), as transformers' schema-typed
    parser does; values that do not convert are left as they are (the tool sees what the model wrote)."""
    out = dict(arguments)
    for key, value in arguments.items():
        kind = parameters.get(key, {}).get("type")
        if not isinstance(value, str):
            continue
        text = value.strip()
        try:
            if kind == "integer":
                out[key] = int(text)
            elif kind == "number":
                out[key] = float(text)
            elif kind == "boolean" and text.lower() in ("true", "false"):
                out[key] = text.lower() == "true"
        except ValueError:
            pass
    return out


def _call_name(call: Any) -> str:
    if isinstance(call, dict):
        return str(call.get("function", call).get("name", "unknown"))
    return "unknown"


def _failure(name: str, message: str) -> CallResult:
    return CallResult(name, str({"error": message}), True)


_warned: set[str] = set()


def _warn_abandoned(name: str, timeout: float | None) -> None:
    if name not in _warned:
        _warned.add(name)
        logger.warning(
            "Tool '%s' did not return within %g s (GRPOConfig.tool_call_timeout): the call is abandoned and the "
            "model gets an error message; raise tool_call_timeout if the tool is just slow.",
            name,
            timeout,
        )
