"""The parts of agent training on their own: tools (schemas, execution, failures, time limits, concurrency),
parsing a turn's tool calls, and the chat template checks."""

from __future__ import annotations

import asyncio
import threading

import pytest

from grpo.agent import CHATML_TOOLS
from grpo.agent.parsing import parse_turn
from grpo.agent.template import check_tool_template, tool_suffix_ids
from grpo.agent.tools import ToolSet, run_calls
from support.agent import tool_tokenizer
from support.tiny import make_tokenizer


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# ---- tools --------------------------------------------------------------------------------------------------


def test_schemas_come_from_transformers_helper():
    from transformers.utils import get_json_schema

    tools = ToolSet.of([multiply])
    assert tools.schemas == [get_json_schema(multiply)]
    assert tools.schemas[0]["function"]["parameters"]["properties"]["a"]["type"] == "integer"


def test_a_tool_without_docstring_or_hints_is_refused_with_the_fix():
    def bare(a):
        return a

    with pytest.raises(ValueError, match="cannot describe the tool 'bare'.*Google-style docstring"):
        ToolSet.of([bare])
    with pytest.raises(ValueError, match="is not a function"):
        ToolSet.of([42])
    with pytest.raises(ValueError, match="Two tools are named 'multiply'"):
        ToolSet.of([multiply, multiply])


def test_results_failures_and_their_messages():
    def explode(x: int) -> int:
        """Raises.

        Args:
            x: anything
        """
        raise RuntimeError("boom")

    tools = ToolSet.of([multiply, explode])
    calls = [
        call("multiply", a=6, b=7),
        call("multiply", a="6", b=" 7 "),  # strings of integers are typed by the schema
        call("explode", x=1),
        call("divide", a=1, b=2),
        call("multiply", a=1),
        {"type": "code_interpreter", "code": "1"},
        call("multiply", a=2, b=3, c=4),
    ]
    out = run_calls([calls], [tools], timeout=5.0)[0]
    assert [(r.name, r.failed) for r in out] == [
        ("multiply", False),
        ("multiply", False),
        ("explode", True),
        ("divide", True),
        ("multiply", True),
        ("unknown", True),
        ("multiply", True),
    ]
    assert out[0].content == "42" and out[1].content == "42"
    assert out[2].content == str({"error": "boom"})
    assert "Tool divide not found." in out[3].content
    assert "do not fit multiply(a, b)" in out[4].content and "missing a required argument" in out[4].content
    assert "Unsupported tool call type: code_interpreter" in out[5].content
    assert "unexpected keyword argument 'c'" in out[6].content


def test_sync_tools_run_concurrently_in_threads_and_async_ones_on_a_loop():
    """Each tool waits for the others at a barrier: the round completes only if every call runs at once."""
    barrier = threading.Barrier(3, timeout=10)

    def meet(tag: str) -> str:
        """Waits for the other calls.

        Args:
            tag: a label
        """
        barrier.wait()
        return tag

    arrived = []

    async def gather_up(tag: str) -> str:
        """Waits for the other async call.

        Args:
            tag: a label
        """
        arrived.append(tag)
        while len(arrived) < 2:
            await asyncio.sleep(0.01)
        return tag.upper()

    tools = ToolSet.of([meet, gather_up])
    rows = [[call("meet", tag="a"), call("gather_up", tag="x")], [call("meet", tag="b"), call("meet", tag="c")]]
    rows[1].append(call("gather_up", tag="y"))
    out = run_calls(rows, [tools, tools], timeout=20.0)
    assert [[(r.content, r.failed) for r in row] for row in out] == [
        [("a", False), ("X", False)],
        [("b", False), ("c", False), ("Y", False)],
    ]


def test_a_hung_tool_is_abandoned_at_its_time_limit_and_reported():
    never = threading.Event()

    def hang(x: int) -> int:
        """Never returns.

        Args:
            x: anything
        """
        never.wait()
        return x

    async def hang_async(x: int) -> int:
        """Never returns either.

        Args:
            x: anything
        """
        await asyncio.Event().wait()
        return x

    tools = ToolSet.of([hang, hang_async, multiply])
    out = run_calls([[call("hang", x=1), call("hang_async", x=1), call("multiply", a=2, b=2)]], [tools], 0.2)[0]
    assert [r.failed for r in out] == [True, True, False]
    assert "did not return within 0.2 s" in out[0].content and "did not return within 0.2 s" in out[1].content
    never.set()


def test_list_results_stay_content_blocks():
    def blocks(n: int) -> list:
        """Content blocks.

        Args:
            n: how many
        """
        return [{"type": "text", "text": str(i)} for i in range(n)]

    out = run_calls([[call("blocks", n=2)]], [ToolSet.of([blocks])], 5.0)[0][0]
    assert out.content == [{"type": "text", "text": "0"}, {"type": "text", "text": "1"}]


