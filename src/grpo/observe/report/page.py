"""The report as one HTML page: inline styles, charts as inline SVG, no script, no link to anything outside the
file, so it opens the same on an air-gapped machine. Every text that comes from the run (completions, prompts,
configuration values, error messages) is escaped: a completion cannot put markup or script into the page. Secrets
in it (`grpo.base.secrets`: a token in the configuration, an error message or a completion) are redacted first."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from grpo.base import secrets
from grpo.observe import diagnostics
from grpo.observe.report import charts
from grpo.observe.report.charts import escape as _e

SHOWN_STEPS = 10  # logged steps whose completions the page shows (the newest); the files keep them all
CELL_CHARS = 4000  # characters of one prompt or completion shown; the parquet file keeps the whole text

STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d2330;background:#f5f6f8}
main{max-width:1280px;margin:0 auto;padding:20px 28px 60px}
h1{font-size:22px;margin:0 0 4px}
h2{font-size:17px;margin:30px 0 10px;border-bottom:1px solid #d8dce3;padding-bottom:4px}
.meta{color:#566074;margin:0}.meta b{color:#1d2330}
.status{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600;color:#fff}
.running{background:#2f6fd6}.finished{background:#2e8b57}.stopped{background:#c0392b}.unknown{background:#7a8394}
.finding{background:#fff4e5;border-left:4px solid #e08a00;padding:8px 12px;margin:8px 0;border-radius:3px}
.ok{background:#eaf6ee;border-left:4px solid #2e8b57;padding:8px 12px;border-radius:3px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(470px,1fr));gap:14px}
figure.chart{background:#fff;margin:0;padding:10px;border-radius:6px;box-shadow:0 1px 2px rgba(0,0,0,.08)}
figure.chart svg{width:100%;height:auto;display:block}
figcaption{font-size:12.5px;color:#566074;margin-top:4px}figcaption b{color:#1d2330}
table{border-collapse:collapse;background:#fff;font-size:12.5px}
td,th{border:1px solid #dde1e7;padding:4px 7px;vertical-align:top;text-align:left}th{background:#eef0f4}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
pre{white-space:pre-wrap;word-break:break-word;margin:0;font:12px/1.4 ui-monospace,Menlo,Consolas,monospace}
details{margin:8px 0}summary{cursor:pointer;font-weight:600}
.summary td:first-child{color:#566074}.muted{color:#7a8394}
"""


@dataclass
class Run:
    """What the page shows, read from the output directory (or handed over by the live trainer)."""

    name: str
    rows: list[dict[str, Any]]
    info: dict[str, Any]
    completions: dict[int, list[dict[str, Any]] | str]  # the newest steps': rows, or why the file could not be read
    completion_steps: int  # logged steps with a completions file (all of them, shown or not)
    findings: list[diagnostics.Finding]
    status: str  # running, finished, stopped, unknown
    status_detail: str
    skipped_lines: int = 0
    updated: str = ""


def page(run: Run) -> str:
    run = dataclasses.replace(
        run,
        info=secrets.redact(run.info),
        completions=secrets.redact(run.completions),
        status_detail=secrets.redact_text(run.status_detail),
    )
    training = [r for r in run.rows if "loss" in r or "reward" in r]
    body = [
        _header(run, training),
        _diagnostics(run),
        _summary(run, training),
        _charts(run.rows),
        _completions(run),
        _configuration(run.info),
        f'<p class="muted">Rebuild this page from the files of the run: <code>grpo report '
        f"{_e(run.name)}</code>. It is written at logging steps while the run goes on; reload to see the newest.</p>",
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>GRPO report: {_e(run.name)}</title><style>{STYLE}</style></head>"
        f"<body><main>{''.join(body)}</main></body></html>\n"
    )


