"""What rollout_func returns, checked before anything uses it: each malformed token id, log-prob or mask entry is one
ValueError naming the field, the row (and position), the value and the rule; an extra field named like a keyword
the trainer passes reward functions itself is refused, naming it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpo import GRPOConfig
from grpo.agent.rollouts import Rollouts
from grpo.data.prompts import RESERVED_COLUMNS, PromptSource, end_of_turn_ids
from support.tiny import make_model, make_tokenizer

N = 4  # rows per call


def rollouts(output):
    """Rollouts over a tiny policy (vocabulary: len(tokenizer)) whose rollout_func returns `output` (a function of
    the number of prompts, or a dict)."""
    tok = make_tokenizer()
    model = make_model(tok)
    args = GRPOConfig(output_dir="x", per_device_train_batch_size=4, num_generations=2)
    source = PromptSource([{"prompt": f"p{i}"} for i in range(N)], tok)
    trainer = SimpleNamespace(unwrapped_model=model, processing_class=tok)

    def rollout_func(prompts, trainer):
        return output(len(prompts)) if callable(output) else output

    made = Rollouts(None, source, args, end_of_turn_ids(tok), lambda x: x, rollout_func=rollout_func, trainer=trainer)
    return made, len(tok)


def good(n=N):
    return {
        "prompt_ids": [[5, 6, 7] for _ in range(n)],
        "completion_ids": [[8, 9] for _ in range(n)],
        "logprobs": [[-0.5, -1.25] for _ in range(n)],
    }


def with_row(key, row, value, n=N):
    out = good(n)
    out[key] = [list(r) for r in out[key]]
    out[key][row] = value
    return out


def run(output):
    made, _ = rollouts(output)
    return made(list(range(N)), [{"prompt": f"p{i}"} for i in range(N)])


def test_a_good_output_passes_with_ints_of_other_types_and_an_empty_completion():
    out = good()
    out["prompt_ids"][1] = torch.tensor([5, 6])  # a tensor row, numpy-like ints: read as ints
    out["completion_ids"][2] = []  # an empty completion is legitimate (truncated at once, nothing trained)
    out["logprobs"][2] = []
    out["logprobs"][3] = [0, -1]  # an int log-prob (0: probability 1)
    generated = run(out)
    assert generated.rollout.prompt_ids[1] == [5, 6] and all(type(t) is int for t in generated.rollout.prompt_ids[1])
    assert generated.rollout.completion_ids[2] == [] and generated.rollout.truncated[2]
    assert generated.rollout.sampling_logps[3] == [0.0, -1.0]


VOCAB = len(make_tokenizer())


@pytest.mark.parametrize(
    "output, pattern",
    [
        (with_row("prompt_ids", 3, []), r"prompt_ids\[3\] = \[\], an empty prompt"),
        (
            with_row("prompt_ids", 1, [5, VOCAB]),
            rf"prompt_ids\[1\]\[1\] = {VOCAB}, past the policy's vocabulary of {VOCAB} ids; .*\[0, {VOCAB}\)",
        ),
        (with_row("completion_ids", 2, [8, VOCAB + 7]), rf"completion_ids\[2\]\[1\] = {VOCAB + 7}, past the policy"),
        (with_row("prompt_ids", 0, [5, -1]), r"prompt_ids\[0\]\[1\] = -1, a negative id; .*\[0, "),
        (with_row("completion_ids", 1, [8.0, 9]), r"completion_ids\[1\]\[0\] = 8.0 \(float\); token ids are ints"),
        (with_row("prompt_ids", 2, [5, True]), r"prompt_ids\[2\]\[1\] = True \(bool\); token ids are ints"),
        (with_row("prompt_ids", 2, [None]), r"prompt_ids\[2\]\[0\] = None \(NoneType\); token ids are ints"),
        (with_row("prompt_ids", 1, [[5, 6]]), r"prompt_ids\[1\]\[0\] = \[5, 6\] \(list\); token ids are ints"),
        (with_row("completion_ids", 0, 8), r"completion_ids\[0\] = 8 \(int\), not a list of token ids"),
        (with_row("prompt_ids", 0, "abc"), r"prompt_ids\[0\] = 'abc' \(str\), not a list of token ids"),
        (with_row("logprobs", 3, [-0.5]), r"row 3 has 2 completion ids but 1 logprobs"),
        (with_row("logprobs", 1, [-0.5, float("nan")]), r"logprobs\[1\]\[1\] = nan; a log-probability is finite"),
        (with_row("logprobs", 1, [float("-inf"), -1]), r"logprobs\[1\]\[0\] = -inf; a log-probability is finite"),
        (with_row("logprobs", 2, [-0.5, 0.3]), r"logprobs\[2\]\[1\] = 0.3, positive; a log-probability is <= 0"),
        (with_row("logprobs", 0, [-0.5, "x"]), r"logprobs\[0\]\[1\] = 'x' \(str\); a log-probability is a number"),
        (with_row("logprobs", 0, [None, -1.0]), r"logprobs\[0\]\[0\] = None \(NoneType\); a log-probability is a"),
        (with_row("logprobs", 2, [False, -1.0]), r"logprobs\[2\]\[0\] = False \(bool\); a log-probability is a"),
        (with_row("logprobs", 2, 0.5), r"logprobs\[2\] = 0.5 \(float\), not a list of log-probabilities"),
        (dict(good(), env_mask=[[1, 2]] * N), r"env_mask\[0\]\[1\] = 2; a mask entry is 0 or 1"),
        (dict(good(), env_mask=[[1]] * N), r"row 0 has 2 completion ids but 2 logprobs and 1 env_mask entries"),
    ],
)
def test_each_bad_entry_is_one_error_naming_row_value_and_rule(output, pattern):
    prefix = "" if pattern.startswith("row ") else r"^rollout_func returned "
    with pytest.raises(ValueError, match=prefix + pattern):
        run(output)


def test_the_vocabulary_is_the_policys_not_the_tokenizers():
    """A model whose embedding table is wider than its tokenizer (padded, as many are): ids up to the table's
    size are valid, the first past it is not."""
    made, _ = rollouts(lambda n: good(n))
    made.trainer.unwrapped_model.resize_token_embeddings(VOCAB + 10)
    last = VOCAB + 9
    made.rollout_func = lambda prompts, trainer: with_row("prompt_ids", 0, [5, last])
    made(list(range(N)), [{"prompt": "p"}] * N)
    made.rollout_func = lambda prompts, trainer: with_row("prompt_ids", 0, [5, last + 1])
    with pytest.raises(ValueError, match=rf"prompt_ids\[0\]\[1\] = {last + 1}, past the policy's vocabulary of"):
        made(list(range(N)), [{"prompt": "p"}] * N)


@pytest.mark.parametrize("name", [n for n in RESERVED_COLUMNS if n != "completion_ids"])  # (that one is the rollout's)
def test_an_extra_field_named_like_the_trainers_own_keyword_is_refused(name):
    with pytest.raises(
        ValueError, match=rf"rollout_func returned a field '{name}'.*trainer's own '{name}'.*Rename the field"
    ):
        run(dict(good(), **{name: ["x"] * N}))


def test_the_reserved_names_are_every_keyword_the_trainer_passes_reward_functions():
    """The list the checks use is what RewardFunctions passes besides the dataset columns (nothing more, nothing
    less), so neither a dataset column nor a rollout_func field can shadow one unnoticed."""
    from grpo.base.records import Rollout
    from grpo.rewards.calling import RewardFunctions

    seen = {}

    def probe(**kwargs):
        seen.update(kwargs)
        return [0.0]

    rollout = Rollout([[1]], [[2]], [[-0.1]], [False], ["b"])
    state = SimpleNamespace(log_history=[])
    RewardFunctions([probe], None)([{"prompt": "a", "col": 1}], rollout, state, lambda *a: None, lambda *a: None)
    assert set(seen) - {"col"} == set(RESERVED_COLUMNS)


@pytest.mark.parametrize("where", ["live", "column"])
def test_reward_keywords_are_never_shadowed_where_they_are_built(where):
    """The last word, where the keywords are assembled: a live column (rollout_func's fields) or a dataset column
    (a stream's later row, which the construction-time check does not read) named like the trainer's keyword is
    an error naming it, never a silent replacement or `dict() got multiple values`."""
    from grpo.base.records import Rollout
    from grpo.rewards.calling import RewardFunctions

    rollout = Rollout([[1]], [[2]], [[-0.1]], [False], ["b"])
    state = SimpleNamespace(log_history=[])
    example = {"prompt": "a", **({"trainer_state": 1} if where == "column" else {})}
    live = {"trainer_state": ["mine"]} if where == "live" else None
    with pytest.raises(ValueError, match=r"named 'trainer_state', but reward functions receive the trainer's own"):
        RewardFunctions([lambda **kw: [0.0]], None)([example], rollout, state, print, print, live=live)
