"""How many characters one token can stand for, so that a tool result too long for the completion budget is refused
from its length, before it is tokenized (a 4 MB result took 10-19 s to tokenize, with SIGTERM waiting, only to
be refused).

The bound: if each token stands for at most `longest x shrink` characters of the text it is tokenized from, a text
of C characters becomes at least C / (longest x shrink) tokens, whatever the text. Both numbers are read from the
tokenizer's `tokenizers` backend:

- `longest`: its longest token string, added tokens included. A byte-level BPE vocabulary writes one character per
  byte, so a token's string is never shorter than the text it stands for; SentencePiece writes a space as one "▁";
  a byte-fallback token ("<0xE2>") stands for part of one character.
- `shrink`: how much its normalizer can shorten a text before the tokens are cut: a `Replace` of a string by a
  shorter one (their ratio); NFC/NFKC compose at most 4 characters into one (the longest canonical
  decomposition), and none at all in a text already in that form.
- An added token that takes the whitespace beside it (`lstrip`/`rstrip`) can stand for any run of whitespace:
  then only the other characters are counted.

Where characters can vanish without a token (a normalizer or pre-tokenizer that strips or removes characters, an
unknown token that stands for a whole word, a tokenizer without a `tokenizers` backend) there is no bound
(`token_span` is None) and every result is tokenized whole. So a result is refused from its length only when
tokenizing it would refuse it too: what is trained never changes, only how much text is tokenized.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

COMPOSED = 4  # NFC/NFKC compose at most this many characters into one (the longest canonical decomposition)
_KEEP_CHARACTERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}  # pre-tokenizers
_CHARACTER_SPLIT = {"type": "Split", "pattern": {"String": ""}, "behavior": "Isolated", "invert": False}
Composition = Literal["NFC", "NFKC"]  # the normalizers that compose characters


@dataclass(frozen=True)
class Span:
    longest: int  # the longest token string
    shrink: Fraction = Fraction(1)  # how much the normalizer can shorten any text
    # the normalizer is this composition alone: it shortens no text already in its form
    composes: Composition | None = None
    strips: bool = False  # an added token takes the whitespace beside it: whitespace is not counted

    def at_least(self, text: str, start: int, tokens: float) -> bool:
        """Whether the tokens that cover `text[start:]`, `text` being what the tokenizer is given, are certain to
        number `tokens` or more."""
        region = text[start:]
        chars = len("".join(region.split())) if self.strips else len(region)
        shrink = self.shrink
        if self.composes is not None and not unicodedata.is_normalized(self.composes, text):
            shrink *= COMPOSED
        return chars >= tokens * self.longest * shrink


def token_span(tokenizer: Any) -> Span | None:
    """The tokenizer's `Span` (see the module docstring), or None where it has no bound."""
    backend: Any = getattr(tokenizer, "backend_tokenizer", None)  # None: the AttributeError below
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # no `tokenizers` backend (a slow tokenizer), or one that does not serialize
        return None
    normalizer, model = _normalizer(spec.get("normalizer")), spec.get("model") or {}
    if normalizer is None or not _keeps_characters(spec.get("pre_tokenizer")) or not _bounded(model, spec):
        return None
    added = spec.get("added_tokens") or []
    vocab = model.get("vocab") or {}
    longest = max([len(token) for token in vocab] + [len(t["content"]) for t in added], default=0)
    if longest == 0:
        return None
    strips = any(t.get("lstrip") or t.get("rstrip") for t in added)
    return Span(longest, normalizer[0], normalizer[1], strips)


def _normalizer(spec: dict | None) -> tuple[Fraction, Composition | None] | None:
    """(shrink, composition form) of a normalizer; None where it can remove characters."""
    if spec is None:
        return Fraction(1), None
    kind = spec.get("type")
    if kind in ("NFC", "NFKC"):
        return Fraction(1), kind
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"):  # these never shorten a text
        return Fraction(1), None
    if kind == "Replace":
        pattern, content = (spec.get("pattern") or {}).get("String"), spec.get("content") or ""
        if pattern is None or not content:  # a regular expression, or a removal
            return None
        return max(Fraction(1), Fraction(len(pattern), len(content))), None
    if kind == "Sequence":
        shrink = Fraction(1)
        for part in spec.get("normalizers") or ():
            got = _normalizer(part)
            if got is None:
                return None
            shrink *= got[0] * (COMPOSED if got[1] else 1)  # in a sequence, composition counts in full
        return shrink, None
    return None  # Strip, StripAccents, BertNormalizer, Nmt, Precompiled: characters can vanish


def _keeps_characters(spec: dict | None) -> bool:
    if spec is None:
        return True
    if spec.get("type") == "Sequence":
        return all(_keeps_characters(part) for part in spec.get("pretokenizers") or ())
    return spec.get("type") in _KEEP_CHARACTERS and spec.get("behavior") != "Removed"  # not Whitespace(Split)


def _bounded(model: dict, spec: dict) -> bool:
    """Whether every token of the model is one of its vocabulary's strings, for a part of the text no longer."""
    if model.get("type") == "BPE":  # an unknown character is a byte, or one unknown token each
        byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))
        return not model.get("fuse_unk") and bool(model.get("byte_fallback") or model.get("unk_token") or byte_level)
    # a word-level vocabulary gives one token per word (an unknown one too): bounded where each word is a character
    return model.get("type") == "WordLevel" and spec.get("pre_tokenizer") == _CHARACTER_SPLIT
