"""The code a reader copies from the docs and examples/ uses the real API: every Python block parses, every keyword
given to `GRPOConfig`/`GRPOTrainer` (and their async twins) is one of theirs, every key of a YAML recipe is a
`grpo train` field, every `examples/` path the pages name exists, and the accelerate config files load with
accelerate's own reader. A renamed field fails here, not in a user's first run."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from grpo.config import GRPOConfig
from grpo.config.async_config import AsyncGRPOConfig
from grpo.train_cli import ModelArguments, ScriptArguments

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPTS = sorted((ROOT / "examples").glob("*.py"))
ACCELERATE_CONFIGS = sorted((ROOT / "examples" / "accelerate").glob("*.yaml"))


def constructor_arguments(module: str, name: str) -> set[str]:
    """The keyword names of a trainer's __init__, read from its source (the unit tier imports no trainer)."""
    tree = ast.parse((ROOT / "src" / "grpo" / module).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {a.arg for a in init.args.args + init.args.kwonlyargs} - {"self"}


KEYWORDS = {
    "GRPOConfig": {f.name for f in dataclasses.fields(GRPOConfig)},
    "AsyncGRPOConfig": {f.name for f in dataclasses.fields(AsyncGRPOConfig)},
    "GRPOTrainer": constructor_arguments("trainer.py", "GRPOTrainer"),
    "AsyncGRPOTrainer": constructor_arguments("async_trainer.py", "AsyncGRPOTrainer"),
}
RECIPE_KEYS = {f.name for group in (ScriptArguments, GRPOConfig, ModelArguments) for f in dataclasses.fields(group)}


def blocks(language: str) -> list[tuple[str, str]]:
    """(where, code) of every fenced block of this language in the README and docs/."""
    found = []
    for page in PAGES:
        for match in re.finditer(rf"^```{language}\n(.*?)^```", page.read_text(), re.S | re.M):
            line = page.read_text()[: match.start()].count("\n") + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", match.group(1)))
    return found


def wrong_keywords(tree: ast.AST) -> list[str]:
    wrong = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in KEYWORDS:
            known = KEYWORDS[node.func.id]
            wrong += [f"{node.func.id}({k.arg}=...)" for k in node.keywords if k.arg and k.arg not in known]
    return wrong


PYTHON_BLOCKS = blocks("python")


@pytest.mark.parametrize("where, code", PYTHON_BLOCKS, ids=[where for where, _ in PYTHON_BLOCKS])
def test_python_blocks_parse_and_use_real_names(where, code):
    tree = ast.parse(code, filename=where)
    assert not wrong_keywords(tree), f"{where}: not a keyword of grpo: {wrong_keywords(tree)}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_example_scripts_parse_and_use_real_names(script):
    tree = ast.parse(script.read_text(), filename=str(script))
    assert not wrong_keywords(tree), f"{script.name}: not a keyword of grpo: {wrong_keywords(tree)}"


def test_yaml_recipes_name_grpo_train_fields():
    recipes = [(where, yaml.safe_load(code)) for where, code in blocks("yaml")]
    assert recipes
    wrong = [f"{where}: {key}" for where, recipe in recipes for key in recipe if key not in RECIPE_KEYS]
    assert not wrong, f"not a field of `grpo train`: {wrong}"


def test_every_example_the_pages_name_exists():
    named = {m for page in PAGES for m in re.findall(r"examples/[\w./-]+\.(?:py|yaml|sbatch)", page.read_text())}
    assert named, "the pages name no example"
    assert not [n for n in sorted(named) if not (ROOT / n).exists()]


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_configs_load_as_accelerate_reads_them(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    assert config.num_machines == 1 and config.num_processes > 1
    if config.fsdp_config:  # grpo turns activation checkpointing on itself: FSDP's own as well is an error
        assert config.fsdp_config["fsdp_version"] == 2 and not config.fsdp_config["fsdp_activation_checkpointing"]
    if config.deepspeed_config:  # left out, DeepSpeed takes them from GRPOConfig; a different value is an error
        assert not {"gradient_accumulation_steps", "gradient_clipping"} & set(config.deepspeed_config)
