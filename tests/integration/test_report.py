"""The run report: report.html built from recorded histories (live and by `grpo report`), its content, what bad or
hostile files get, its refresh and failure handling in a run, a resumed run's, and a real browser rendering it."""

from __future__ import annotations

import io
import json
import os
import re
import shutil

import pytest

from grpo import GRPOTrainer, cli
from grpo.observe import diagnostics, report, run_dir
from grpo.observe.report import charts, record
from support.reports import charts_in, full_history, write_run
from support.rewards import length_reward
from support.runs import cfg, chat_dataset

EVERY_CHART = (
    "Reward",
    "Reward per function",
    "Groups with no reward spread",
    "Completion length",
    "Truncated completions",
    "KL to the reference model",
    "Entropy",
    "Clip ratios",
    "Sampling mismatch",
    "Importance-sampling ratio",
    "Tool calls",
    "Gradient norm",
    "Learning rate",
    "Where the time goes",
    "Throughput",
    "Evaluation",
)


def section(page, title):
    start = page.index(f"<h2>{title}</h2>")
    end = page.find("<h2>", start + 1)
    return page[start : end if end > 0 else None]


def test_a_recorded_history_gives_every_chart_the_findings_completions_and_settings(tmp_path):
    completions = {
        s: [{"prompt": f"Compute {s}+1", "completion": f"answer {s}", "correct": 1.0, "advantage": 0.5}] * 2
        for s in range(1, 9)
    }
    args = cfg(tmp_path, learning_rate=3e-5, log_completions=True)
    info = {
        "model": "tiny-llama",
        "reward_names": ["correct", "format"],
        "tools": ["multiply"],
        "max_steps": 8,
        "config": args.to_dict(),
        "non_default": record.non_default(args.to_dict()),
        "versions": record.versions(),
        "starts": [{"time": "t0", "step": 0, "resumed_from": None}],
        "status": "finished",
        "ended": {"time": "t1", "step": 8, "error": None},
    }
    out = write_run(tmp_path / "run", full_history(), completions, info)
    path = report.rebuild(out)
    page = open(path).read()
    drawn = charts_in(page)
    assert list(drawn) == list(EVERY_CHART)
    assert drawn["Reward"] == 8 + 2 and drawn["Evaluation"] == 4 and drawn["Reward per function"] == 16
    svgs = re.findall(r"<svg .*?</svg>", page)
    assert len(svgs) == len(EVERY_CHART) and all('<polyline class="series" points="' in svg for svg in svgs)
    # the diagnostics at the top, in words, from the step they first held, with the thresholds
    top = section(page, "Diagnostics")
    assert "From step 6:</b> 80% of groups have no reward spread" in top and "dynamic_sampling" in top
    for name, rule in diagnostics.THRESHOLDS:
        assert f"<b>{name}</b>: {rule.replace('<', '&lt;').replace('>', '&gt;')}" in top
    assert page.index("<h2>Diagnostics</h2>") < page.index("<h2>Charts</h2>")
    assert 'class="status finished"' in page and "step <b>8</b> of 8" in page and "tools <b>multiply</b>" in page
    # the newest SHOWN_STEPS logged steps' completions, newest first and open, with rewards and advantages
    shown = section(page, "Sampled completions")
    assert "The newest 8 of 8" not in shown and shown.index("Step 8:") < shown.index("Step 7:")
    assert "<details open><summary>Step 8: 2 completions" in shown and "<pre>answer 8</pre>" in shown
    assert "<th>correct</th><th>advantage</th>" in shown and "<td class=num>0.5</td>" in shown
    config = section(page, "Configuration")
    assert "<code>learning_rate</code></td><td><code>3e-05</code>" in config
    assert f"<td>torch</td><td>{record.versions()['torch']}</td>" in section(page, "Versions")


