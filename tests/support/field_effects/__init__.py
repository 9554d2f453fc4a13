"""What each TRL 1.16 config field does when set to a value other than its default: one registered check per
field, run by `tests/integration/test_trl_fields.py::test_each_field_set_to_a_non_default_value`.

A check is registered with `@effect(field, value)` in one of the theme modules beside this file, and receives a
`Setting`: `s.config(**more)` is a small GRPOConfig with the field set to `value`; `s.trainer(**more)` a trainer
on the tiny local model with that config; `s.train(**more)` the same, trained (one step unless `max_steps` is
given). The check asserts an observable effect of the value (for a field that works), or the one clear error or
warning that names the field (for one grpo does not honour). Fields whose status is *not applicable* or *later*
in `trl_1_16_fields.md` need no registration: the test checks their refusal or warning generically.

Importing the package registers every check (its theme modules are imported with it); `LIST` is that field table,
`FIELDS` GRPOConfig's fields, and `HONOURED` the statuses of the fields that must have a registered check."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo import GRPOConfig
from grpo.config import compat
from support.rewards import length_reward
from support.runs import BASE, chat_dataset

EFFECTS: dict[str, Effect] = {}


@dataclasses.dataclass(frozen=True)
class Effect:
    field: str
    value: Any
    check: Callable[[Setting], None]


def effect(field: str, value: Any) -> Callable:
    def register(check: Callable[[Setting], None]) -> Callable[[Setting], None]:
        if field in EFFECTS:
            raise ValueError(f"the effect of {field} is registered twice")
        EFFECTS[field] = Effect(field, value, check)
        return check

    return register


@dataclasses.dataclass
class Setting:
    field: str
    value: Any
    tmp_path: Path
    model_dir: str

    def kwargs(self, **more: Any) -> dict[str, Any]:
        """The config's arguments: the base, `more`, and the field (which `more` cannot override)."""
        base = dict(BASE, output_dir=str(self.tmp_path / "out"))
        base.update(more)
        base[self.field] = self.value
        return base

    def config(self, **more: Any) -> Any:
        from grpo import GRPOConfig

        return GRPOConfig(**self.kwargs(**more))

    def trainer(
        self, *, dataset: Any = None, reward_funcs: Any = None, model: Any = None, processor: Any = None, **more: Any
    ) -> Any:
        from grpo import GRPOTrainer

        return GRPOTrainer(
            model=model if model is not None else self.model_dir,
            reward_funcs=reward_funcs or length_reward,
            train_dataset=dataset if dataset is not None else chat_dataset(tasks=False),
            args=self.config(**more),
            processing_class=processor,
        )

    def train(self, **kw: Any) -> Any:
        trainer = self.trainer(**kw)
        trainer.train()
        return trainer

    def default_config(self, **more: Any) -> Any:
        """The same config with the field at its default (for comparisons)."""
        from grpo import GRPOConfig

        kwargs = self.kwargs(**more)
        del kwargs[self.field]
        return GRPOConfig(**kwargs)

    def default_trainer(self, *, dataset: Any = None, reward_funcs: Any = None, **more: Any) -> Any:
        from grpo import GRPOTrainer

        return GRPOTrainer(
            model=self.model_dir,
            reward_funcs=reward_funcs or length_reward,
            train_dataset=dataset if dataset is not None else chat_dataset(tasks=False),
            args=self.default_config(**more),
        )


LIST = compat.field_list()
FIELDS = {f.name: f for f in dataclasses.fields(GRPOConfig)}
HONOURED = ("works", "differs on purpose")

for _module in pkgutil.iter_modules(__path__):  # each theme module registers its checks when imported
    importlib.import_module(f"{__name__}.{_module.name}")
