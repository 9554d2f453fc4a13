"""Every field of TRL 1.16's GRPOConfig is a grpo field with TRL's default (`grpo/config/trl_1_16_fields.md`, checked
against TRL itself by `scripts/trl_fields.py`), and setting any of them to another value has an effect a test
sees: the registered check of `tests/support/field_effects/` for a field that works, or one error or warning naming the
field for one grpo does not honour. No value a user changes is silently ignored."""

from __future__ import annotations

import ast
import dataclasses
import typing
import warnings

import pytest

from grpo import GRPOConfig
from support.field_effects import EFFECTS, FIELDS, HONOURED, LIST, Setting


def default_of(name):
    f = FIELDS[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def test_the_list_and_the_config_have_the_same_fields():
    assert [n for n in FIELDS if n not in LIST] == []  # every grpo field is in the list ...
    assert [n for n in LIST if n not in FIELDS] == []  # ... and every listed field is a grpo field
    trl = [n for n, e in LIST.items() if e.source != "grpo"]
    assert len(trl) == 191  # TRL 1.16.0 on transformers 5.24.0 (scripts/trl_fields.py compares the two)


@pytest.mark.parametrize("name", [n for n, e in LIST.items() if e.source != "grpo"])
def test_trl_defaults(name):
    entry = LIST[name]
    trl_default = ast.literal_eval(entry.default)
    # bf16 and enable_jit_checkpoint keep TRL's default and differ in what it does (the hardware; SIGTERM)
    if entry.status == "differs on purpose" and name not in ("bf16", "enable_jit_checkpoint"):
        assert default_of(name) != trl_default, f"{name} is listed as differing but has TRL's default"
        assert entry.note, f"{name}: a field that differs on purpose says why"
    else:
        assert default_of(name) == trl_default


@pytest.mark.parametrize("name", [n for n, e in LIST.items() if e.source == "grpo"])
def test_grpo_only_defaults(name):
    """The list's default of a field of grpo's own is the config's (packing's was listed as 'padded', not None)."""
    assert default_of(name) == ast.literal_eval(LIST[name].default)


def test_every_honoured_field_has_a_registered_effect():
    honoured = [n for n, e in LIST.items() if e.status in HONOURED]
    assert [n for n in honoured if n not in EFFECTS] == []
    assert [n for n in EFFECTS if n not in LIST] == []


def _non_default(name):
    """A value other than the default, for fields whose only expected effect is their refusal or warning."""
    if name == "accelerator_config":  # a dict of AcceleratorConfig's options (an unknown option is an error)
        return {"split_batches": True}
    default = default_of(name)
    hint = typing.get_type_hints(GRPOConfig)[name]
    union = typing.get_origin(hint) is typing.Union
    kinds = [t for t in typing.get_args(hint) if t is not type(None)] if union else [hint]
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    if isinstance(default, str) and default:
        return default + "_other"
    kind = typing.get_origin(kinds[0]) or kinds[0]
    return {bool: True, int: 2, float: 0.5, str: "value", dict: {"key": 1}, list: ["value"]}[kind]


@pytest.mark.parametrize("name", list(LIST))
def test_each_field_set_to_a_non_default_value(name, tiny_model_dir, tmp_path):
    entry = LIST[name]
    if entry.status in HONOURED or (entry.status == "grpo only" and name in EFFECTS):
        registered = EFFECTS[name]
        assert registered.value != default_of(name), f"{name}'s check must use a non-default value"
        registered.check(Setting(name, registered.value, tmp_path, tiny_model_dir))
    elif entry.status == "grpo only":
        pytest.skip(f"{name} is grpo's own field; its tests are elsewhere")
    elif entry.status == "not applicable: warns":
        with pytest.warns(UserWarning, match=rf"GRPOConfig: {name}=.*has no effect"):
            GRPOConfig(output_dir=str(tmp_path), **{name: _non_default(name)})
    else:  # refused: not applicable here, or a feature of a later issue
        expected = "is not available yet" if entry.later else "not applicable in grpo"
        with pytest.raises(ValueError, match=rf"GRPOConfig: {name}=.*{expected}"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                GRPOConfig(output_dir=str(tmp_path), **{name: _non_default(name)})


def test_several_refused_fields_are_named_in_one_error(tmp_path):
    with pytest.raises(ValueError, match=r"neftune_noise_alpha=0.5.*trackio_space_id='x/y'.*Leave these fields"):
        GRPOConfig(output_dir=str(tmp_path), trackio_space_id="x/y", neftune_noise_alpha=0.5)