def test_only_logged_metric_families_are_charted_and_off_completions_say_how_to_turn_them_on(tmp_path):
    rows = [
        {k: v for k, v in r.items() if not k.startswith(("kl", "tools/", "sampling/", "rewards/format"))}
        for r in full_history()
        if "loss" in r
    ]
    out = write_run(tmp_path / "run", rows, info={"config": {"log_completions": False}})
    page = open(report.rebuild(out)).read()
    drawn = set(charts_in(page))
    assert not drawn & {
        "KL to the reference model",
        "Tool calls",
        "Sampling mismatch",
        "Importance-sampling ratio",
        "Evaluation",
    }
    assert {"Reward", "Reward per function", "Entropy", "Gradient norm", "Where the time goes"} <= drawn
    assert "Set <code>log_completions=True</code>" in section(page, "Sampled completions")


def test_more_logged_steps_than_shown_say_where_the_rest_are(tmp_path):
    completions = {s: [{"prompt": "p", "completion": f"c{s}", "advantage": 0.0}] for s in range(1, 15)}
    out = write_run(tmp_path / "run", full_history(14), completions, info={})
    shown = section(open(report.rebuild(out)).read(), "Sampled completions")
    assert "The newest 10 of 14 logged steps" in shown and "<pre>c5</pre>" in shown and "<pre>c4</pre>" not in shown


def test_the_live_cache_holds_only_the_shown_completions(tmp_path):
    completions = {s: [{"prompt": "p", "completion": f"c{s}", "advantage": 0.0}] for s in range(1, 15)}
    out = write_run(tmp_path / "run", full_history(14), completions, info={})
    cache = {}
    rows = record.read_metrics(out).rows
    first = report.gather(out, rows, [], ("running", ""), cache=cache)
    assert sorted(first.completions) == list(range(5, 15)) and len(cache) == 10
    os.remove(os.path.join(out, "completions", "completions_00005.parquet"))
    report.gather(out, rows, [], ("running", ""), cache=cache)
    assert len(cache) == 10 and not any(k[0].endswith("completions_00005.parquet") for k in cache)


def test_hostile_and_broken_files_are_escaped_skipped_and_named(tmp_path):
    evil = '<script>alert(1)</script><img src=x onerror="fetch(`https://x.example`)">'
    out = write_run(
        tmp_path / "run",
        full_history(4),
        {4: [{"prompt": evil, "completion": evil + "x" * 5000, "advantage": float("nan")}]},
        info='{"model": "<b>not json',
    )
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('garbage\n[1, 2]\n{"step": "5"}\n{"step": true}\n{"step": 5, "reward": NaN}\n{"step": 6, "rew')
    os.makedirs(os.path.join(out, "completions"), exist_ok=True)
    with open(os.path.join(out, "completions", "completions_00003.parquet"), "wb") as f:
        f.write(b"PAR1 not really")
    page = open(report.rebuild(out)).read()
    assert "<script" not in page and "onerror=" not in page.replace("onerror=&quot;", "")
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert f"({len(evil) + 5000 - 4000} more characters in the parquet file)" in page  # cut at 4,000
    assert "5 unreadable line(s) of metrics.jsonl were skipped" in page  # the NaN row parses (and is not drawn)
    assert "completions_00003.parquet could not be read" in page
    assert "saved no run_info.json" in page and 'class="status unknown"' in page
    # self-contained: no script, no stylesheet or image fetched from anywhere
    assert not re.search(r'(src|href)="(?!data:)', page) and "<link" not in page


@pytest.mark.parametrize(
    "values",
    [[0.5], [2.0, 2.0, 2.0], [-3.0, 0.0, 7.5], [1e-12, 1e-3, 1e3], [1e300, -1e300, 5.0], [0.0, 1e-9, 2e-9]],
)
def test_charts_of_awkward_values_stay_inside_their_frame(values):
    rows = [{"step": 10 * i + 3, "grad_norm": v, "reward": v, "reward_std": abs(v) / 2} for i, v in enumerate(values)]
    for chart in charts.charts(rows):
        svg = charts.render(chart, rows)
        coords = [float(c) for pts in re.findall(r'points="([^"]+)"', svg) for p in pts.split() for c in p.split(",")]
        assert coords and all(-20 <= c <= charts.WIDTH + 20 for c in coords), (chart.title, values)
        assert "nan" not in svg and "inf" not in svg
    assert charts.ticks(0.0, 1.0, 5) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert charts.ticks(1, 36, 8, integer=True) == [0, 5, 10, 15, 20, 25, 30, 35, 40]


