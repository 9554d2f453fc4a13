"""One assistant turn's token ids as a message: its text and the tool calls it makes (shared spec §6.1).

With a tokenizer that has a response template (transformers' `response_template`, or the legacy `response_schema`),
its own parser reads the turn, as TRL 1.16 does. Without one (most small models' tokenizers), grpo reads the
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` format (Hermes / Qwen style), where TRL refuses the
tokenizer. Either way, a turn whose calls do not parse is plain text: nothing is executed and the rollout ends.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def has_response_parser(tokenizer: Any) -> bool:
    return getattr(tokenizer, "response_template", None) is not None or (
        getattr(tokenizer, "response_schema", None) is not None
    )


def parse_turn(tokenizer: Any, ids: Sequence[int], prefix: Sequence[int], tools: list[dict] | None = None) -> dict:
    """{"role": "assistant", "content": str, "tool_calls"?: [{"type": "function", "function": {...}}]}."""
    if has_response_parser(tokenizer):
        message = _template_parse(tokenizer, list(ids), list(prefix), tools)
    else:
        message = parse_tool_call_text(tokenizer.decode(list(ids), skip_special_tokens=False), tokenizer)
    if message is None:
        return {"role": "assistant", "content": tokenizer.decode(list(ids), skip_special_tokens=True)}
    return message


def _template_parse(tokenizer: Any, ids: list[int], prefix: list[int], tools: list[dict] | None) -> dict | None:
    try:
        if getattr(tokenizer, "response_template", None) is not None:
            parsed = tokenizer.parse_response(ids, prefix=prefix, tools=tools)
        else:
            parsed = tokenizer.parse_response(ids)
        if not isinstance(parsed, dict):
            return None
        content = parsed.get("content")
        if isinstance(content, str) and tokenizer.eos_token:
            content = content.removesuffix(tokenizer.eos_token)
        message = {**parsed, "role": "assistant", "content": content or ""}
        if "tool_calls" in parsed:
            calls = _normalized_calls(parsed["tool_calls"])
            if calls is None:
                return None
            message["tool_calls"] = calls
        return message
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None


def parse_tool_call_text(text: str, tokenizer: Any) -> dict | None:
    """The `<tool_call>` format: every block must be a JSON object with a string "name" (and an "arguments"
    object, missing = {}); the content is the text outside the blocks. None when a block does not parse."""
    special = sorted(set(getattr(tokenizer, "all_special_tokens", [])), key=len, reverse=True)
    calls = []
    for block in CALL.findall(text):
        try:
            call = json.loads(block.strip())
        except (ValueError, RecursionError):  # bad JSON, an int past Python's digit limit, nesting past the stack
            return None
        calls.append(call)
    if "<tool_call>" in CALL.sub("", text):  # an unclosed call (cut by the budget, or malformed)
        return None
    normalized = _normalized_calls(calls)
    if normalized is None:
        return None
    content = CALL.sub("", text)
    for token in special:
        content = content.replace(token, "")
    message: dict[str, Any] = {"role": "assistant", "content": content.strip()}
    if normalized:
        message["tool_calls"] = normalized
    return message


def _normalized_calls(calls: Any) -> list[dict] | None:
    """Calls as {"type": "function", "function": {"name": str, "arguments": dict-or-as-given}}; None if one has
    no string name (the turn is then text)."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        return None
    out = []
    for call in calls:
        if not isinstance(call, dict):
            return None
        function = call.get("function", call)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return None
        arguments = function.get("arguments", function.get("parameters"))
        out.append(
            {
                "type": call.get("type", "function"),
                "function": {"name": function["name"], "arguments": {} if arguments is None else arguments},
            }
        )
    return out
