"""A tool result too long for the completion budget is refused from its length, before it is tokenized (issue #32
item 9: a 4 MB result took 10-19 s to tokenize before the budget check). The bound (`grpo.agent.budget`) never
refuses a result that tokenizing would let in: rollouts are identical with and without it, on both sides of the
budget, and on tokenizers with long tokens, normalizers and stripping added tokens the bound holds."""

from __future__ import annotations

import random
import unicodedata

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from grpo.agent import CHATML_TOOLS
from grpo.agent.budget import COMPOSED, Span, token_span
from grpo.agent.template import cannot_fit, tool_suffix_ids
from support.agent import GROUPS, make_trainer
from support.runs import generate
from support.tiny import SPECIALS, make_tokenizer

WORDS = ["alpha", "beta", "gamma", "delta", "x" * 40, "  ", "\n", "é", "e\u0301", "日本", "<|im_end|>"]
U_DIAERESIS_MACRON = "\u01d6"  # one character of 2 bytes, which NFC composes from 3 characters
# where a bound that ignored composition or whitespace-taking added tokens would refuse results that fit
HARD = ["a" + " " * 5000, unicodedata.normalize("NFD", U_DIAERESIS_MACRON) * 64 * 200, "x" * 5000]


def dump(n: int) -> str:
    """Returns a text of n characters.

    Args:
        n: How many characters.
    """
    return "x" * n


