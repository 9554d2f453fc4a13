"""Prompt text the tokenizer cannot encode: a lone UTF-16 surrogate (valid JSON, "\\ud800", and a valid Python str)
is refused naming the dataset, the row and the field, when the dataset is checked and again where the prompt is
tokenized (a stream's rows, an environment's prompts), never a bare tokenizer TypeError."""

from __future__ import annotations

import json

import pytest

from grpo.data.prompts import PromptSource, check_dataset, make_prompt
from support.tiny import make_tokenizer

LONE = json.loads('"ab\\ud800c"')  # what json.loads gives for the valid JSON string "ab\ud800c"


def rows(bad_row, prompt, n=6):
    return [{"prompt": f"fine {i}"} for i in range(bad_row)] + [{"prompt": prompt}] + [{"prompt": "x"}] * n


@pytest.mark.parametrize(
    "prompt, field",
    [
        (LONE, r"the prompt"),
        ([{"role": "system", "content": "s"}, {"role": "user", "content": LONE}], r"prompt\[1\]\['content'\]"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": LONE}]}],
            r"prompt\[0\]\['content'\]\[1\]\['text'\]",
        ),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\udfff"}], r"prompt\[1\]\['content'\]"),
    ],
    ids=["string", "message", "content-block", "low-surrogate"],
)
def test_the_dataset_check_names_the_row_and_field(prompt, field):
    with pytest.raises(
        ValueError, match=rf"train_dataset row 3: {field} holds a lone UTF-16 surrogate .* at character"
    ):
        check_dataset(rows(3, prompt))


def test_a_valid_surrogate_pair_and_astral_characters_pass():
    check_dataset(rows(3, json.loads('"emoji \\ud83d\\ude00"')))  # JSON's pair: one character, U+1F600
    check_dataset(rows(3, [{"role": "user", "content": "\U0001f600"}]))


@pytest.mark.parametrize("prompt", [LONE, [{"role": "user", "content": LONE}]], ids=["string", "conversational"])
def test_tokenizing_refuses_it_naming_the_row_not_a_bare_tokenizer_error(prompt):
    tok = make_tokenizer()
    with pytest.raises(ValueError, match=r"eval_dataset row 5: .* lone UTF-16 surrogate '\\ud800' at character 2"):
        make_prompt(prompt, tok, row=5, dataset="eval_dataset")
    source = PromptSource([{"prompt": "fine"}, {"prompt": prompt}], tok)
    source[0]
    with pytest.raises(ValueError, match=r"train_dataset row 1: .*lone UTF-16 surrogate"):
        source[1]
