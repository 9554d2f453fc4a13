"""Write docs/config.md, the configuration reference, from `GRPOConfig`'s fields: each field's type, default and
help text, grouped as the config groups them, with how it compares to TRL 1.16 (from
`src/grpo/config/trl_1_16_fields.md`, which `grpo.config.compat` also reads).

    python scripts/config_reference.py           # rewrite docs/config.md
    python scripts/config_reference.py --check   # exit 1 if docs/config.md is out of date

`tests/unit/test_config_reference.py` fails when the committed page differs from what this writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from grpo.config import GRPOConfig, compat  # noqa: E402
from grpo.config.async_config import ASYNC_ONLY, AsyncGRPOConfig  # noqa: E402

PAGE = ROOT / "docs" / "config.md"
COMMAND = "python scripts/config_reference.py"

# The config's field groups, in the order a reader looks for them, with their section titles.
SECTIONS = {
    "GenerationFields": "Generation",
    "LossFields": "Loss, advantages and the reference model",
    "ModelFields": "The model",
    "VLLMFields": "vLLM",
    "OptimizationFields": "Optimization and schedule",
    "PrecisionFields": "Precision, memory and compilation",
    "OutputFields": "Output and resuming",
    "CheckpointFields": "Checkpoints",
    "LoggingFields": "Logging and trackers",
    "CompletionLogFields": "The completions log",
    "EvaluationFields": "Evaluation",
    "HubFields": "The Hugging Face Hub",
    "DistributedFields": "Processes and data loading",
    "GrpoOnlyFields": "grpo's own settings",
}

# Fields that keep TRL's name and default but behave differently in a way a user of TRL would notice. The field
# list marks them "works" (their effect is honoured); these notes say what differs.
BEHAVES_DIFFERENTLY = {
    "average_tokens_across_devices": "False: each process divides dapo/cispo/vespo by its own tokens (the HF "
    "Trainer's meaning); TRL 1.16's GRPO always divides by every process's",
    "tf32": "True without an Ampere or newer GPU warns (the HF Trainer refuses it)",
    "disable_dropout": "also zeroes the dropout probabilities layers pass to functional dropout, which TRL leaves on",
    "sync_ref_model": "refused under FSDP; the mixed reference is saved in checkpoints, so a resumed run keeps it",
    "output_dir": "made absolute when the trainer is built",
    "entropy_coef": "the logged policy_loss is the loss without the bonus for every loss type (TRL 1.16 logs 1/GA of "
    "it for dapo, cispo and vespo under gradient accumulation)",
    "vllm_importance_sampling_correction": "the sampling/* metrics are logged for every engine (TRL 1.16: vLLM only)",
}


def type_name(hint: Any) -> str:
    """`Optional[Union[dict, str]]` as `dict | str | None`."""
    if hint is type(None):
        return "None"
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        names = [type_name(a) for a in args if a is not type(None)]
        return " | ".join(names + (["None"] if type(None) in args else []))
    if typing.get_origin(hint) is not None:
        return f"{typing.get_origin(hint).__name__}[{', '.join(type_name(a) for a in typing.get_args(hint))}]"
    return getattr(hint, "__name__", str(hint))


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def cell(text: str) -> str:
    """Text for a table cell: pipes escaped, and outside code spans the characters Markdown would read as HTML or
    emphasis."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):  # the even parts lie outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")
    return "`".join(parts)


def code(value: Any) -> str:
    return f"`{value!r}`"


def versus_trl(name: str, entry: compat.FieldEntry) -> str:
    """How the field compares to TRL 1.16, as Markdown (the notes escaped for a table cell)."""
    if entry.status == "grpo only":
        return "**grpo only**"
    if entry.status == "differs on purpose":
        return f"**differs**: {cell(entry.note)}"
    if entry.status == "not applicable: warns":
        return f"*no effect*; another value warns: {cell(entry.note)}"
    if entry.status == "not applicable: refuses":
        return f"*not supported*; another value is an error: {cell(entry.note)}"
    if entry.later:
        return "*not yet*; another value is an error"
    if name in BEHAVES_DIFFERENTLY:
        return f"**differs**: {cell(BEHAVES_DIFFERENTLY[name])}"
    return "as TRL"


