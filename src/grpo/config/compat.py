"""The TRL 1.16 field list (`trl_1_16_fields.md`) as data, and what it makes of a config: a field grpo cannot
honour (not applicable here, or a feature of a later release) refuses a value other than its default, or warns
where the list says so. Nothing a user changed is silently dropped."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpo.config import GRPOConfig

FIELD_LIST = Path(__file__).with_name("trl_1_16_fields.md")
STATUSES = ("works", "differs on purpose", "not applicable: warns", "not applicable: refuses", "grpo only")
LATER = "later: "


@dataclasses.dataclass(frozen=True)
class FieldEntry:
    name: str
    default: str  # TRL's default as Python source (grpo's, for "grpo only")
    source: str  # TrainingArguments, GRPOConfig or grpo
    status: str
    note: str

    @property
    def later(self) -> bool:
        return self.status.startswith(LATER)


@functools.cache
def field_list() -> dict[str, FieldEntry]:
    """The list's rows by field name, in its order."""
    entries = {}
    for line in FIELD_LIST.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[0].startswith("`"):
            continue
        name, default, source, status, note = cells
        if status not in STATUSES and not status.startswith(LATER):
            raise ValueError(f"{FIELD_LIST.name}: field {name} has an unknown status {status!r}")
        entries[name.strip("`")] = FieldEntry(name.strip("`"), default.strip("`"), source, status, note)
    return entries


def check_unsupported(config: GRPOConfig) -> None:
    """Refuse (one error naming every such field) or warn about values grpo cannot honour."""
    defaults = {f.name: _default(f) for f in dataclasses.fields(config)}
    refused: list[str] = []
    warned: list[str] = []
    for entry in field_list().values():
        value = getattr(config, entry.name)
        if entry.status not in ("not applicable: warns", "not applicable: refuses") and not entry.later:
            continue
        if _same(value, defaults[entry.name]):
            continue
        if entry.later:
            why = f"{entry.status[len(LATER) :]} is not available yet in grpo"
        else:
            why = f"not applicable in grpo: {entry.note}"
        text = f"{entry.name}={value!r} ({why})"
        (warned if entry.status == "not applicable: warns" else refused).append(text)
    local_rank = os.environ.get("LOCAL_RANK")
    if config.local_rank != -1 and local_rank is not None and int(local_rank) != config.local_rank:
        warned.append(f"local_rank={config.local_rank} (the launcher's LOCAL_RANK={local_rank} is used)")
    elif config.local_rank != -1 and local_rank is None:
        warned.append(
            f"local_rank={config.local_rank} (no launcher set LOCAL_RANK, so this process trains alone; start "
            "several with torchrun or accelerate launch)"
        )
    for text in warned:
        warnings.warn(f"GRPOConfig: {text}; it has no effect.", stacklevel=4)
    if refused:
        raise ValueError(
            "GRPOConfig: "
            + "; ".join(refused)
            + ". Leave "
            + ("this field" if len(refused) == 1 else "these fields")
            + " at TRL's default (see grpo/config/trl_1_16_fields.md)."
        )


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    factory = f.default_factory
    assert callable(factory), f"{f.name} has neither a default nor a default_factory"
    return factory()


def _same(value: Any, default: Any) -> bool:
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and default is None:
        return value == type(value)()  # accelerator_config: held as transformers' AcceleratorConfig
    if isinstance(value, bool) != isinstance(default, bool):
        return False
    return value == default or (value in ("", [], {}, None) and default in ("", [], {}, None))


def json_dict(name: str, text: str) -> dict:
    """A dict field given as JSON text (command lines pass dicts so), parsed, or one error naming the field."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"GRPOConfig.{name} is not valid JSON ({e}): give a dict, or a JSON object such as '{{\"key\": 1}}'."
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"GRPOConfig.{name} must be a dict (a JSON object), not {type(value).__name__}.")
    return value


def accelerator_config(value: Any) -> Any:
    """accelerator_config as the HF Trainer holds it: a transformers AcceleratorConfig, from None, a dict, a JSON
    string or the path of a JSON file. grpo builds no DataLoader, so only `dispatch_batches` is read (a streaming
    dataset needs it False, as TRL 1.16)."""
    from transformers.trainer_pt_utils import AcceleratorConfig

    if isinstance(value, AcceleratorConfig):
        return value
    if value is None:
        return AcceleratorConfig()
    if isinstance(value, str):
        if os.path.isfile(value):
            return AcceleratorConfig.from_json_file(value)
        value = json_dict("accelerator_config", value)
    if not isinstance(value, dict):
        raise ValueError(f"GRPOConfig: accelerator_config={value!r:.80} must be a dict, a JSON string or file path.")
    known = {f.name for f in dataclasses.fields(AcceleratorConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(
            f"GRPOConfig: accelerator_config has unknown option(s) {', '.join(unknown)}; its options are "
            f"{', '.join(sorted(known))}."
        )
    return AcceleratorConfig(**value)
