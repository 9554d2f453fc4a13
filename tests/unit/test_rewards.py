"""Built-in rewards (shared spec §9): hand-computed values for each function, and pickling of the factories."""

import math
import pickle

import pytest

from grpo.rewards import (
    accuracy_reward,
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    reasoning_accuracy_reward,
    think_format_reward,
)

# Keyword arguments the trainer passes that these rewards do not use.
TRAINER_KWARGS = {"prompts": ["p"], "trainer_state": None, "log_metric": None}


def chat(*texts: str) -> list[list[dict[str, str]]]:
    return [[{"role": "assistant", "content": t}] for t in texts]


def test_accuracy_reward_spec_examples_and_log_columns():
    logged = {}
    rewards = accuracy_reward(
        chat(r"\boxed{\frac{63}{400}}", r"\boxed{3}", r"\boxed{42}"),
        solution=["63/400", "6", "Answer is forty two."],
        log_extra=lambda name, column: logged.__setitem__(name, column),
    )
    assert rewards == [1.0, 0.0, None]
    assert logged["solution"] == ["63/400", "6", "Answer is forty two."]
    assert logged["gold_parsed"][2] == "[unparseable]"
    assert logged["answer_parsed"][2] == "[skipped]"


def test_reasoning_accuracy_reward_uses_text_after_last_delimiter():
    completions = chat(
        r"<think>maybe \boxed{2}</think> The answer is \boxed{\frac{1}{3}}",
        r"<think>maybe \boxed{\frac{1}{3}}</think> The answer is \boxed{\frac{1}{2}}",
        r"<think>first</think> \boxed{5} </think> \boxed{\frac{1}{3}}",
    )
    assert reasoning_accuracy_reward(completions, [r"\frac{1}{3}"] * 3, **TRAINER_KWARGS) == [1.0, 0.0, 1.0]


def test_reasoning_accuracy_reward_without_delimiter_is_zero_not_none():
    logged = {}
    rewards = reasoning_accuracy_reward(
        chat(r"<think>so it is \boxed{\frac{1}{3}}", "no reasoning at all"),
        [r"\frac{1}{3}", "Answer is forty two."],
        log_extra=lambda name, column: logged.__setitem__(name, column),
    )
    assert rewards == [0.0, 0.0]  # incomplete reasoning scores 0.0 even when the gold is unparseable
    assert logged["gold_parsed"] == ["[incomplete reasoning]"] * 2
    assert logged["answer_parsed"] == ["[incomplete reasoning]"] * 2


def test_reasoning_accuracy_reward_unparseable_gold_is_none():
    assert reasoning_accuracy_reward(chat(r"<think>hm</think> \boxed{42}"), ["Answer is forty two."]) == [None]


def test_reasoning_accuracy_reward_custom_delimiters_first_found_in_list_order():
    # "</answer-begins>" is listed first, so it wins although "</think>" occurs earlier in the text.
    completions = chat(r"<think>x</think> \boxed{2} </answer-begins> \boxed{3}", r"<think>x</think> \boxed{3}")
    rewards = reasoning_accuracy_reward(completions, ["3", "3"], reasoning_delimiters=["</answer-begins>", "</think>"])
    assert rewards == [1.0, 1.0]
    assert reasoning_accuracy_reward(chat(r"<think>x</think> \boxed{3}"), ["3"], reasoning_delimiters=["#"]) == [0.0]


def test_think_format_reward():
    texts = [
        "<think>\nThis is my reasoning.\n</think>\nThis is my answer.",  # well formed
        "<think></think>answer",  # an empty think block is valid
        "<think>\nThis is my reasoning.\nThis is my answer.",  # never closed
        "<think>a</think><think>b</think>",  # second <think>
        "<think>a</think> answer <think>",  # second <think> after the block
        "answer <think>a</think>",  # does not start with <think>
        "intro\n<think>a</think>",  # ^ under MULTILINE still has to match at the very start
        " <think>a</think>",  # leading space
        "<think>a\n</think>",  # nothing after the block
    ]
    expected = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert think_format_reward(chat(*texts), **TRAINER_KWARGS) == expected
    assert think_format_reward(texts) == expected  # plain-text completions too


