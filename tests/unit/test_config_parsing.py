"""The whole GRPOConfig parses with transformers' HfArgumentParser, as TRL scripts build it: every field from a
command-line flag, and a config from a YAML or JSON file."""

from __future__ import annotations

import json
import warnings

import pytest
from transformers import HfArgumentParser

from grpo import GRPOConfig
from grpo.config import compat
from support.field_effects import EFFECTS, FIELDS, HONOURED, LIST, Setting


def flag_words(name, value):
    """`value` as the words a shell would pass after --name."""
    if isinstance(value, (dict, tuple)) or (isinstance(value, list) and any(isinstance(v, dict) for v in value)):
        return [json.dumps(value)]
    if isinstance(value, list):
        return [str(v) for v in value]
    return [str(value).lower() if isinstance(value, bool) else str(value)]


def parse(words):
    (config,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(words)
    return config


def test_every_field_is_a_flag():
    help_text = HfArgumentParser(GRPOConfig).format_help()  # a "%" in a help would be argparse's formatting
    assert [n for n in FIELDS if f"--{n}" not in help_text] == [] and "option_strings" not in help_text


# fields whose registered value needs another field set too
NEEDS = {"sync_ref_model": {"beta": 0.04}, "auto_find_batch_size": None}


@pytest.mark.parametrize("name", [n for n, e in LIST.items() if e.status in HONOURED and n != "output_dir"])
def test_each_honoured_field_parses_from_its_flag(name, tiny_model_dir, tmp_path):
    """The field at its registered non-default value (with the small base config of the effect checks), given as
    flags, gives the config built directly."""
    value = EFFECTS[name].value
    if name == "resume_from_checkpoint":
        value = str(tmp_path)
    if name in NEEDS and NEEDS[name] is None:  # refused in both ways alike
        with pytest.raises(ValueError, match=name):
            parse(["--output_dir", str(tmp_path), f"--{name}", *flag_words(name, value)])
        return
    kwargs = Setting(name, value, tmp_path, tiny_model_dir).kwargs(**NEEDS.get(name, {}))
    words = [w for key, v in kwargs.items() if v is not None for w in [f"--{key}", *flag_words(key, v)]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. tf32 on a machine without CUDA
        direct = GRPOConfig(**kwargs)
        parsed = parse(words)
    assert getattr(parsed, name) == getattr(direct, name)
    assert parsed == direct


def test_a_refused_field_from_the_command_line_names_itself(tmp_path):
    with pytest.raises(ValueError, match=r"trackio_space_id='me/space' \(hub is not available yet"):
        parse(["--output_dir", str(tmp_path), "--trackio_space_id", "me/space"])


CONFIG = {
    "learning_rate": 3e-6,
    "loss_type": "grpo",
    "beta": 0.04,
    "num_generations": 4,
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "reward_weights": [1.0, 0.5],
    "generation_kwargs": {"top_k": 5},
    "scale_rewards": False,
    "warmup_steps": 0.1,
    "optim": "adamw_torch",
    "save_strategy": "epoch",
    "report_to": "none",
    "gradient_checkpointing": False,
    "pad_to_multiple_of": 8,
}


def _check(config, tmp_path):
    expected = GRPOConfig(output_dir=str(tmp_path), **CONFIG)
    assert config == expected
    assert config.scale_rewards == "none" and config.generation_kwargs == {"top_k": 5}
    assert config.steps_per_generation == 2 and config.generation_batch_size == 8


def test_a_yaml_file(tmp_path):
    yaml = pytest.importorskip("yaml")
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(dict(CONFIG, output_dir=str(tmp_path))))
    (config,) = HfArgumentParser(GRPOConfig).parse_yaml_file(str(path))
    _check(config, tmp_path)


def test_a_json_file(tmp_path):
    path = tmp_path / "grpo.json"
    path.write_text(json.dumps(dict(CONFIG, output_dir=str(tmp_path))))
    (config,) = HfArgumentParser(GRPOConfig).parse_json_file(str(path))
    _check(config, tmp_path)


def test_flags_and_a_file_together(tmp_path):
    """TRL's scripts: a config file for most values, flags for the rest."""
    path = tmp_path / "grpo.json"
    path.write_text(json.dumps(dict(CONFIG, output_dir=str(tmp_path))))
    (from_file,) = HfArgumentParser(GRPOConfig).parse_json_file(str(path))
    words = ["--output_dir", str(tmp_path)]
    for name, value in CONFIG.items():
        words += [f"--{name}", *flag_words(name, value)]
    _check(parse(words), tmp_path)
    assert parse(words) == from_file


def test_the_list_is_readable_as_data():
    entry = compat.field_list()["use_bias_correction_kl"]
    assert (entry.default, entry.source, entry.status) == ("True", "GRPOConfig", "works")


@pytest.mark.parametrize("text, message", [("{bad", "is not valid JSON"), ("[1, 2]", "must be a dict")])
def test_a_dict_field_given_bad_json_names_itself(text, message, tmp_path):
    with pytest.raises(ValueError, match=f"GRPOConfig.generation_kwargs {message}"):
        parse(["--output_dir", str(tmp_path), "--generation_kwargs", text])


@pytest.mark.parametrize("name, value", [("seed", -1), ("seed", 2**32), ("data_seed", -5)])
def test_seeds_out_of_range_name_the_field(name, value, tmp_path):
    with pytest.raises(ValueError, match=rf"GRPOConfig.{name} is {value}; a seed is an integer in \[0, 2\*\*32 - 1\]"):
        GRPOConfig(output_dir=str(tmp_path), **{name: value})
