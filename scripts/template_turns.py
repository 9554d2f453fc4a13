"""Which chat templates re-render earlier assistant turns in a tool loop: python scripts/template_turns.py DIR [DIR ...]

For each `*.jinja` chat template in the folders given (for example the ones TRL ships, `trl/chat_templates` in an
installed TRL; `*_training.jinja` patches are skipped), prints a markdown table row: whether the template renders a
tool-calling conversation (the tools, the assistant's calls, the tools' results: `grpo.agent.template.
tool_parts_dropped`), and what `turn_context="auto"` picks for it (`grpo.agent.template.rerendering`), with the
template's defaults and with `enable_thinking=False`: "rendered" and how it re-renders, or "appended" ("-" where
the template does not render tool calls: grpo refuses it for tools).

The templates are rendered by a plain tokenizer (GPT-2's byte-level vocabulary, built here from nothing), so only
their text counts: tokens, stop tokens and response parsers are the model's own business (grpo checks those when a
trainer is built with tools). A template that cannot render the sentinel conversation says why.
"""

from __future__ import annotations

import glob
import os
import sys

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from grpo.agent.template import rerendering, tool_parts_dropped

SETTINGS = {"defaults": {}, "enable_thinking=False": {"enable_thinking": False}}


def tokenizer(template: str) -> PreTrainedTokenizerFast:
    """A tokenizer whose only use is rendering `template` to text."""
    bare = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    bare.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=bare, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = template
    return tok


def row(path: str) -> str:
    tok = tokenizer(open(path, encoding="utf-8").read())
    try:
        dropped, _ = tool_parts_dropped(tok)
        tools = "yes" if not dropped else "no: drops " + ", ".join(dropped)
    except Exception as err:  # the template's own refusal
        tools = f"no: raises {type(err).__name__} ({str(err)[:50]})"
    picks = []
    for kwargs in SETTINGS.values():
        how = rerendering(tok, kwargs) if tools == "yes" else None
        picks.append("-" if tools != "yes" else f"rendered: {how}" if how else "appended")
    name = os.path.basename(path).removesuffix(".jinja")
    return f"| {name} | {tools} | " + " | ".join(picks) + " |"


def main() -> None:
    paths = sorted(p for d in sys.argv[1:] for p in glob.glob(os.path.join(d, "*.jinja")) if "_training" not in p)
    if not paths:
        sys.exit("usage: python scripts/template_turns.py DIR [DIR ...]  (folders of *.jinja chat templates)")
    print("| template | renders tools | " + " | ".join(f"auto, {s}" for s in SETTINGS) + " |")
    print("|---|---|" + "---|" * len(SETTINGS))
    for path in paths:
        print(row(path))


if __name__ == "__main__":
    main()
