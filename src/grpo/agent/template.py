"""What a chat template must do for tool calling, checked once before training (shared spec §6.1), and the token
ids of a tool-result turn.

- It renders the tools (`apply_chat_template(tools=...)`), an assistant turn's `tool_calls` and `tool` messages:
  a template that drops any of them would train the model on conversations it never sees.
- It preserves prefixes: the tokens of [user, assistant with a call] are a prefix of those of the same plus a tool
  message and the next assistant header. The trained sequence is built by appending the tool turn's tokens to the
  tokens the model sampled, never by re-rendering (which could change tokens the model already produced), and
  that is the same sequence the model would see in a rendered conversation only when the template preserves
  prefixes.

`CHATML_TOOLS` is a ChatML template with tools in the `<tool_call>` format, for ChatML models whose own template
has no tool support (SmolLM2, the tiny test models): `tokenizer.chat_template = CHATML_TOOLS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpo.agent.parsing import has_response_parser

CHATML_TOOLS = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "You can call these tools:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    '</tools>\nTo call a tool, write <tool_call>{"name": <tool name>, "arguments": <a JSON object>}</tool_call>.'
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first and tools %}"
    "{% elif message['role'] == 'assistant' %}<|im_start|>assistant\n{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set function = call['function'] if 'function' in call else call %}"
    '<tool_call>{"name": "{{ function[\'name\'] }}", "arguments": '
    "{% if function['arguments'] is string %}{{ function['arguments'] }}{% else %}{{ function['arguments'] | tojson }}"
    "{% endif %}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_NAME, _KEY, _VALUE, _CONTENT = "grpo_tool_name_x7", "grpo_arg_key_x7", "grpo_arg_value_x7", "grpo_tool_result_x7"


def _sentinel_tool() -> dict:
    return {
        "type": "function",
        "function": {
            "name": _NAME,
            "description": "A sentinel.",
            "parameters": {"type": "object", "properties": {_KEY: {"type": "string"}}, "required": [_KEY]},
        },
    }


def _call(name: str, arguments: dict) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


def check_tool_template(tokenizer: Any, chat_template_kwargs: dict | None = None) -> None:
    """Raise one error naming what the template drops (tools, calls, tool results) or that it does not preserve
    prefixes, and how to supply a template that works."""
    kwargs = chat_template_kwargs or {}
    fix = (
        "Pass processing_class= a tokenizer whose chat_template renders `tools`, assistant `tool_calls` and "
        "'tool' messages (for a ChatML model: tokenizer.chat_template = grpo.agent.CHATML_TOOLS)."
    )
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tools= needs a chat template, and the tokenizer has none. {fix}")
    conversation = [
        {"role": "user", "content": "hi"},
        _call(_NAME, {_KEY: _VALUE}),
        {"role": "tool", "name": _NAME, "content": _CONTENT},
    ]
    try:
        listed = tokenizer.apply_chat_template(conversation[:1], tools=[_sentinel_tool()], tokenize=False, **kwargs)
        text = tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
    except Exception as err:
        raise ValueError(f"The chat template cannot render a tool-calling conversation ({err}). {fix}") from err
    dropped = []
    if _NAME not in listed:
        dropped.append("the tools it is given")
    if not all(s in text for s in (_NAME, _KEY, _VALUE)):
        dropped.append("the assistant's tool calls")
    if _CONTENT not in text:
        dropped.append("tool results ('tool' messages)")
    if dropped:
        raise ValueError(f"The chat template does not render {', '.join(dropped)}. {fix}")
    if not has_response_parser(tokenizer) and "<tool_call>" not in text:
        raise ValueError(
            "The tokenizer has no response parser (response_template), so grpo reads tool calls in the "
            '<tool_call>{"name": ..., "arguments": {...}}</tool_call> format, but this chat template writes them '
            "differently: the model's calls would never be read. Set tokenizer.response_template for this model's "
            "format (transformers' response parsing), or use a template with the <tool_call> format (CHATML_TOOLS)."
        )
    if not preserves_prefix(tokenizer, kwargs):
        raise ValueError(
            "The chat template does not preserve prefixes: the tokens of a conversation up to an assistant tool call "
            "change when a tool result follows. Multi-turn training appends each tool result to the tokens the model "
            "sampled, so it needs a template that renders earlier turns the same whatever follows (templates that "
            "drop earlier reasoning, such as Qwen3's, do not). " + fix
        )


def preserves_prefix(tokenizer: Any, chat_template_kwargs: dict | None = None) -> bool:
    kwargs = chat_template_kwargs or {}
    before = [{"role": "user", "content": "dummy"}, _call("dummy", {})]
    after = [*before, {"role": "tool", "name": "dummy", "content": "dummy"}]
    ids1 = _ids(tokenizer.apply_chat_template(before, tokenize=True, **kwargs))
    ids2 = _ids(tokenizer.apply_chat_template(after, tokenize=True, add_generation_prompt=True, **kwargs))
    return ids2[: len(ids1)] == ids1


def tool_suffix_ids(
    tokenizer: Any, tool_messages: Sequence[dict], stop_ids: set[int], chat_template_kwargs: dict | None = None
) -> list[int]:
    """The tokens a rendered conversation puts after an assistant turn's end-of-turn token when the tool results
    follow: the tool turn(s) and the next assistant header. Measured on a stand-in conversation whose assistant turn
    calls the real tool (some templates name the tool in the result's header), cut after its last stop token (EOS
    or end-of-turn: where the model's own sampled turn ends)."""
    kwargs = chat_template_kwargs or {}
    before = [{"role": "user", "content": "dummy"}, _call(tool_messages[0]["name"], {})]
    prefix = _ids(tokenizer.apply_chat_template(before, tokenize=True, **kwargs))
    full = _ids(
        tokenizer.apply_chat_template([*before, *tool_messages], tokenize=True, add_generation_prompt=True, **kwargs)
    )
    ends = [i for i, token in enumerate(prefix) if token in stop_ids]
    if ends:
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError(
            "The chat template renders the turns before a tool result differently once the result follows; "
            "multi-turn training needs a prefix-preserving template (see grpo.agent.CHATML_TOOLS)."
        )
    return full[len(prefix) :]


def _ids(rendered: Any) -> list[int]:
    """Token ids from apply_chat_template(tokenize=True), which returns a list or a BatchEncoding."""
    if hasattr(rendered, "keys") and "input_ids" in rendered:
        rendered = rendered["input_ids"]
    if rendered and isinstance(rendered[0], list):
        rendered = rendered[0]
    return list(rendered)