def test_a_long_series_is_thinned_keeping_its_spikes():
    points = [(i, 1.0) for i in range(1, 5001)]
    points[3333] = (3334, 50.0)
    kept = charts.thinned(points)
    assert len(kept) <= charts.MAX_POINTS and (3334, 50.0) in kept and kept == sorted(kept)
    assert charts.thinned(points[:900]) == points[:900]


def test_a_crafted_run_info_is_read_for_what_it_can_give(tmp_path):
    crafted = {
        "model": ["not", "a", "name"],
        "reward_names": [1, None],
        "tools": "multiply",
        "config": ["x"],
        "non_default": "lr",
        "versions": [1],
        "starts": [1, "x", {"time": "<i>t</i>", "step": 0}],
        "status": {"a": 1},
        "ended": "yes",
        "max_steps": "9",
    }
    out = write_run(tmp_path / "run", full_history(3), info=crafted)
    page = open(report.rebuild(out)).read()
    assert (
        "reward functions <b>1, None</b>" in page and "unknown model" in page and "step <b>3</b> · " in page
    )  # no "of 9": not an int
    assert "<li>&lt;i&gt;t&lt;/i&gt;: at step 0</li>" in page and 'class="status unknown"' in page


def test_only_the_main_process_writes_a_report(tmp_path):
    (tmp_path / "out").mkdir()
    other = report.RunReport(str(tmp_path / "out"), True, {}, diagnosis(tmp_path), False)
    with other.running(FakeState(), None, cfg(tmp_path).to_dict()):
        assert not other.refresh(force=True)
    assert os.listdir(tmp_path / "out") == []


def test_grpo_report_command_and_its_errors(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["report", str(tmp_path / "empty")]) == 2
    assert "not a grpo run's output_dir" in capsys.readouterr().err
    out = write_run(tmp_path / "run", full_history(3), info={})
    assert cli.main(["report", out]) == 0
    assert capsys.readouterr().out.strip() == os.path.join(out, "report.html")
    assert cli.main(["report", out, "--output", str(tmp_path / "elsewhere.html")]) == 0
    assert (tmp_path / "elsewhere.html").read_text().startswith("<!DOCTYPE html>")


def test_a_run_killed_while_running_is_reported_as_stopped_and_a_held_one_as_running(tmp_path):
    out = write_run(tmp_path / "run", full_history(3), info={"status": "running", "starts": [], "max_steps": 9})
    page = open(report.rebuild(out)).read()
    assert 'class="status stopped"' in page and "ended without finishing" in page
    lock = run_dir.RunLock(out)
    lock.acquire()
    try:
        assert run_dir.is_held(out)
        assert 'class="status running"' in open(report.rebuild(out)).read()
    finally:
        lock.release()
    assert not run_dir.is_held(out)


def diagnosis(tmp_path):
    return diagnostics.Diagnosis(diagnostics.Limits.of(cfg(tmp_path)))


class FakeState:
    def __init__(self):
        self.global_step, self.max_steps, self.log_history = 0, 10, []