def _header(run: Run, training: list[dict]) -> str:
    info = run.info
    last = training[-1]["step"] if training else 0
    total = info.get("max_steps")
    progress = f"step <b>{last}</b>" + (f" of {_e(total)}" if total else "")
    model = info.get("model") or "unknown model"
    rewards = ", ".join(map(str, info.get("reward_names") or charts.reward_names(training))) or "none logged"
    tools = info.get("tools") or []
    starts = info.get("starts") or []
    resumed = [s for s in starts if isinstance(s, dict) and s.get("resumed_from")]
    lines = [
        f"<h1>GRPO run report: {_e(run.name)}</h1>",
        f'<p class="meta"><span class="status {_e(run.status)}">{_e(run.status)}</span> {_e(run.status_detail)}</p>',
        f'<p class="meta">model <b>{_e(model)}</b> · {progress} · reward functions <b>{_e(rewards)}</b>'
        + (f" · tools <b>{_e(', '.join(map(str, tools)))}</b>" if tools else "")
        + (f" · resumed {len(resumed)} time(s), last at step {_e(resumed[-1].get('step'))}" if resumed else "")
        + f" · updated {_e(run.updated)}</p>",
    ]
    if run.skipped_lines:
        lines.append(f'<p class="meta">{run.skipped_lines} unreadable line(s) of metrics.jsonl were skipped.</p>')
    return "".join(lines)


def _diagnostics(run: Run) -> str:
    out = ["<h2>Diagnostics</h2>"]
    if not run.rows:
        out.append('<p class="muted">Nothing logged yet: the checks run at each logging step.</p>')
    elif run.findings:
        for f in run.findings:
            out.append(f'<div class="finding"><b>From step {f.step}:</b> {_e(f.message)}</div>')
    else:
        out.append('<div class="ok">No problem found in the logged metrics.</div>')
    checks = "".join(f"<li><b>{_e(name)}</b>: {_e(rule)}</li>" for name, rule in diagnostics.THRESHOLDS)
    out.append(f"<details><summary>The checks and their thresholds</summary><ul>{checks}</ul></details>")
    return "".join(out)


def _summary(run: Run, training: list[dict]) -> str:
    if not training:
        return ""
    items = []
    for key, label in (
        ("reward", "reward"),
        ("frac_reward_zero_std", "groups with no reward spread"),
        ("completions/mean_length", "mean completion length"),
        ("completions/clipped_ratio", "truncated fraction"),
        ("entropy", "entropy"),
        ("kl", "KL"),
    ):
        first, last = charts.first_and_last(training, key)
        if first is not None:
            items.append(f"<tr><td>{label}</td><td class=num>{_n(first)}</td><td class=num>{_n(last)}</td></tr>")
    seconds = [r["step_time"] for r in training if isinstance(r.get("step_time"), (int, float))]
    evals = [r for r in run.rows if isinstance(r.get("eval_reward"), (int, float))]
    if evals:
        first, last = evals[0]["eval_reward"], evals[-1]["eval_reward"]
        items.append(f"<tr><td>eval_reward</td><td class=num>{_n(first)}</td><td class=num>{_n(last)}</td></tr>")
    extra = f"<p class=muted>{len(training)} logged steps" + (
        f"; about {_n(sum(seconds) / len(seconds))} s per logged step</p>" if seconds else "</p>"
    )
    return (
        f'<h2>Summary</h2><table class="summary"><tr><th></th><th>first logged</th><th>latest</th></tr>'
        f"{''.join(items)}</table>{extra}"
    )


def _charts(rows: Sequence[dict]) -> str:
    drawn = charts.charts(rows)
    if not drawn:
        return "<h2>Charts</h2><p class=muted>No metrics logged yet.</p>"
    figures = []
    for chart in drawn:
        note = f" {_e(chart.note)}" if chart.note else ""
        figures.append(
            f'<figure class="chart" data-chart="{_e(chart.title)}" data-points="{charts.data_points(chart, rows)}">'
            f"{charts.render(chart, rows)}"
            f"<figcaption><b>{_e(chart.title)}.</b>{note}</figcaption></figure>"
        )
    return f'<h2>Charts</h2><div class="grid">{"".join(figures)}</div>'