def field_table(config: type, names: list[str]) -> list[str]:
    hints = typing.get_type_hints(config)
    fields = {f.name: f for f in dataclasses.fields(config)}
    listed = compat.field_list()
    lines = ["| field | type | default | what it does | vs TRL 1.16 |", "|---|---|---|---|---|"]
    for name in names:
        f = fields[name]
        row = [f"`{name}`", cell(type_name(hints[name])), code(default_of(f)), cell(f.metadata["help"])]
        lines.append("| " + " | ".join([*row, versus_trl(name, listed[name])]) + " |")
    return lines


def groups() -> dict[str, list[str]]:
    """Field names by the group class that declares them."""
    found = {}
    for cls in GRPOConfig.__mro__[1:-1]:
        found[cls.__name__] = [n for n in vars(cls).get("__annotations__", {}) if n in GRPOConfig.__dataclass_fields__]
    missing = set(found) ^ set(SECTIONS)
    if missing:
        raise SystemExit(f"config_reference.py: give these field groups a section title: {sorted(missing)}")
    return found


def async_rows() -> list[str]:
    """AsyncGRPOConfig's fields whose default or meaning differ from GRPOConfig's, and its own."""
    base = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    hints = typing.get_type_hints(AsyncGRPOConfig)
    lines = ["| field | type | default | what it does |", "|---|---|---|---|"]
    for f in dataclasses.fields(AsyncGRPOConfig):
        same = f.name in base and default_of(base[f.name]) == default_of(f)
        if same and base[f.name].metadata["help"] == f.metadata["help"]:
            continue
        help_text = f.metadata["help"]
        if f.name in ASYNC_ONLY:
            help_text += f" Another value is an error: {ASYNC_ONLY[f.name][1]}."
        row = [f"`{f.name}`", cell(type_name(hints[f.name])), code(default_of(f)), cell(help_text)]
        lines.append("| " + " | ".join(row) + " |")
    return lines


INTRO = f"""---
hide:
  - navigation
---
<!-- Generated by `{COMMAND}` from GRPOConfig's fields: edit the fields' help text, then regenerate. -->
# Configuration reference

Every field of `GRPOConfig`, with its type, its default and what it does. The names and defaults are TRL 1.16's
(its `TrainingArguments` fields included), so a TRL 1.16 config runs as it is; the last column says where grpo
differs. Set fields in Python, in a YAML recipe for `grpo train`, or as flags:

```python
from grpo import GRPOConfig

args = GRPOConfig(
    output_dir="runs/math",
    num_generations=8,
    max_completion_length=256,
    learning_rate=1e-6,
)
```

```bash
# the same names as YAML keys and as flags
grpo train --config recipe.yaml --learning_rate 3e-6
```

An unknown name is an error that names the nearest field; a value out of range is an error that names the field and
the fix.

**vs TRL 1.16**: *as TRL*, the same meaning and default; **differs**, the same name with another default or
behaviour (the note says which); *no effect*, accepted for TRL scripts, and a value other than the default warns;
*not supported*, a value other than the default is an error; **grpo only**, a setting TRL does not have. The full
list with what grpo does with each field is `src/grpo/config/trl_1_16_fields.md`; [Coming from TRL](trl.md) has the
differences in prose.
"""


def render() -> str:
    by_group = groups()
    lines = [INTRO.rstrip("\n")]
    for group, title in SECTIONS.items():
        lines += ["", f"## {title}", "", *field_table(GRPOConfig, by_group[group])]
    lines += [
        "",
        "## AsyncGRPOConfig",
        "",
        "`AsyncGRPOConfig` is `GRPOConfig` with `async_generation=True` and TRL 1.16's asynchronous defaults and field "
        "names ([Asynchronous GRPO](async.md)). Its fields are the ones above, except these:",
        "",
        *async_rows(),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is out of date")
    page = render()
    if parser.parse_args().check:
        if PAGE.read_text() != page:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