def test_soft_overlong_punishment():
    reward = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    assert reward.__name__ == "soft_overlong_punishment_reward"
    ids = [[1] * n for n in (0, 80, 81, 90, 100, 101, 500)]
    assert reward(completion_ids=ids, **TRAINER_KWARGS) == [0.0, 0.0, -0.05, -0.5, -1.0, -1.0, -1.0]
    hard = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=0)  # a hard cut at 10 tokens
    assert hard(completion_ids=[[1] * 10, [1] * 11]) == [0.0, -1.0]


def test_cosine_scaled_reward_defaults():
    reward = get_cosine_scaled_reward(max_len=100)
    assert reward.__name__ == "cosine_scaled_reward"
    right, wrong = r"\boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}"
    lengths = [0, 50, 100, 300]  # p = 0, 0.5, 1 and 3 clamped to 1
    completions = chat(*[right] * 4, *[wrong] * 4)
    rewards = reward(
        completions=completions,
        solution=[r"\frac{1}{3}"] * 8,
        completion_ids=[[7] * n for n in lengths * 2],
        **TRAINER_KWARGS,
    )
    assert rewards == pytest.approx([1.0, 0.75, 0.5, 0.5, -1.0, -0.75, -0.5, -0.5])


def test_cosine_scaled_reward_custom_bounds_and_unparseable_gold():
    reward = get_cosine_scaled_reward(
        max_len=40, min_value_wrong=-4.0, max_value_wrong=-2.0, min_value_correct=0.0, max_value_correct=2.0
    )
    rewards = reward(
        chat(r"\boxed{3}", r"\boxed{4}", r"\boxed{3}"),
        ["3", "3", "Answer is forty two."],
        [[1] * 10, [1] * 10, [1] * 10],
    )
    # p = 1/4: correct 0 + 1 * (1 + cos(pi/4)); wrong -2 + (-1) * (1 + cos(pi/4)); unparseable gold -> None.
    half_sqrt2 = math.sqrt(2) / 2
    assert rewards[:2] == pytest.approx([1 + half_sqrt2, -3 - half_sqrt2])
    assert rewards[2] is None


def test_repetition_penalty_reward():
    bigram = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)
    assert bigram.__name__ == "repetition_penalty_reward"
    # [1,2,3,4]: 3 bigrams, all unique -> 0. [5]*5: 4 bigrams, 1 unique -> (1 - 1/4) * -1.
    assert bigram(completion_ids=[[1, 2, 3, 4], [5, 5, 5, 5, 5]], **TRAINER_KWARGS) == [0.0, -0.75]

    trigram = get_repetition_penalty_reward()  # ngram_size=3, max_penalty=-1.0
    # [1,2,1,2,1,2]: trigrams 121 212 121 212 -> 2 unique of 4 -> -0.5; [1,2,3]: one trigram -> 0; short -> 0.
    rewards = trigram(completion_ids=[[1, 2, 1, 2, 1, 2], [1, 2, 3], [7, 7], []])
    assert rewards == [-0.5, 0.0, 0.0, 0.0]
    assert all(math.copysign(1.0, r) == 1.0 for r in rewards[1:])  # repeat-free gives +0.0, never -0.0

    scaled = get_repetition_penalty_reward(ngram_size=3, max_penalty=-2.0)
    # [9]*6: 4 trigrams, 1 unique -> (1 - 1/4) * -2.
    assert scaled(completion_ids=[[1, 2, 1, 2, 1, 2], [9] * 6]) == [-1.0, -1.5]
    assert get_repetition_penalty_reward(max_penalty=0.0)(completion_ids=[[9] * 6]) == [0.0]


def test_repetition_penalty_rejects_positive_max_penalty():
    with pytest.raises(ValueError, match="max_penalty"):
        get_repetition_penalty_reward(max_penalty=0.5)


def test_factory_rewards_survive_pickling():
    soft = pickle.loads(pickle.dumps(get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)))
    assert soft.__name__ == "soft_overlong_punishment_reward"
    assert soft(completion_ids=[[1] * 90]) == [-0.5]

    repetition = pickle.loads(pickle.dumps(get_repetition_penalty_reward(ngram_size=2, max_penalty=-2.0)))
    assert repetition.__name__ == "repetition_penalty_reward"
    assert repetition(completion_ids=[[5, 5, 5, 5, 5]]) == [-1.5]

    cosine = pickle.loads(pickle.dumps(get_cosine_scaled_reward(max_len=100)))
    assert cosine.__name__ == "cosine_scaled_reward"
    assert cosine(chat(r"\boxed{\frac{1}{3}}"), [r"\frac{1}{3}"], [[1] * 100]) == [0.5]
