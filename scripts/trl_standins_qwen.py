"""A tokenizer laid out like Qwen2.5/Qwen3's, for the TRL tests that script a model's output as Qwen token ids.

Several tests in TRL's GRPO test file (``test_train_with_tools``, ``test_train_with_environment_*``,
``test_train_with_malformed_tool_calls``, ``test_train_with_mask_truncated_completions``, ...) patch ``generate`` to
return hard-coded ids of the real Qwen tokenizer (``151657`` = ``<tool_call>``, ``151645`` = ``<|im_end|>``, ``198`` =
newline, ...). SmolLM2's tokenizer, which the other stand-ins use, has 49152 ids, so those ids do not exist there.

`qwen_layout_tokenizer` keeps SmolLM2's byte-level BPE (pre-tokenizer, merges, decoder), so ordinary text encodes as it
does with SmolLM2, but re-indexes the vocabulary to Qwen's layout:

- ids 0..255 are the 256 byte tokens in GPT-2's ``bytes_to_unicode`` order (as in Qwen);
- every id the tests use holds the string the real Qwen tokenizer has there (`QWEN_TEST_TOKENS`); strings SmolLM2 lacks
  are added as vocabulary entries no merge produces, so they only matter for decoding;
- SmolLM2's other tokens fill the free ids from 256 upwards, and unique filler entries (``[unused<id>]``) the rest up
  to 151642;
- Qwen's 26 special and added tokens sit at 151643..151668, so ``len(tokenizer) == 151669`` as on the real model.
"""

from __future__ import annotations

import json
from pathlib import Path

import transformers
from tokenizers import Tokenizer

# Qwen2.5/Qwen3 vocabulary size before the added tokens: ids 0..151642 are the BPE vocabulary.
QWEN_BPE_SIZE = 151643

# Qwen's added tokens, at 151643.. in this order; the ``<|...|>`` ones are special, the tag-like ones are not (so
# ``skip_special_tokens=True`` keeps ``<tool_call>`` and ``<think>`` in the text, as with the real tokenizer).
QWEN_ADDED_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

# The Qwen id -> text of every non-byte, non-special token that TRL's GRPO test file (tests/test_grpo_trainer.py, TRL
# 1.16) uses in its scripted completions. Read off the test file's comments: each hard-coded id list is commented with
# its decoded text, and aligning the two (byte ids < 256 and the special ids are known; an id that recurs in several
# lists must mean the same text in all) gives these strings, split the way a BPE vocabulary naturally would. The
# texts are plain strings; `_byte_level` maps them to the vocabulary's byte-level form (" " -> "Ġ", "\n" -> "Ċ").
QWEN_TEST_TOKENS = {
    293: " b",  # '{a: 3, b: 4}'
    314: " {",  # '"arguments": {a: 3, ...'
    330: ' "',  # '"name": "multiply_tool"'
    397: ">\n",  # '<toolcall>\n'
    411: "out",  # 'sh' 'out'
    450: "de",  # 'de' 'crement'
    497: '",',  # '"multiply_tool",'
    522: "</",  # '</toolcall>'
    606: "name",
    788: '":',
    894: " any",  # "I don't know any tool"
    927: "sh",
    944: "'t",  # "don't", "won't"
    1318: "text",  # '{"text": "hi"}'
    1414: " know",
    1513: " don",
    2765: " won",
    4913: '{"',
    5212: ' {"',
    5392: " tool",
    6023: "hi",
    6659: "call",  # 'tool' 'call' in '<toolcall>'
    7692: "async",
    9520: "step",
    11248: "}}\n",
    13477: "crement",
    14172: "tool",
    16252: " increment",  # "I won't increment"
    16370: "arguments",
    17453: "Done",
    22785: "_tool",
    35744: "increment",
    64648: "multiply",
    93054: "_multiply",  # 'async' '_multiply' '_tool'
    95642: '"}}\n',  # '"hi"}}\n'
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, in its order (the order of the 256 byte tokens at ids 0..255)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _byte_level(text: str) -> str:
    table = bytes_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def _qwen_vocab(smol_vocab: dict[str, int], smol_special: set[str]) -> dict[str, int]:
    """SmolLM2's vocabulary (less its special tokens) re-indexed to Qwen's layout, filled up to `QWEN_BPE_SIZE`."""
    vocab: dict[str, int] = {}
    for i, char in enumerate(bytes_to_unicode().values()):
        vocab[char] = i
    for i, text in QWEN_TEST_TOKENS.items():
        token = _byte_level(text)
        if token in vocab:
            raise ValueError(f"{text!r} is at both {vocab[token]} and {i}")
        vocab[token] = i
    taken = set(vocab.values())
    free = (i for i in range(QWEN_BPE_SIZE) if i not in taken)
    for token, _ in sorted(smol_vocab.items(), key=lambda kv: kv[1]):
        if token not in vocab and token not in smol_special:
            vocab[token] = next(free)
    for i in free:
        vocab[f"[unused{i}]"] = i
    if len(vocab) != QWEN_BPE_SIZE or set(vocab.values()) != set(range(QWEN_BPE_SIZE)):
        raise ValueError("re-indexed vocabulary does not cover ids 0..151642 exactly once")
    return vocab


def qwen_layout_tokenizer(chat_template: str, eos: str = "<|im_end|>") -> transformers.PreTrainedTokenizerFast:
    """SmolLM2's byte-level BPE tokenizer re-indexed to Qwen2.5/Qwen3's id layout, with `chat_template`.

    Encoding uses SmolLM2's merges; every id in TRL's scripted completions decodes to the real Qwen tokenizer's text.
    ``eos_token`` is `eos`, ``pad_token`` is ``<|endoftext|>`` (151643), there is no BOS token, and the vocabulary has
    151669 ids.
    """
    from grpo.models.bundled import bundled_model_path

    spec = json.loads((Path(bundled_model_path()) / "tokenizer.json").read_text())
    smol_special = {t["content"] for t in spec["added_tokens"]}
    spec["model"]["vocab"] = _qwen_vocab(spec["model"]["vocab"], smol_special)
    spec["model"]["unk_token"] = None
    spec["added_tokens"] = [
        {
            "id": QWEN_BPE_SIZE + k,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": content.startswith("<|"),
        }
        for k, content in enumerate(QWEN_ADDED_TOKENS)
    ]
    backend = Tokenizer.from_str(json.dumps(spec))
    for k, content in enumerate(QWEN_ADDED_TOKENS):
        if backend.token_to_id(content) != QWEN_BPE_SIZE + k:
            raise ValueError(f"{content} did not land at id {QWEN_BPE_SIZE + k}")
    specials = [t for t in QWEN_ADDED_TOKENS if t.startswith("<|") and t != "<|endoftext|>"]
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token=eos,
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=specials,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
    )
    if len(tok) != QWEN_BPE_SIZE + len(QWEN_ADDED_TOKENS):
        raise ValueError(f"tokenizer has {len(tok)} ids, expected 151669")
    return tok
