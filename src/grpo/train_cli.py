"""`grpo train`: TRL's `trl grpo` command line, on grpo.

    grpo train --config recipe.yaml [--field value ...]          # flags win over the file
    torchrun --nproc_per_node 2 -m grpo train --config recipe.yaml
    accelerate launch -m grpo train --config recipe.yaml
    grpo train --help                                             # every field

The fields are TRL 1.16's: its script arguments (`dataset_name` — a hub id or a local path: a directory or a
.json/.jsonl/.parquet/.csv file —, `dataset_config`, `dataset_train_split`, `dataset_test_split`,
`dataset_streaming`, `reward_model_name_or_path`, `reward_funcs`), its model arguments (`model_name_or_path`,
`model_revision`, `dtype`, `attn_implementation`, `use_peft`, `lora_r`, `lora_alpha`, `lora_dropout`,
`lora_target_modules`, ...) and every `GRPOConfig` field. `reward_funcs` take the built-in names
(`accuracy_reward`, `reasoning_accuracy_reward`, `think_format_reward`, `get_soft_overlong_punishment` with TRL's
values) or a dotted path `module.function` (the current directory is importable). An unknown key, in the file or
as a flag, is one error naming the nearest valid one.
"""

from __future__ import annotations

import difflib
import enum
import importlib
import os
import re
import sys
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from grpo.config import GRPOConfig
from grpo.data.datasets import load_local
from grpo.models import lora
from grpo.rewards import accuracy_reward, get_soft_overlong_punishment, reasoning_accuracy_reward, think_format_reward
from grpo.trainer import GRPOTrainer


class UsageError(SystemExit):
    """A mistake in the command line or the config file: `grpo` prints the message and exits with status 2, as
    argparse does for its own usage errors."""