def test_refresh_costs_at_most_its_share_of_the_run(tmp_path, monkeypatch):
    now = [100.0]
    built = []

    def build(self, rows, status):  # each build costs 1 s of the fake clock
        now[0] += 1.0
        built.append(now[0])

    monkeypatch.setattr(report.RunReport, "_write", build)
    monkeypatch.setattr(report, "FIRST_ESTIMATE", 1.0)
    (tmp_path / "out").mkdir()
    live = report.RunReport(str(tmp_path / "out"), True, {}, diagnosis(tmp_path), True, clock=lambda: now[0])
    with live.running(FakeState(), None, cfg(tmp_path).to_dict()):  # training starts at t=100
        now[0] = 120.0
        assert not live.refresh()  # 2% of 20 s cannot pay for the first build (estimated 1 s)
        now[0] = 150.0
        assert live.refresh()  # 2% of 50 s can: 1 s spent, ends at t=151
        now[0] = 190.0
        assert not live.refresh()  # 2 s would be spent in 90 s
        now[0] = 200.0
        assert live.refresh()  # 2 s in 100 s
        now[0] = 210.0
    assert built == [151.0, 201.0, 211.0]  # and the end always writes
    assert live.spent == 3.0 and live.builds == 3


def test_a_run_writes_its_report_at_logging_steps_and_at_the_end(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(report, "REFRESH_SHARE", 1e9)  # every logging step is due
    writes = []
    real = report.write
    monkeypatch.setattr(report, "write", lambda *a, **k: writes.append(1) or real(*a, **k))
    args = cfg(tmp_path, max_steps=3, log_completions=True, num_completions_to_print=0)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=chat_dataset())
    trainer.train()
    out = tmp_path / "out"
    assert len(writes) == 3 + 1  # each logged step, and the end
    page = (out / "report.html").read_text()
    assert 'class="status finished"' in page and "step <b>3</b> of 3" in page
    assert {"Reward", "Completion length", "Gradient norm"} <= set(charts_in(page))
    assert "Step 3: 8 completions" in page
    info = json.loads((out / "run_info.json").read_text())
    assert info["status"] == "finished" and info["ended"]["step"] == 3 and len(info["starts"]) == 1
    assert info["reward_names"] == ["length_reward"] and info["non_default"]["max_steps"] == 3
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]  # replaced atomically, nothing left over
    # `grpo report` rebuilds the same charts and findings from the files alone
    rebuilt = open(report.rebuild(str(out), str(tmp_path / "rebuilt.html"))).read()
    assert charts_in(rebuilt) == charts_in(page)
    assert section(rebuilt, "Diagnostics") == section(page, "Diagnostics")


def test_run_report_false_writes_no_page_but_keeps_what_grpo_report_needs(tmp_path, tiny_model_dir):
    args = cfg(tmp_path, max_steps=2, run_report=False)
    GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=chat_dataset()).train()
    out = tmp_path / "out"
    assert not (out / "report.html").exists() and (out / "run_info.json").exists()
    page = open(report.rebuild(str(out))).read()
    assert 'class="status finished"' in page and "<code>run_report</code></td><td><code>false</code>" in page


def test_a_report_that_cannot_be_written_is_one_warning_and_the_run_goes_on(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    (out / "report.html").mkdir(parents=True)  # os.replace cannot put a file there
    args = cfg(tmp_path, max_steps=3, save_strategy="steps", save_steps=1)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=chat_dataset())
    with pytest.warns(UserWarning, match="report.html\\) could not be written") as caught:
        trainer.train()
    assert sum("could not be written" in str(w.message) for w in caught) == 1
    assert trainer.state.global_step == 3 and (out / "checkpoint-3").is_dir()
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]


def test_a_run_stopped_by_an_error_says_so(tmp_path, tiny_model_dir):
    calls = []

    def breaks_at_step_2(completions, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the grader is down")
        return length_reward(completions)

    args = cfg(tmp_path, max_steps=3)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=breaks_at_step_2, args=args, train_dataset=chat_dataset())
    with pytest.raises(Exception, match="the grader is down"):
        trainer.train()
    page = (tmp_path / "out" / "report.html").read_text()
    assert 'class="status stopped"' in page and "the grader is down" in page
    assert json.loads((tmp_path / "out" / "run_info.json").read_text())["status"] == "stopped"


