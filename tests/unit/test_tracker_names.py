"""Names from a config never lead a file out of output_dir: `run_name` and `project` are path parts of the
TensorBoard run (`<output_dir>/<project>/<run_name>`), so one that climbs out (`..`) or is an absolute path is
refused by `GRPOConfig`, naming the field, before anything is written; a name changed after the config was built is
refused the same way when the trackers start (a recipe from elsewhere cannot write outside the run's directory)."""

from __future__ import annotations

import os

import pytest

from grpo import GRPOConfig, cli
from grpo.observe.metrics import start_trackers, tensorboard_run_dir

ESCAPING = ["../../escaped", "..", "a/../../b", "runs/..", "/tmp/elsewhere", "..\\up"]


def _files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)


def _entries(root):
    """Every file and directory under root, relative to it."""
    return {os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files}


@pytest.mark.parametrize("field", ["run_name", "project"])
@pytest.mark.parametrize("value", ESCAPING)
def test_a_name_that_leaves_output_dir_is_refused_by_the_config(tmp_path, field, value):
    out = tmp_path / "box" / "out"
    with pytest.raises(ValueError) as err:
        GRPOConfig(output_dir=str(out), report_to="tensorboard", **{field: value})
    message = str(err.value)
    assert message.startswith(f"GRPOConfig.{field} is {value!r}")
    assert "output_dir" in message and "'..'" in message and "absolute" in message
    assert _files(tmp_path) == [] and not out.exists()  # refused before anything is written


@pytest.mark.parametrize("run_name", [None, "exp-1", "sweep/lr-1e-5", "a..b", "...", "./exp", "~exp"])
def test_names_inside_output_dir_are_kept(tmp_path, run_name):
    c = GRPOConfig(output_dir=str(tmp_path), run_name=run_name, project="team/proj")
    assert (c.run_name, c.project) == (run_name, "team/proj")
    root = os.path.realpath(tmp_path)
    path = os.path.realpath(os.path.join(root, tensorboard_run_dir(c.project, c.run_name)))
    assert path.startswith(root + os.sep)


class FakeAccelerator:
    def __init__(self, trackers, logging_dir):
        self.log_with, self.logging_dir, self.started = trackers, logging_dir, None

    def init_trackers(self, project_name, config=None, init_kwargs=None):
        self.started = project_name
        for tracker in self.log_with:  # accelerate starts each tracker: TensorBoard makes its directory then
            if hasattr(tracker, "start"):
                tracker.start()


@pytest.mark.parametrize("field", ["run_name", "project"])
@pytest.mark.parametrize("value", ["../../escaped", "ABSOLUTE"])
def test_a_name_changed_after_the_config_is_refused_when_the_trackers_start(tmp_path, field, value):
    """A name set on the built config (validation is over): TensorBoard still writes nothing outside output_dir."""
    pytest.importorskip("tensorboardX")
    out = tmp_path / "box" / "out"
    value = str(tmp_path / "elsewhere") if value == "ABSOLUTE" else value
    args = GRPOConfig(output_dir=str(out), report_to="tensorboard", run_name="exp", project="proj")
    setattr(args, field, value)
    with pytest.raises(ValueError, match=rf"GRPOConfig\.{field} is {value!r}.*inside output_dir"):
        start_trackers(FakeAccelerator(["tensorboard"], str(out)), args)
    assert _files(tmp_path) == [] and _entries(tmp_path) <= {"box", os.path.join("box", "out")}


def test_tensorboard_writes_only_under_output_dir_for_a_nested_name(tmp_path):
    pytest.importorskip("tensorboardX")
    out = tmp_path / "out"
    args = GRPOConfig(output_dir=str(out), report_to="tensorboard", run_name="sweep/exp", project="proj")
    accelerator = FakeAccelerator(["tensorboard"], str(out))
    start_trackers(accelerator, args)
    (tracker,) = accelerator.log_with
    tracker.log({"loss": 1.0}, step=1)
    tracker.finish()
    files = _files(tmp_path)
    assert files and all(
        f.startswith(os.path.join("out", "proj", "sweep", "exp", "events.out.tfevents")) for f in files
    )


def test_a_recipe_that_names_a_run_outside_output_dir_is_one_usage_error(tmp_path, capsys):
    """`grpo train --config recipe.yaml`: refused with one line naming the field, nothing written."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("report_to: tensorboard\nrun_name: ../../escaped\n")
    assert cli.main(["train", "--config", str(recipe), "--output_dir", str(tmp_path / "box" / "out")]) == 2
    err = capsys.readouterr().err
    assert "GRPOConfig.run_name is '../../escaped'" in err and len(err.strip().splitlines()) == 1
    assert _entries(tmp_path) == {"recipe.yaml"}