def _arg(help: str, default: Any = None, **kw: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ScriptArguments:
    dataset_name: Optional[str] = _arg("Dataset: a hub id, or a local directory or .json/.jsonl/.parquet/.csv file.")
    dataset_config: Optional[str] = _arg("The dataset's configuration name.")
    dataset_train_split: str = _arg("Split to train on.", "train")
    dataset_test_split: str = _arg("Split to evaluate on (when eval_strategy is not 'no').", "test")
    dataset_streaming: bool = _arg("Stream the dataset (needs max_steps).", False)
    ignore_bias_buffers: bool = _arg("TRL's DDP workaround for boolean buffers; grpo does not need it.", False)
    reward_model_name_or_path: Optional[str] = _arg("A reward model (hub id or local directory).")
    reward_funcs: Optional[list[str]] = _arg(
        "Reward functions: accuracy_reward, reasoning_accuracy_reward, think_format_reward, "
        "get_soft_overlong_punishment, or a dotted path module.function.",
        nargs="+",
    )


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = _arg("The model to train: a hub id or a local directory.")
    model_revision: str = _arg("The model's revision (branch, tag or commit).", "main")
    dtype: Optional[str] = _arg("The dtype the model is loaded in ('auto', 'bfloat16', 'float32', ...).", "float32")
    attn_implementation: Optional[str] = _arg("Attention implementation ('sdpa', 'eager', 'flash_attention_2', ...).")
    use_peft: bool = _arg("Train LoRA adapters instead of the whole model.", False)
    lora_r: int = _arg("LoRA rank.", 16)
    lora_alpha: int = _arg("LoRA alpha.", 32)
    lora_dropout: float = _arg("LoRA dropout.", 0.05)
    lora_target_modules: Optional[list[str]] = _arg("Modules LoRA adapts (None: peft's default).", nargs="+")
    lora_target_parameters: Optional[list[str]] = _arg("Parameters LoRA adapts directly.", nargs="+")
    lora_modules_to_save: Optional[list[str]] = _arg("Modules trained in full beside the adapters.", nargs="+")
    lora_task_type: str = _arg("peft task type.", "CAUSAL_LM")
    use_rslora: bool = _arg("Rank-stabilized LoRA.", False)
    use_dora: bool = _arg("DoRA.", False)
    load_in_8bit: bool = _arg("Load the model in 8 bit (bitsandbytes).", False)
    load_in_4bit: bool = _arg("Load the model in 4 bit (bitsandbytes).", False)
    bnb_4bit_quant_type: str = _arg("4-bit quantization type.", "nf4")
    use_bnb_nested_quant: bool = _arg("Nested 4-bit quantization.", False)
    bnb_4bit_quant_storage: Optional[str] = _arg("Storage dtype of 4-bit weights.")


def parse(argv: Sequence[str]) -> tuple[ScriptArguments, GRPOConfig, ModelArguments]:
    """The three argument groups from `--config FILE` (YAML or JSON) and flags (flags win)."""
    from transformers import HfArgumentParser

    # no abbreviations: a misspelled flag is an error, never silently another field
    dataclass_types = (ScriptArguments, GRPOConfig, ModelArguments)
    # transformers types its dataclass classes as a NewType of Any, which a class is not
    parser = HfArgumentParser(dataclass_types, prog="grpo train", allow_abbrev=False)  # type: ignore[arg-type]
    parser.add_argument("--config", default=None, help="A YAML (or JSON) file of any of these fields.")
    for action in parser._actions:  # a field's help is plain text: its "%" is not argparse's formatting
        if action.help and "%(" not in action.help:
            action.help = action.help.replace("%", "%%")
    argv = list(argv)
    config_path = _config_path(argv)
    known = {f.name for group in (ScriptArguments, GRPOConfig, ModelArguments) for f in fields(group)}
    values: dict = {}
    if config_path is not None:
        values = read_config(config_path)
        for key in values:
            if not isinstance(key, str):
                raise UsageError(f"grpo train: {config_path}: the key {key!r} is not a field name (a string).")
            if key not in known:
                raise UsageError(f"grpo train: {config_path}: unknown field '{key}'{_nearest(key, known)}.")
        _check_kinds(values, config_path)
        parser.set_defaults(**{k: _as_flag_default(v) for k, v in values.items()})
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:
        flag = next(a for a in unknown if a.startswith("-")) if any(a.startswith("-") for a in unknown) else unknown[0]
        raise UsageError(f"grpo train: unknown argument '{flag}'{_nearest(flag.lstrip('-').split('=')[0], known)}.")
    groups = []
    for group in (ScriptArguments, GRPOConfig, ModelArguments):
        names = {f.name for f in fields(group) if f.init}
        try:
            groups.append(group(**{k: v for k, v in vars(namespace).items() if k in names}))
        except (ValueError, TypeError) as err:  # a value refused: GRPOConfig names the field; and where it came from
            field = re.match(r"GRPOConfig\.(\w+)", str(err))
            name = field.group(1) if field else None
            flagged = name and any(a.split("=")[0] in (f"--{name}", f"--{name.replace('_', '-')}") for a in argv)
            where = f"{config_path}: " if name in values and not flagged else ""
            raise UsageError(f"grpo train: {where}{err}") from err
    return tuple(groups)  # type: ignore[return-value]  # one instance of each dataclass type, in order


def read_config(path: str) -> dict:
    """The config file's fields: a YAML (or JSON) mapping of field: value; anything else is one UsageError naming
    the file (and, for a syntax error, the line and column)."""
    import yaml

    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise UsageError(f"grpo train: --config {path}: no such file.") from None
    except OSError as err:
        raise UsageError(f"grpo train: --config {path} cannot be read ({err.strerror or err}).") from None
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UsageError(f"grpo train: {path} is not valid YAML ({at}{problem}).") from None
    if isinstance(values, dict):
        return values
    what = "is empty" if not text.strip() else "holds null" if values is None else f"holds a {type(values).__name__}"
    raise UsageError(
        f"grpo train: {path} {what}, not a mapping of field: value; write one field per line, e.g. "
        "'model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct'."
    )


def _check_kinds(values: dict, path: str) -> None:
    """A config file's value of the wrong kind (null, a list, a mapping, true/false where the field wants another)
    is one UsageError naming the field, the kind it needs and the kind it got. Strings are left to argparse, which
    converts them as it converts flags (YAML reads 1e-5 as a string)."""
    hints: dict[str, Any] = {}
    for group in (ScriptArguments, GRPOConfig, ModelArguments):
        hints.update(typing.get_type_hints(group))
    for key, value in values.items():
        if key in hints and not _fits(value, hints[key]):
            raise UsageError(f"grpo train: {path}: {key} needs {_kind(hints[key])}, not {_kind_of(value)}.")


def _fits(value: Any, hint: Any) -> bool:
    """Whether a YAML value can be the field's (kinds this does not know are let through; strings too, which the
    parser converts)."""
    if isinstance(value, str):
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if origin in (list, tuple) or hint in (list, tuple):
        args = typing.get_args(hint)
        return isinstance(value, list) and (not args or all(_fits(v, args[0]) for v in value))
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):  # a fraction for an integer field is refused by GRPOConfig, naming the field
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return isinstance(value, (int, float)) and not isinstance(value, bool)  # a number for a name, as a flag gives
    return True


def _kind(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_kind(h) for h in typing.get_args(hint)))
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    names = {type(None): "null", bool: "true or false", int: "a number", float: "a number", str: "a string"}
    if hint in names:
        return names[hint]
    if origin in (list, tuple) or hint in (list, tuple):
        args = typing.get_args(hint)
        return f"a list of {_kind(args[0]).removeprefix('a ')}s" if args and args[0] in names else "a list"
    if origin is dict or hint is dict:
        return "a mapping"
    return getattr(hint, "__name__", str(hint))


