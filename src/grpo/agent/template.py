"""What a chat template must do for tool calling, checked once before training (shared spec §6.1), and the token
ids of a tool-result turn.

- It renders the tools (`apply_chat_template(tools=...)`), an assistant turn's `tool_calls` and `tool` messages:
  a template that drops any of them would train the model on conversations it never sees.
- Its turns can be told apart: the trained sequence is built by appending the tool turn's tokens (the template's
  own rendering of it, after the calling assistant turn's end-of-turn token) to the tokens the model sampled,
  never by re-rendering, which could change tokens the model already produced. A template that re-renders earlier
  turns once more follow (Qwen3's drops earlier reasoning: it does not preserve prefixes) trains too: earlier turns
  keep what the model sampled, as in TRL 1.16, whose training templates keep them.

`CHATML_TOOLS` is a ChatML template with tools in the `<tool_call>` format, for ChatML models whose own template
has no tool support (SmolLM2, the tiny test models): `tokenizer.chat_template = CHATML_TOOLS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpo.agent.budget import Span
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


def check_tool_template(
    tokenizer: Any, chat_template_kwargs: dict | None = None, stop_ids: set[int] | None = None
) -> None:
    """Raise one error naming what the template drops (tools, calls, tool results) or that its turns cannot be told
    apart (`tool_suffix_ids`), and how to supply a template that works. `stop_ids`: the tokens that end a turn (EOS
    and the template's end-of-turn; default: EOS and <|im_end|> where the vocabulary has it)."""
    kwargs = chat_template_kwargs or {}
    fix = (
        "Pass processing_class= a tokenizer whose chat_template renders `tools`, assistant `tool_calls` and "
        "'tool' messages (for a ChatML model: tokenizer.chat_template = grpo.agent.CHATML_TOOLS)."
    )
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tools= needs a chat template, and the tokenizer has none. {fix}")
    try:
        dropped, text = tool_parts_dropped(tokenizer, kwargs)
    except Exception as err:
        raise ValueError(f"The chat template cannot render a tool-calling conversation ({err}). {fix}") from err
    if dropped:
        raise ValueError(f"The chat template does not render {', '.join(dropped)}. {fix}")
    if not has_response_parser(tokenizer) and "<tool_call>" not in text:
        raise ValueError(
            "The tokenizer has no response parser (response_template), so grpo reads tool calls in the "
            '<tool_call>{"name": ..., "arguments": {...}}</tool_call> format, but this chat template writes them '
            "differently: the model's calls would never be read. Set tokenizer.response_template for this model's "
            "format (transformers' response parsing), or use a template with the <tool_call> format (CHATML_TOOLS)."
        )
    _check_turn_boundary(tokenizer, kwargs, stop_ids)


def tool_parts_dropped(tokenizer: Any, chat_template_kwargs: dict | None = None) -> tuple[list[str], str]:
    """What of a tool-calling conversation the chat template does not render (the tools it is given, the assistant's
    calls, the tools' results), and its rendering of a sentinel conversation; raises what the template raises."""
    kwargs = chat_template_kwargs or {}
    conversation = [
        {"role": "user", "content": "hi"},
        _call(_NAME, {_KEY: _VALUE}),
        {"role": "tool", "name": _NAME, "content": _CONTENT},
    ]
    listed = tokenizer.apply_chat_template(conversation[:1], tools=[_sentinel_tool()], tokenize=False, **kwargs)
    text = tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
    dropped = []
    if _NAME not in listed:
        dropped.append("the tools it is given")
    if not all(s in text for s in (_NAME, _KEY, _VALUE)):
        dropped.append("the assistant's tool calls")
    if _CONTENT not in text:
        dropped.append("tool results ('tool' messages)")
    return dropped, text


def _check_turn_boundary(tokenizer: Any, kwargs: dict, stop_ids: set[int] | None) -> None:
    """The tool turn must be found after the assistant turn that called it (`tool_suffix_ids`): checked on a sentinel
    conversation, with the call before the boundary and the result after it."""
    stops = set(stop_ids or ()) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    turn_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    if not stop_ids and turn_end is not None:
        stops.add(turn_end)
    before, full, boundary = _rendered_around_tool_turn(
        tokenizer, [{"role": "tool", "name": _NAME, "content": _CONTENT}], stops, kwargs
    )
    if (
        boundary is None
        or _CONTENT in tokenizer.decode(full[:boundary])
        or _CONTENT not in tokenizer.decode(full[boundary:])
        or _NAME not in tokenizer.decode(full[:boundary])
    ):
        raise ValueError(
            "The chat template's turns cannot be told apart once a tool result follows: the assistant turn that "
            "calls a tool does not end with an end-of-turn token before the tool's turn begins. Multi-turn training "
            "appends each tool turn to the tokens the model sampled, so it needs to find where the assistant turn "
            "ends. Pass processing_class= a tokenizer whose chat_template closes every turn (for a ChatML model: "
            "tokenizer.chat_template = grpo.agent.CHATML_TOOLS)."
        )


def _rendered_around_tool_turn(
    tokenizer: Any, tool_messages: Sequence[dict], stop_ids: set[int], kwargs: dict
) -> tuple[list[int], list[int], int | None]:
    """[user, assistant calling the tool] rendered alone and with the tool turn(s) and the next assistant header, and
    where the assistant turn ends in the latter: after as many stop tokens (EOS, end-of-turn) as the former holds.
    Counting turns, not comparing tokens, finds it also where a template re-renders earlier turns once more follow
    (Qwen3's drops an earlier turn's empty reasoning block)."""
    before = [{"role": "user", "content": "dummy"}, _call(tool_messages[0]["name"], {})]
    prefix = _ids(tokenizer.apply_chat_template(before, tokenize=True, **kwargs))
    full = _ids(
        tokenizer.apply_chat_template([*before, *tool_messages], tokenize=True, add_generation_prompt=True, **kwargs)
    )
    turns = sum(1 for token in prefix if token in stop_ids)
    seen = 0
    for i, token in enumerate(full):
        seen += token in stop_ids
        if turns and seen == turns:
            return prefix, full, i + 1
    return prefix, full, None


def tool_suffix_ids(
    tokenizer: Any, tool_messages: Sequence[dict], stop_ids: set[int], chat_template_kwargs: dict | None = None
) -> list[int]:
    """The tokens a rendered conversation puts after an assistant turn's end-of-turn token when the tool results
    follow: the tool turn(s) and the next assistant header. Measured on a stand-in conversation whose assistant turn
    calls the real tool (some templates name the tool in the result's header), after its assistant turn (the turn's
    stop tokens counted: where the model's own sampled turn ends). The model's sampled tokens are never re-rendered,
    so a template that renders earlier turns differently once more follow (Qwen3's) trains on what was sampled."""
    _, full, boundary = _rendered_around_tool_turn(tokenizer, tool_messages, stop_ids, chat_template_kwargs or {})
    if boundary is None:
        raise ValueError(
            "The chat template's assistant turn has no end-of-turn token once a tool result follows: grpo cannot "
            "tell where the tool's turn begins (see grpo.agent.CHATML_TOOLS for a template that works)."
        )
    return full[boundary:]


def cannot_fit(
    tokenizer: Any,
    tool_messages: Sequence[dict],
    stop_ids: set[int],
    room: float,
    span: Span | None,
    chat_template_kwargs: dict | None = None,
) -> bool:
    """Whether the tool turn `tool_suffix_ids` would give is certain to be `room` tokens or more, decided from the
    length of its rendered text without tokenizing it (`grpo.agent.budget`); False where that cannot be shown, and
    the turn is then tokenized whole. The stand-in conversation renders as the real one up to the first result,
    and its assistant turn's stop tokens (added tokens, so found by their strings) all come before that point: the
    tokens after them, which `tool_suffix_ids` returns, cover at least the text from there on."""
    contents = [message["content"] for message in tool_messages]
    if span is None or getattr(tokenizer, "split_special_tokens", False):
        return False  # no bound; stop tokens not matched whole
    if not all(isinstance(c, str) for c in contents):
        return False  # images: the processor expands their placeholders
    if sum(map(len, contents)) < room * span.longest:
        return False  # short enough to tokenize
    stops = tokenizer.convert_ids_to_tokens(sorted(stop_ids))
    if not set(stops) <= set(tokenizer.get_added_vocab()):
        return False
    kwargs = chat_template_kwargs or {}
    before = [{"role": "user", "content": "dummy"}, _call(tool_messages[0]["name"], {})]
    stand_in = [{**message, "content": _CONTENT} for message in tool_messages]
    turns = sum(tokenizer.apply_chat_template(before, tokenize=False, **kwargs).count(s) for s in stops)
    shown, text = (
        tokenizer.apply_chat_template([*before, *m], tokenize=False, add_generation_prompt=True, **kwargs)
        for m in (stand_in, tool_messages)
    )
    start = shown.find(_CONTENT)
    return (
        start >= 0
        and text.startswith(shown[:start])
        and sum(shown[:start].count(s) for s in stops) >= turns
        and span.at_least(text, start, room)
    )


def _ids(rendered: Any) -> list[int]:
    """Token ids from apply_chat_template(tokenize=True), which returns a list or a BatchEncoding."""
    if hasattr(rendered, "keys") and "input_ids" in rendered:
        rendered = rendered["input_ids"]
    if rendered and isinstance(rendered[0], list):
        rendered = rendered[0]
    return list(rendered)


_REASONING = "grpo_reasoning_x7"


def rerendering(tokenizer: Any, chat_template_kwargs: dict | None = None) -> str | None:
    """How the chat template renders an earlier assistant turn otherwise than the model sampled it once a tool result
    follows (what `turn_context="auto"` asks; None where it renders it as it was, or cannot render the sentinel):
    checked on a sentinel conversation whose assistant turn holds a reasoning block and a tool call. It re-renders when
    the conversation with the tool result drops the reasoning (DeepSeek-R1's and QwQ's templates strip it from every
    earlier turn; Llama 3.1's renders a tool-calling turn as its call alone), does not begin with the generation prompt
    the turn was sampled after (Qwen3's with enable_thinking=False opens every turn with an empty reasoning block and
    drops it from earlier ones), or does not begin with the assistant turn as rendered last (Gemma 4's puts the turn's
    text after the tool's result)."""
    kwargs = chat_template_kwargs or {}
    user = [{"role": "user", "content": "hi"}]
    turn = {**_call(_NAME, {_KEY: _VALUE}), "content": f"<think>\n{_REASONING}\n</think>\n\n"}
    result = {"role": "tool", "name": _NAME, "content": _CONTENT}
    try:
        asked = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True, **kwargs)
        alone = tokenizer.apply_chat_template([*user, turn], tokenize=False, **kwargs)
        followed = tokenizer.apply_chat_template(
            [*user, turn, result], tokenize=False, add_generation_prompt=True, **kwargs
        )
    except Exception:  # check_tool_template has named what the template cannot render
        return None
    if _REASONING not in followed:
        return "it drops an earlier turn's reasoning"
    if not followed.startswith(asked):
        return "it drops what its generation prompt opens each turn with from earlier turns"
    if not followed.startswith(alone):
        return "it renders an earlier turn otherwise once a tool result follows"
    return None
