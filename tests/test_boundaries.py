"""The architecture's rules, checked on the source with `ast` (style guide: dependencies point one way):
- the math modules (losses, advantages, log-probs) import torch and the standard library only;
- `peft` is imported in `grpo/lora.py` only; `vllm` only in the vLLM engine and server modules;
- experiment trackers are imported in `grpo/metrics.py` only;
- nothing imports `grpo.*` inside a function (function-level imports are for optional dependencies);
- grpo sets no environment variable of its own making: `os.environ` is written only by `grpo/process_env.py`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "grpo"
MATH = ("losses.py", "advantages.py", "logprobs.py")
VLLM_MODULES = ("rollout/vllm.py", "server.py")
TRACKERS = {
    "wandb",
    "tensorboard",
    "tensorboardX",
    "trackio",
    "mlflow",
    "comet_ml",
    "clearml",
    "aim",
    "swanlab",
    "neptune",
    "dvclive",
}


def modules():
    return sorted(p for p in SRC.rglob("*.py"))


def name(path: Path) -> str:
    return path.relative_to(SRC).as_posix()


def imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level package or 'grpo.x.y', inside a function?) for every import of the module."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((alias.name, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.append((child.module, in_function))
            visit(child, nested)

    visit(ast.parse(path.read_text()), False)
    return found


def test_the_rules_see_every_module():
    names = [name(p) for p in modules()]
    assert set(MATH) <= set(names) and "trainer.py" in names and "lora.py" in names and "metrics.py" in names


@pytest.mark.parametrize("module", MATH)
def test_math_modules_import_torch_and_the_standard_library_only(module):
    allowed = {"torch", "__future__"} | set(sys.stdlib_module_names)
    outside = [m for m, _ in imports(SRC / module) if m.split(".")[0] not in allowed]
    assert outside == [], f"{module} imports {outside}"


def test_optional_heavy_dependencies_stay_in_their_modules():
    for path in modules():
        tops = {m.split(".")[0] for m, _ in imports(path)}
        if "peft" in tops:
            assert name(path) == "lora.py", f"{name(path)} imports peft"
        if "vllm" in tops:
            assert name(path) in VLLM_MODULES, f"{name(path)} imports vllm"
        if tops & TRACKERS:
            assert name(path) == "metrics.py", f"{name(path)} imports {tops & TRACKERS}"


def test_no_function_level_imports_of_grpo():
    late = [
        (name(p), m)
        for p in modules()
        for m, in_function in imports(p)
        if in_function and (m == "grpo" or m.startswith("grpo."))
    ]
    assert late == []


def test_only_process_env_writes_the_environment():
    def writes(tree):
        for node in ast.walk(tree):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                else []
            )
            for target in targets:
                if isinstance(target, ast.Subscript) and ast.unparse(target.value) == "os.environ":
                    yield node.lineno
            if isinstance(node, ast.Call) and ast.unparse(node.func) in (
                "os.environ.update",
                "os.environ.setdefault",
                "os.putenv",
                "os.environ.pop",
            ):
                yield node.lineno
            if isinstance(node, ast.Delete) and any(
                isinstance(t, ast.Subscript) and ast.unparse(t.value) == "os.environ" for t in node.targets
            ):
                yield node.lineno

    found = [(name(p), line) for p in modules() for line in writes(ast.parse(p.read_text()))]
    assert {module for module, _ in found} <= {"process_env.py"}, found
    assert found, "the rule checks nothing: process_env.py should write os.environ"
