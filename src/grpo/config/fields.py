"""`help_field`: a dataclass field with its help text (what `HfArgumentParser --help` prints)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def help_field(text: str, default: Any = None, **kw: Any) -> Any:
    """A field with help `text`; a callable default (not a type's value) becomes its default_factory."""
    if callable(default) and not isinstance(default, type) or default is list:
        return field(default_factory=default, metadata={"help": text}, **kw)
    return field(default=default, metadata={"help": text}, **kw)