def test_a_resumed_run_reports_its_whole_history_once(tmp_path, tiny_model_dir):
    out = tmp_path / "out"

    def trainer(**kw):
        args = cfg(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, **kw)
        return GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=chat_dataset())

    trainer().train()
    shutil.rmtree(out / "checkpoint-4")
    with open(out / "metrics.jsonl", "a") as f:  # what a run killed after step 4 had logged
        f.write('{"step": 5, "reward": 9.0}\n')
    resumed = trainer()
    resumed.train(resume_from_checkpoint=True)
    page = (out / "report.html").read_text()
    assert "resumed 1 time(s), last at step 2" in page and 'class="status finished"' in page
    assert charts_in(page)["Reward"] == 4  # steps 1-4, each once
    info = json.loads((out / "run_info.json").read_text())
    assert [s["step"] for s in info["starts"]] == [0, 2] and info["starts"][1]["resumed_from"].endswith("checkpoint-2")
    rebuilt = open(report.rebuild(str(out), str(tmp_path / "rebuilt.html"))).read()
    assert charts_in(rebuilt) == charts_in(page) and "resumed 1 time(s)" in rebuilt


def test_the_live_findings_equal_the_replayed_ones(tmp_path):
    rows, live = full_history(), diagnosis(tmp_path)
    for end in range(1, len(rows) + 1):
        live.update(rows[:end], quiet=True)
    replayed = diagnosis(tmp_path).replay(rows)
    assert live.findings == replayed.findings and [f.name for f in live.findings] == ["no_reward_spread"]


def browser():
    """Debian's Chromium through playwright (which downloads no browser); CI must have it: `make test` installs
    it, so only a machine without it skips."""
    path = shutil.which("chromium") or "/usr/bin/chromium"
    missing = not os.path.exists(path)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = True
    if missing:
        if os.environ.get("CI"):
            pytest.fail("CI needs Chromium and playwright for the report test: `make test` installs them")
        pytest.skip("Chromium (/usr/bin/chromium) or playwright is not installed: `make test` installs them")
    return sync_playwright, path


def test_the_report_renders_in_a_real_headless_browser(tmp_path, tiny_model_dir):
    sync_playwright, chromium = browser()
    args = cfg(tmp_path, max_steps=4, log_completions=True, num_completions_to_print=0, beta=0.04)
    GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=chat_dataset()).train()
    page_path = tmp_path / "out" / "report.html"
    flags = [
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ]
    problems = []
    with sync_playwright() as p:
        browser_ = p.chromium.launch(executable_path=chromium, args=flags)
        try:
            tab = browser_.new_page(viewport={"width": 1280, "height": 900})
            tab.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
            tab.on("pageerror", lambda e: problems.append(str(e)))
            tab.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
            tab.goto(page_path.as_uri(), wait_until="load")
            charts = tab.evaluate(
                """() => [...document.querySelectorAll('figure.chart')].map(f => {
                    const svg = f.querySelector('svg'), box = svg.getBoundingClientRect();
                    const lines = [...svg.querySelectorAll('polyline.series')].map(l => l.getBBox());
                    return [f.dataset.chart, box.width, box.height, lines.length,
                            Math.max(...lines.map(b => b.width)), lines.every(b => b.width + b.height > 0)];
                })"""
            )
            shot = tab.screenshot(full_page=True)
        finally:
            browser_.close()
    assert problems == []
    assert len(charts) >= 10 and {"Reward", "KL to the reference model", "Entropy"} <= {c[0] for c in charts}
    for title, width, height, lines, widest, drawn in charts:  # each chart on screen, its lines drawn
        assert width > 300 and height > 150 and lines >= 1 and widest > 100 and drawn, title
    from PIL import Image, ImageStat

    image = Image.open(io.BytesIO(shot)).convert("RGB")
    assert image.height > 1500  # the whole page, charts and tables
    assert max(ImageStat.Stat(image).stddev) > 10 and len(image.getcolors(1 << 20) or []) > 100  # not blank