def words(n: int) -> str:
    """Returns n characters of words.

    Args:
        n: How many characters.
    """
    rng = random.Random(n)
    text = " ".join(rng.choice(WORDS[:5]) for _ in range(n // 4 + 1))
    return text[:n]


def calling(tool, n):
    call = f'<tool_call>{{"name": "{tool}", "arguments": {{"n": {n}}}}}</tool_call>'
    return lambda text, turn, j: call if turn == 0 else "6"


def record_tokenized(tok):
    """The lengths of the texts `tok` tokenizes, from now on."""
    lengths, encode = [], tok._encode_plus

    def recording(text, *args, **kwargs):
        lengths.append(len(text) if isinstance(text, str) else sum(map(len, text)))
        return encode(text, *args, **kwargs)

    tok._encode_plus = recording
    return lengths


@pytest.mark.parametrize("tool", [dump, words])
def test_a_4mb_result_ends_its_row_without_being_tokenized(tmp_path, tool):
    trainer = make_trainer(tmp_path, calling(tool.__name__, 4_000_000), tools=(tool,))
    lengths = record_tokenized(trainer.processing_class)
    rollout = generate(trainer, GROUPS).rollout
    assert rollout.tool_calls == [1] * 8
    assert all([m["role"] for m in messages] == ["assistant"] for messages in rollout.messages)  # the row ended
    assert max(lengths) < 10_000  # the prompts and the calls; never the result


def test_rollouts_equal_tokenizing_every_result_whole(tmp_path):
    """Results on both sides of what fits (budget 200) and of where the length alone decides: the same rollout
    with the bound as without it, and the bound decided the long ones without tokenizing them."""
    trainer = make_trainer(tmp_path, None, tools=(dump, words))
    loop, engine = trainer.parts.rollouts.loop, trainer.engine
    assert loop.span == Span(len("<|im_start|>"))  # a character-level vocabulary: its longest added token
    lengths = record_tokenized(trainer.processing_class)
    for tool in ("dump", "words"):
        room = {d: 200 - len(engine.turn_ids(calling(tool, 10 ** (d - 1))("", 0, 0))) for d in (3, 4, 5)}  # by digits
        small = [room[3] - 22, room[3] - 21, room[3] - 20]  # a result of n characters is n + 20 tokens here
        for n in [*small, 12 * room[4] - 30, 12 * room[4] - 1, 12 * room[4], 12 * room[4] + 5, 20_000]:
            engine.script = calling(tool, n)
            loop.span = token_span(trainer.processing_class)
            lengths.clear()
            fast = generate(trainer, GROUPS).rollout
            assert (max(lengths) < n) == (n >= 12 * room[len(str(n))]), n  # the length decides from 12 x room
            loop.span = None  # every result tokenized whole
            slow = generate(trainer, GROUPS).rollout
            assert fast.completion_ids == slow.completion_ids and fast.messages == slow.messages, (tool, n)
            assert fast.loss_mask == slow.loss_mask and fast.tool_calls == slow.tool_calls
            assert (len(fast.messages[0]) == 3) == (n < room[3] - 20), n  # only the shortest were let in


def byte_level_bpe(normalizer=None, strip=False):
    """A byte-level BPE tokenizer with long tokens ("x" * 64, runs of spaces) and the ChatML tool template."""
    core = Tokenizer(models.BPE())
    core.normalizer = normalizer
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    corpus = ["x" * 64] * 50 + [" " * 32] * 50 + [" ".join(WORDS)] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>")
    if strip:
        tok.add_special_tokens({"additional_special_tokens": [AddedToken("<|im_end|>", rstrip=True, lstrip=True)]})
    tok.chat_template = CHATML_TOOLS
    return tok


def doubling_bpe(unit, normalizer, longest=64):
    """A byte-level BPE tokenizer whose tokens are runs of `unit` of 1, 2, 4, ... `longest` (a long run becomes
    tokens of `longest` units each)."""
    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    unit_bytes = level.pre_tokenize_str(unit)[0][0]
    merges, token = [], unit_bytes[0]
    for piece in unit_bytes[1:]:  # the unit from its bytes
        merges.append((token, piece))
        token += piece
        vocab[token] = len(vocab)
    while len(token) < longest * len(unit_bytes):  # then runs of 2, 4, ... units
        merges.append((token, token))
        token += token
        vocab[token] = len(vocab)
    core = Tokenizer(models.BPE(vocab, merges))
    core.normalizer, core.pre_tokenizer, core.decoder = normalizer, level, decoders.ByteLevel()
    core.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>")


TOKENIZERS = {
    "characters": lambda: make_tokenizer(),
    "byte-level": lambda: byte_level_bpe(),
    "nfc": lambda: byte_level_bpe(normalizers.NFC()),
    "sequence": lambda: byte_level_bpe(normalizers.Sequence([normalizers.Replace("xxxx", "y"), normalizers.NFKC()])),
    "stripping": lambda: byte_level_bpe(strip=True),
    "composing runs": lambda: doubling_bpe(U_DIAERESIS_MACRON, normalizers.NFC()),
}


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_bound_never_refuses_a_result_that_fits(name):
    """On random results of long tokens, whitespace runs, combining accents and stop-token strings: whenever the
    length alone refuses a result, its tokens do not fit either; and the bound does refuse long ones."""
    tok = TOKENIZERS[name]()
    tok.chat_template = CHATML_TOOLS
    stops = {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}
    span = token_span(tok)
    assert span is not None and span.longest >= (12 if name == "characters" else 32)
    rng = random.Random(0)
    refused = 0
    texts = [
        *HARD,
        *("".join(rng.choice(WORDS) * rng.randint(1, 30) for _ in range(rng.randint(1, 40))) for _ in range(100)),
    ]
    for trial, text in enumerate(texts):
        messages = [{"role": "tool", "name": "dump", "content": text}]
        n = len(tool_suffix_ids(tok, messages, stops))
        for room in (1, 2, 5, 20, n // 4, n // 2, n, n + 1):
            if cannot_fit(tok, messages, stops, room, span):
                refused += 1
                assert n >= room, (name, trial, room, n)
    assert refused > 0


def test_tokenizers_whose_characters_can_vanish_have_no_bound():
    tok = make_tokenizer()
    assert token_span(tok) == Span(12)
    for normalizer in (normalizers.Strip(), normalizers.StripAccents(), normalizers.Replace(" ", "")):
        tok.backend_tokenizer.normalizer = normalizer
        assert token_span(tok) is None, normalizer
    tok.backend_tokenizer.normalizer = None
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # a word-level vocabulary by words
    assert token_span(tok) is None
    assert token_span(byte_level_bpe(normalizers.NFC())).composes == "NFC"
    assert token_span(byte_level_bpe(normalizers.Sequence([normalizers.NFC()]))).shrink == COMPOSED
    assert token_span(byte_level_bpe(strip=True)).strips
