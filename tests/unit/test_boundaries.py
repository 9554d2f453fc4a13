"""The architecture's rules, checked on the source with `ast` (style guide: dependencies point one way):
- the math modules (losses, advantages, log-probs) import torch and the standard library only;
- `peft` is imported in `grpo/models/lora.py` only; `vllm` only in the colocate engine and the weight-transfer plugin;
- experiment trackers are imported in `grpo/observe/metrics.py` only;
- nothing imports `grpo.*` inside a function (function-level imports are for optional dependencies);
- grpo sets no environment variable of its own making: `os.environ` is written only by `grpo/base/process_env.py`.
And the tests' own walls:
- helpers live in tests/support/, and no test module imports another test module (only `support.*`);
- nothing in tests/unit builds a trainer (a test that does is an integration test);
- a reward function of support.rewards is defined there once.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "grpo"
MATH = ("algo/losses.py", "algo/advantages.py", "algo/logprobs.py")
VLLM_MODULES = ("rollout/vllm.py", "serve/vllm_plugin.py")
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
    assert set(MATH) <= set(names) and "trainer.py" in names
    assert "models/lora.py" in names and "observe/metrics.py" in names and "base/process_env.py" in names


@pytest.mark.parametrize("module", MATH)
def test_math_modules_import_torch_and_the_standard_library_only(module):
    allowed = {"torch", "__future__"} | set(sys.stdlib_module_names)
    outside = [m for m, _ in imports(SRC / module) if m.split(".")[0] not in allowed]
    assert outside == [], f"{module} imports {outside}"


def test_optional_heavy_dependencies_stay_in_their_modules():
    for path in modules():
        tops = {m.split(".")[0] for m, _ in imports(path)}
        if "peft" in tops:
            assert name(path) == "models/lora.py", f"{name(path)} imports peft"
        if "vllm" in tops:
            assert name(path) in VLLM_MODULES, f"{name(path)} imports vllm"
        if tops & TRACKERS:
            assert name(path) == "observe/metrics.py", f"{name(path)} imports {tops & TRACKERS}"


def test_no_function_level_imports_of_grpo():
    late = [
        (name(p), m)
        for p in modules()
        for m, in_function in imports(p)
        if in_function and (m == "grpo" or m.startswith("grpo."))
    ]
    assert late == []


def _assigned(node):
    """What an assignment statement writes (its targets), or [] for any other node."""
    if isinstance(node, ast.Assign):
        return node.targets
    return [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []


def test_only_process_env_writes_the_environment():
    def writes(tree):
        for node in ast.walk(tree):
            targets = _assigned(node)
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
    assert {module for module, _ in found} <= {"base/process_env.py"}, found
    assert found, "the rule checks nothing: process_env.py should write os.environ"


# the fields of transformers' TrainerState that grpo keeps (step, epoch, tokens seen, FLOPs, logs, best checkpoint)
TRAINER_STATE = {"global_step", "epoch", "max_steps", "num_input_tokens_seen", "total_flos", "log_history"}
TRAINER_STATE |= {"best_metric", "best_global_step", "best_model_checkpoint", "stateful_callbacks"}


def test_only_the_trainer_writes_its_trainer_state():
    """The trainer's TrainerState has one writer, `grpo/trainer.py`: checkpoints, preemption, the report and the
    reward functions' copies read it, and what changes comes back as a value. A write is an assignment to one of its
    fields (`state.global_step += 1`, `trainer.state.best_metric = ...`), `setattr` on it, or a change to its log
    history in place (`state.log_history.append(...)`)."""

    def on_state(node):
        return isinstance(node, ast.Attribute) and ast.unparse(node.value).split(".")[-1] in ("state", "trainer_state")

    def writes(tree):
        for node in ast.walk(tree):
            targets = _assigned(node)
            for target in targets:
                for t in ast.walk(target):
                    if on_state(t) and t.attr in TRAINER_STATE:
                        yield node.lineno
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if on_state(owner) and owner.attr == "log_history" and node.func.attr != "copy":
                    yield node.lineno
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and node.args:
                if ast.unparse(node.args[0]).split(".")[-1] in ("state", "trainer_state"):
                    yield node.lineno

    found = [(name(p), line) for p in modules() for line in writes(ast.parse(p.read_text()))]
    assert {module for module, _ in found} <= {"trainer.py"}, found
    assert len(found) >= 5, "the rule checks nothing: the trainer should write its state"


# ---- grpo's own layers ----------------------------------------------------------------------------------------
# A unit is a package of grpo (rollout/, agent/, ...) or a module at its top level (trainer.py -> "trainer"); the
# packages are the layers, and every unit is placed here. Lower layers never import higher ones, and the units'
# imports have no cycle: an engine, a tool or a reward function's caller can be read, tested and replaced without
# the trainer, its checkpoints or its SIGTERM handling.
LAYERS = [
    {"base"},  # the leaves: the plain records (prompts, requests, rollouts), SIGTERM, secrets, the environment set for
    # dependencies, background threads, seeds
    {"config"},  # GRPOConfig and the TRL field tables
    {"algo"},  # the math: losses, advantages, log-probs, the sampling correction (pure functions of tensors)
    {"distributed", "serve"},  # collectives, sharding, ZeRO, the accelerator's teardown; vLLM's side of server mode
    {"models"},  # loading and preparing the policy, LoRA, the float32 head, image prompts
    {"perf"},  # speed and memory patches (they look at distributed's wrappers)
    {"rollout", "data"},  # generation engines; datasets into prompts (peers: both speak in base's plain records)
    {"agent", "rewards"},  # the tool loop above the engines; reward functions
    {"observe"},  # metrics, console, diagnostics, callbacks, the run directory and its report
    {"checkpoint"},  # saving and loading a run (above everything it saves); in-flight rounds; the Hub
    {"learner"},  # the training batch and pass, the micro-step loop, the optimizer, the accelerator
    {"rounds"},  # generation rounds: produced, grouped and scored, asynchronous; evaluation; preemption
    {"assembly"},  # a trainer's parts, built once
    {"trainer", "async_trainer"},  # the public trainers
    {"cli", "train_cli", "apps"},  # the command line and the demos
]


def test_every_unit_is_placed_in_a_layer():
    units = {unit(p) for p in modules()} - {"__init__", "__main__"}
    assert units == set().union(*LAYERS), units ^ set().union(*LAYERS)


def test_few_modules_at_the_top():
    """The top of grpo holds its public faces (the trainers, the command line); everything else is in a package."""
    top = sorted(p.name for p in SRC.glob("*.py"))
    assert len(top) <= 10, top


def unit(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return parts[0]


def grpo_imports(path: Path) -> list[tuple[str, int]]:
    """(unit imported, line) for every import of a grpo module outside `if TYPE_CHECKING:` blocks."""
    found = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                parts = child.module.split(".")
                if parts[0] == "grpo":
                    targets = [a.name for a in child.names] if len(parts) == 1 else [parts[1]]
                    found.extend((t, child.lineno) for t in targets)
            elif isinstance(child, ast.Import):
                found.extend((a.name.split(".")[1], child.lineno) for a in child.names if a.name.startswith("grpo."))
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def unit_graph() -> dict[str, dict[str, list[str]]]:
    """{unit: {unit it imports: ["path:line", ...]}}, imports inside a unit left out."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in modules():
        here = unit(path)
        for target, line in grpo_imports(path):
            if target not in (here, "__init__"):
                graph.setdefault(here, {}).setdefault(target, []).append(f"{name(path)}:{line}")
    return graph