# ---- parsing ------------------------------------------------------------------------------------------------


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Sure.", {"role": "assistant", "content": "Sure."}),
        (
            'Let me.<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>',
            {"role": "assistant", "content": "Let me.", "tool_calls": [call("multiply", a=3, b=4)]},
        ),
        (
            '<tool_call>\n{"name": "f"}\n</tool_call><tool_call>{"name": "g", "arguments": {"x": "y"}}</tool_call>',
            {"role": "assistant", "content": "", "tool_calls": [call("f"), call("g", x="y")]},
        ),
    ],
)
def test_tool_call_format_is_parsed(text, expected):
    tok = tool_tokenizer()
    assert parse_turn(tok, ids_of(tok, text), []) == expected


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "multiply", "arguments": {"a": 3,}</tool_call>',  # not JSON
        '<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}',  # never closed (cut by the budget)
        '<tool_call>{"arguments": {"a": 3}}</tool_call>',  # no name
        "<tool_call>[1, 2]</tool_call>",  # not an object
        '<tool_call>{"name": "multiply", "arguments": {"a": ' + "9" * 4400 + "}}</tool_call>",  # past int's limit
        "<tool_call>" + "[" * 1200 + "</tool_call>",  # nested past the recursion limit
    ],
    ids=["not-json", "unclosed", "no-name", "not-an-object", "huge-int", "deep-nesting"],
)
def test_a_call_that_does_not_parse_is_plain_text(text):
    tok = tool_tokenizer()
    message = parse_turn(tok, ids_of(tok, text), [])
    assert message == {"role": "assistant", "content": text} and "tool_calls" not in message


def test_a_tokenizer_response_template_is_used_when_it_has_one():
    """As TRL 1.16: the tokenizer's own parser reads the turn (with the prompt as prefix and the tools' schemas)."""
    tok = tool_tokenizer()
    seen = {}

    class WithTemplate:
        response_template = {"some": "template"}
        eos_token = "<eos>"

        def parse_response(self, ids, prefix=None, tools=None):
            seen.update(ids=ids, prefix=prefix, tools=tools)
            return {"role": "assistant", "content": "ok<eos>", "tool_calls": [{"name": "f"}]}

        def decode(self, ids, skip_special_tokens=False):
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    schemas = ToolSet.of([multiply]).schemas
    message = parse_turn(WithTemplate(), [5, 6], [1, 2], schemas)
    assert seen == {"ids": [5, 6], "prefix": [1, 2], "tools": schemas}
    assert message == {"role": "assistant", "content": "ok", "tool_calls": [call("f")]}


# ---- the chat template ---------------------------------------------------------------------------------------


def test_a_template_without_tool_support_is_refused_with_how_to_supply_one():
    with pytest.raises(ValueError, match="does not render the tools it is given.*tool calls.*CHATML_TOOLS"):
        check_tool_template(make_tokenizer())  # the tiny models' plain ChatML template
    no_template = make_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="needs a chat template"):
        check_tool_template(no_template)
    check_tool_template(tool_tokenizer())


def test_a_template_that_rerenders_earlier_turns_gets_its_tool_turn_and_one_that_merges_turns_is_refused():
    tok = tool_tokenizer()
    stop = {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}
    # renders an assistant turn with calls differently once more turns follow (as Qwen3's drops earlier thinking):
    # not prefix-preserving, yet the tool turn after the call's end-of-turn is the template's own
    tok.chat_template = CHATML_TOOLS.replace(
        "{% for call in message.get('tool_calls') or [] %}",
        "{% if loop.last %}(thinking){% endif %}{% for call in message.get('tool_calls') or [] %}",
    )
    check_tool_template(tok)
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "multiply", "content": "12"}], stop)
    assert tok.decode(suffix) == "\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"
    # an assistant turn left open when a tool result follows: no token tells where the tool's turn begins
    tok.chat_template = CHATML_TOOLS.replace(
        "{% endif %}}</tool_call>{% endfor %}<|im_end|>\n",
        "{% endif %}}</tool_call>{% endfor %}{% if loop.last %}<|im_end|>{% endif %}\n",
    )
    with pytest.raises(ValueError, match="turns cannot be told apart"):
        check_tool_template(tok)


def test_the_tool_turn_tokens_follow_the_end_of_turn_token():
    tok = tool_tokenizer()
    stop = {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "multiply", "content": "12"}], stop)
    assert tok.decode(suffix) == "\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"


def test_hostile_tools_fail_without_stopping_anything():
    class Unprintable:
        def __str__(self):
            raise RuntimeError("no str")

    def weird(x: int) -> object:
        """Returns something odd.

        Args:
            x: which
        """
        if x == 0:
            raise SystemExit(3)
        return Unprintable()

    tools = ToolSet.of([weird, multiply])
    calls = [call("weird", x=0), call("weird", x=1)]
    calls.append({"type": "function", "function": {"name": "multiply", "arguments": '{"a": 2, "b": 5}'}})
    out = run_calls([calls], [tools], 5.0)[0]
    assert [r.failed for r in out] == [True, True, False] and out[2].content == "10"
    assert "3" in out[0].content and "no str" in out[1].content


def test_a_template_writing_calls_in_another_format_needs_a_response_parser():
    tok = tool_tokenizer()
    tok.chat_template = CHATML_TOOLS.replace("<tool_call>", "<call>").replace("</tool_call>", "</call>")
    with pytest.raises(ValueError, match="no response parser.*writes them differently"):
        check_tool_template(tok)
    tok.response_template = {"placeholder": True}  # the tokenizer's own parser would read them
    check_tool_template(tok)