def _kind_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return f"the number {value}"
    if isinstance(value, list):
        return f"the list {value!r}"
    return "a mapping" if isinstance(value, dict) else f"a {type(value).__name__}"


def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _as_flag_default(value: Any) -> Any:
    """YAML values as argparse defaults: dicts (model_init_kwargs, ...) as the JSON strings the config parses."""
    import json

    return json.dumps(value) if isinstance(value, dict) else value


def _nearest(name: str, known: set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f"; did you mean '{close[0]}'?" if close else " (grpo train --help lists them)"


def reward_functions(script: ScriptArguments) -> list:
    registry = {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
    }
    funcs: list = [script.reward_model_name_or_path] if script.reward_model_name_or_path else []
    for name in script.reward_funcs or []:
        if name in registry:
            funcs.append(registry[name])
        elif "." in name:
            module, attr = name.rsplit(".", 1)
            sys.path.insert(0, os.getcwd())
            try:
                funcs.append(getattr(importlib.import_module(module), attr))
            except (ImportError, AttributeError) as err:
                raise UsageError(f"grpo train: reward function '{name}' could not be imported: {err}.") from err
        else:
            raise UsageError(
                f"grpo train: unknown reward function '{name}'{_nearest(name, set(registry))} (or give a dotted path "
                "module.function)."
            )
    if not funcs:
        raise UsageError("grpo train: no reward: set reward_funcs (or reward_model_name_or_path).")
    return funcs


def load_datasets(script: ScriptArguments, evaluate: bool) -> tuple[Any, Any]:
    """(train, eval or None): a local data file or save_to_disk directory (`grpo.data.datasets.load_local`), or a hub
    dataset (with dataset_config and dataset_streaming)."""
    from datasets import load_dataset

    name = script.dataset_name
    if not name:
        raise UsageError("grpo train: set dataset_name (a hub id or a local path).")
    splits = [script.dataset_train_split] + ([script.dataset_test_split] if evaluate else [])
    if os.path.exists(name):
        if evaluate and os.path.isfile(name):
            raise UsageError(f"grpo train: {name} is one file (one split); evaluation needs eval_strategy='no' here.")
        loaded = [load_local(name, split, script.dataset_streaming) for split in splits]
        return loaded[0], loaded[1] if evaluate else None
    dataset = load_dataset(name, name=script.dataset_config, streaming=script.dataset_streaming)
    for split in splits:
        if split not in dataset:
            raise UsageError(f"grpo train: {name} has no split '{split}' (it has {list(dataset)}).")
    return dataset[script.dataset_train_split], dataset[script.dataset_test_split] if evaluate else None


def peft_config(model: ModelArguments) -> Any:
    if not model.use_peft:
        return None
    return lora.lora_config(
        r=model.lora_r,
        lora_alpha=model.lora_alpha,
        lora_dropout=model.lora_dropout,
        target_modules=model.lora_target_modules,
        target_parameters=model.lora_target_parameters,
        modules_to_save=model.lora_modules_to_save,
        task_type=model.lora_task_type,
        use_rslora=model.use_rslora,
        use_dora=model.use_dora,
    )


def model_init_kwargs(model: ModelArguments, args: GRPOConfig) -> dict:
    kwargs: dict[str, Any] = dict(revision=model.model_revision, attn_implementation=model.attn_implementation)
    if model.dtype is not None:
        kwargs["dtype"] = model.dtype
    if model.load_in_4bit or model.load_in_8bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_8bit=model.load_in_8bit,
            load_in_4bit=model.load_in_4bit,
            bnb_4bit_quant_type=model.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=model.use_bnb_nested_quant,
            bnb_4bit_quant_storage=model.bnb_4bit_quant_storage,
        )
    assert not isinstance(args.model_init_kwargs, str)  # GRPOConfig.__post_init__ parsed the JSON
    return {**kwargs, **(args.model_init_kwargs or {})}


def main(argv: Sequence[str]) -> int:
    script, args, model = parse(argv)
    if not model.model_name_or_path:
        raise UsageError("grpo train: set model_name_or_path (a hub id or a local model directory).")
    args.model_init_kwargs = model_init_kwargs(model, args)
    train, evaluation = load_datasets(script, args.eval_strategy != "no")
    trainer = GRPOTrainer(
        model=model.model_name_or_path,
        reward_funcs=reward_functions(script),
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        peft_config=peft_config(model),
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.accelerator.print("Training completed.")
    trainer.save_model(args.output_dir)
    trainer.accelerator.print(f"Model saved to {args.output_dir}.")
    if args.push_to_hub:
        trainer.push_to_hub(dataset_name=script.dataset_name)
    trainer.end()  # the trackers finished and the process group ended (as TRL's script does)
    return 0
