"""Compare `src/grpo/config/trl_1_16_fields.md` with the installed TRL's `GRPOConfig` (names and defaults).

Run in an environment where TRL 1.16 is installed (grpo never imports TRL itself), e.g.:

    pip install --target /tmp/trl-1.16 --no-deps trl==1.16.0
    PYTHONPATH=/tmp/trl-1.16 .venv/bin/python scripts/trl_fields.py           # differences, exit 1 if any
    PYTHONPATH=/tmp/trl-1.16 .venv/bin/python scripts/trl_fields.py --rows    # table rows for new fields

The defaults are written as Python source (`repr`), as the list has them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from grpo.config import compat  # noqa: E402


def trl_fields() -> dict[str, tuple[str, str]]:
    """TRL's GRPOConfig fields in declaration order: name -> (default as source, declaring class)."""
    import transformers
    import trl
    from trl import GRPOConfig

    print(f"TRL {trl.__version__}, transformers {transformers.__version__}", file=sys.stderr)
    own = set(GRPOConfig.__dataclass_fields__) - set(transformers.TrainingArguments.__dataclass_fields__)
    rows = {}
    for f in dataclasses.fields(GRPOConfig):
        if not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows[f.name] = (repr(default), "GRPOConfig" if f.name in own else "TrainingArguments")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", action="store_true", help="print table rows for fields missing from the list")
    args = parser.parse_args()
    theirs = trl_fields()
    ours = {n: e for n, e in compat.field_list().items() if e.source != "grpo"}
    problems = []
    for name, (default, source) in theirs.items():
        if name not in ours:
            problems.append(f"missing from the list: {name} (default {default}, {source})")
            if args.rows:
                print(f"| `{name}` | `{default}` | {source} | ? |  |")
        elif ours[name].default != default:
            problems.append(f"{name}: TRL's default is {default}, the list says {ours[name].default}")
    # rows marked "transformers 5.20+" are TrainingArguments fields an older transformers does not have yet
    problems += [
        f"in the list but not in TRL: {name}"
        for name, entry in ours.items()
        if name not in theirs and not entry.note.startswith("transformers 5.20+")
    ]
    print("\n".join(problems) or f"the list matches TRL's {len(theirs)} fields", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