def _completions(run: Run) -> str:
    out = ["<h2>Sampled completions</h2>"]
    config = run.info.get("config") or {}
    if not run.completions:
        if config.get("log_completions"):
            out.append("<p class=muted>No completions saved yet: they are saved at each logging step.</p>")
        else:
            out.append(
                "<p class=muted>Completions are not logged in this run. Set <code>log_completions=True</code> in "
                "GRPOConfig (or <code>--log_completions</code> on the command line) to see the sampled completions "
                "of each logged step here, with their rewards and advantages.</p>"
            )
        return "".join(out)
    steps = list(run.completions)
    if run.completion_steps > len(steps):
        out.append(
            f"<p class=muted>The newest {len(steps)} of {run.completion_steps} logged steps; every step's completions "
            "are in completions/completions_&lt;step&gt;.parquet.</p>"
        )
    for step in reversed(steps):
        rows = run.completions[step]
        opened = " open" if step == steps[-1] else ""
        if isinstance(rows, str):
            out.append(f"<details{opened}><summary>Step {step}</summary><p>{_e(rows)}</p></details>")
            continue
        columns = [c for c in (rows[0] if rows else {}) if c != "step"]
        head = "".join(f"<th>{_e(c)}</th>" for c in columns)
        body = "".join("<tr>" + "".join(_cell(row.get(c)) for c in columns) + "</tr>" for row in rows)
        out.append(
            f"<details{opened}><summary>Step {step}: {len(rows)} completions</summary>"
            f'<table class="completions"><tr>{head}</tr>{body}</table></details>'
        )
    return "".join(out)


def _configuration(info: dict[str, Any]) -> str:
    out = ["<h2>Configuration</h2>"]
    if not info:
        out.append(
            "<p class=muted>This run saved no run_info.json (written when training starts), so its configuration "
            "and package versions are unknown.</p>"
        )
        return "".join(out)
    changed = info.get("non_default") or {}
    rows = "".join(f"<tr><td><code>{_e(k)}</code></td><td>{_value(v)}</td></tr>" for k, v in sorted(changed.items()))
    out.append(
        "<p>Settings that differ from the defaults:</p>"
        + (f"<table><tr><th>field</th><th>value</th></tr>{rows}</table>" if rows else "<p class=muted>none</p>")
    )
    config = info.get("config") or {}
    full = "".join(f"<tr><td><code>{_e(k)}</code></td><td>{_value(v)}</td></tr>" for k, v in config.items())
    out.append(f"<details><summary>Every setting ({len(config)})</summary><table>{full}</table></details>")
    versions = info.get("versions") or {}
    cells = "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in versions.items())
    out.append(f"<h2>Versions</h2><table><tr><th>package</th><th>version</th></tr>{cells}</table>")
    starts = [s for s in info.get("starts") or [] if isinstance(s, dict)]
    if starts:
        items = "".join(
            f"<li>{_e(s.get('time'))}: at step {_e(s.get('step'))}"
            + (f", resumed from {_e(s.get('resumed_from'))}" if s.get("resumed_from") else "")
            + "</li>"
            for s in starts
        )
        out.append(f"<h2>Starts of this run</h2><ul>{items}</ul>")
    return "".join(out)


def _cell(value: Any) -> str:
    if isinstance(value, float) and not isinstance(value, bool):
        return f"<td class=num>{_n(value)}</td>"
    if value is None:
        return "<td></td>"
    text = str(value)
    if len(text) > CELL_CHARS:
        text = text[:CELL_CHARS] + f"\n… ({len(text) - CELL_CHARS} more characters in the parquet file)"
    return f"<td><pre>{_e(text)}</pre></td>"


def _value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return f"<code>{_e(text)}</code>"


def _n(value: Any) -> str:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or abs(value) > charts.DRAWABLE or math.isnan(value):  # a 400-digit int has no float: as text
        return _e(value)
    return f"{value:.4g}"


def run_name(output_dir: str) -> str:
    return os.path.basename(os.path.normpath(os.path.abspath(output_dir))) or output_dir