def test_every_layer_names_real_units():
    units = {unit(p) for p in modules()} - {"__init__", "__main__"}
    named = set().union(*LAYERS)
    assert named <= units, named - units


def test_lower_layers_never_import_higher_ones():
    level = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    upward = [
        f"{source} (layer {level[source]}) imports {target} (layer {level[target]}) at {', '.join(where)}"
        for source, targets in unit_graph().items()
        for target, where in targets.items()
        if source in level and target in level and level[target] > level[source]
    ]
    assert upward == [], "\n".join(upward)


def test_grpo_units_import_each_other_without_cycles():
    graph = unit_graph()
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def strong(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(set(graph) | {w for targets in graph.values() for w in targets}):
        if v not in index:
            strong(v)
    detail = [f"{a} -> {b} at {', '.join(graph[a][b])}" for c in cycles for a in c for b in graph.get(a, {}) if b in c]
    assert cycles == [], "\n".join(detail)


def test_checkpoints_read_no_dataset():
    """The checkpoint package saves and loads the state components the trainer hands it: the run's record
    (`components.TrainingRecord`) is given the dataset's size, so checkpoints never import the data module."""
    modules = (SRC / "checkpoint").glob("*.py")
    assert [f"{name(p)}:{line}" for p in modules for u, line in grpo_imports(p) if u == "data"] == []


def test_only_the_engines_callers_import_them():
    """The training pass, the data and the reward functions read plain records (`grpo.base.records`) and model facts
    (`grpo.models`), never a generation engine's module: `data` and `rollout` are peers, and the learner's layouts
    do not change when an engine does."""
    readers = [p for unit in ("learner", "data", "rewards") for p in (SRC / unit).glob("*.py")]
    assert readers, "the rule checks nothing"
    found = [f"{name(p)}:{line}" for p in readers for u, line in grpo_imports(p) if u == "rollout"]
    assert found == []


def test_no_test_folder_shadows_a_package():
    """tests/ goes on sys.path (conftest, scripts), and so do support/ (the zygote's script folder) and support/jobs/
    (each job's): a folder in tests/, or a module in those two, named like a package grpo or the tests import would
    be imported in its place wherever that package is not installed (tests/vllm did so on a machine without vLLM:
    `import vllm` succeeded and the suite stopped at collection)."""
    tests = Path(__file__).parents[1]
    packages = {"vllm", "trl", "datasets", "transformers", "accelerate", "peft", "deepspeed", "math_verify", "torch"}
    packages |= {"tokenizers", "safetensors", "rich", "grpo", "numpy", "pandas", "PIL", "pytest", "huggingface_hub"}
    names = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    names |= {p.stem for folder in (tests / "support", tests / "support" / "jobs") for p in folder.glob("*.py")}
    assert "support" in names and "tiny" in names
    assert not names & packages


def test_the_documented_layout_table_matches_the_tree():
    """Every package and top-level module of grpo has a row in the layout table of docs/development.md, each row
    names only what exists, and the rows follow the layers from the bottom up."""
    page = (SRC.parents[1] / "docs" / "development.md").read_text()
    table = page[page.index("## Layout") :].split("\n\n")[2]
    rows = [line.split("|")[1] for line in table.splitlines()[2:]]
    listed = [name.strip("`/") for row in rows for name in row.replace(",", " ").split()]
    on_disk = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    on_disk |= {p.name.removesuffix(".py") for p in SRC.glob("*.py")} - {"__init__", "__main__"}
    units = [name.removesuffix(".py") for name in listed]
    assert set(units) == on_disk, set(units) ^ on_disk
    level = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    order = [level[u] for u in units]
    assert order == sorted(order), list(zip(units, order))


def test_the_trainer_constructor_stays_short():
    """`GRPOTrainer.__init__` reads in one screen (at most 60 lines, signature included): its parts are built by
    `grpo.assembly.assemble`."""
    tree = ast.parse((SRC / "trainer.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GRPOTrainer")
    init = next(n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert init.end_lineno - init.lineno + 1 <= 60


# ---- the tests' own walls -------------------------------------------------------------------------------------
# Only tests/ is on sys.path: what tests share is in its package `support` (tests/support/), and a test module
# imports helpers from there, never from another test module. The unit and equivalence tiers build no trainer: a test
# that does is an integration test.
TESTS = Path(__file__).resolve().parents[1]
SUPPORT = TESTS / "support"
TIERS = sorted(p for p in TESTS.iterdir() if p.is_dir() and p != SUPPORT and not p.name.startswith((".", "__")))
TRAINERS = {"GRPOTrainer", "AsyncGRPOTrainer"}
LAUNCHERS = {"support.launch", "support.zygote"}  # they start job processes (support/jobs/), which build trainers


def python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def top_imports(tree: ast.AST) -> list[tuple[str, int]]:
    """(module, line) of every absolute import in `tree`, at any depth (`from x import y`: x; `import x.y`: x.y)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
    return found


def local_names() -> set[str]:
    """What a bare `import x` of a file under tests/ could reach: the modules and packages in the folders that go on
    sys.path (tests/ itself; a tier's folder, which pytest's import mode prepends for its test modules; support/,
    the zygote's script folder; support/jobs/, each job's)."""
    roots = [TESTS, *TIERS, SUPPORT, SUPPORT / "jobs"]
    names = {p.stem for root in roots for p in root.glob("*.py")}
    return names | {p.name for root in roots for p in root.iterdir() if (p / "__init__.py").exists()}


def test_tests_and_tiers_hold_test_modules_and_conftests_only():
    """Helpers live in support/, not beside the tests: tests/ and each tier's folder hold test modules and
    conftest.py alone."""
    loose = [
        p.relative_to(TESTS).as_posix()
        for folder in (TESTS, *TIERS)
        for p in folder.glob("*.py")
        if not (p.name.startswith("test_") or p.name == "conftest.py")
    ]
    assert loose == []
    assert {t.name for t in TIERS} >= {"unit", "equivalence", "integration", "distributed", "with_vllm"}


def test_test_modules_import_no_other_test_module():
    """Every import of a module under tests/ goes through the package support: a test module never imports another
    test module (nor conftest.py: its fixtures come by name), and no helper or job script imports one either."""
    local = local_names() - {"support"}
    assert {"test_boundaries", "conftest", "tiny", "launch", "distributed_job"} <= local, "the rule checks nothing"
    found = [
        f"{p.relative_to(TESTS).as_posix()}:{line} imports {module}"
        for p in python_files()
        for module, line in top_imports(parsed(p))
        if module.split(".")[0] in local
    ]
    assert found == [], "\n".join(found)


def trainer_builders() -> set[tuple[str, str]]:
    """(support module, function) for every top-level function of support that builds a trainer: its body names
    GRPOTrainer or AsyncGRPOTrainer, or calls another such function (of its module, or imported from support)."""
    uses: dict[tuple[str, str], set] = {}
    for path in SUPPORT.rglob("*.py"):
        module = ".".join(path.relative_to(TESTS).with_suffix("").parts).removesuffix(".__init__")
        tree = parsed(path)
        imported = {
            alias.asname or alias.name: (node.module, alias.name)
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("support.")
            for alias in node.names
        }
        for fn in tree.body:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                named = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
                named |= {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}
                uses[(module, fn.name)] = {imported.get(n, (module, n)) for n in named} | (named & TRAINERS)
    builders: set[tuple[str, str]] = set()
    while True:
        more = {fn for fn, used in uses.items() if used & TRAINERS or used & builders} - builders
        if not more:
            return builders
        builders |= more


def builds_a_trainer(path: Path, builders: set[tuple[str, str]]) -> list[str]:
    """Where module `path` names a trainer class, imports or calls a support function that builds a trainer, or
    imports the launchers of job processes."""
    tree = parsed(path)
    found = []
    modules = {}  # local name: support module, for `from support import x` and `import support.x as y`
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if alias.name in TRAINERS or (node.module, alias.name) in builders:
                    found.append(f"{node.lineno}: imports {full}")
                if node.module == "support":
                    modules[alias.asname or alias.name] = full
                if node.module in LAUNCHERS or full in LAUNCHERS:
                    found.append(f"{node.lineno}: imports {full} (it launches jobs)")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("support."):
                    modules[alias.asname or alias.name] = alias.name
                if alias.name in LAUNCHERS:
                    found.append(f"{node.lineno}: imports {alias.name} (it launches jobs)")
        elif isinstance(node, ast.Name) and node.id in TRAINERS:
            found.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute):
            owner = ast.unparse(node.value)
            if node.attr in TRAINERS or (modules.get(owner), node.attr) in builders:
                found.append(f"{node.lineno}: {owner}.{node.attr}")
    return found


def test_the_unit_and_equivalence_tiers_build_no_trainer():
    """Nothing in tests/unit or tests/equivalence names GRPOTrainer or AsyncGRPOTrainer, uses a support helper that
    builds one (found here by reading support: `support.agent.make_trainer`, `support.vision_runs.build`, ...), or
    launches job processes: a test that trains, or builds a trainer to see what its constructor checks, is an
    integration test."""
    builders = trainer_builders()
    expected = {
        ("support.agent", "make_trainer"),
        ("support.vision_runs", "build"),
        ("support.vllm_runs", "make_trainer"),
    }
    assert expected <= builders, "the rule checks nothing"
    found = [
        f"{p.relative_to(TESTS).as_posix()}:{where}"
        for tier in ("unit", "equivalence")
        for p in sorted((TESTS / tier).glob("*.py"))
        for where in builds_a_trainer(p, builders)
    ]
    assert found == [], "\n".join(found)


def test_shared_reward_functions_are_defined_once():
    """A reward function of support.rewards (`length_reward`, ...) is defined there only: no test module, helper or
    job defines a function of the same name with other behaviour."""
    shared = {n.name for n in ast.parse((SUPPORT / "rewards.py").read_text()).body if isinstance(n, ast.FunctionDef)}
    assert "length_reward" in shared
    again = [
        f"{p.relative_to(TESTS).as_posix()}:{node.lineno} defines {node.name}"
        for p in python_files()
        if p != SUPPORT / "rewards.py"
        for node in ast.walk(parsed(p))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in shared
    ]
    assert again == [], "\n".join(again)
