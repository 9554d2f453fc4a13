"""The report's charts: each a metric family against the optimizer step, drawn as an inline SVG element (lines, a
+/- spread band, markers for short runs, a legend, round ticks, a log axis where asked), so the page needs
nothing else to open and a build costs milliseconds, not a plotting library's start-up and rasterizing.

A chart is drawn only when its metrics were logged (KL only with beta > 0, the sampling ratios only when the
sampler's log-probs are known, tool calls only for tool runs, evaluation only with an eval dataset). A value that
is missing or not finite at a step leaves a gap; one too large to draw (beyond +/-DRAWABLE: a JSON integer of 400
digits, 1.7e308, whose span with -1.7e308 is no float) is left out, and the chart says how many were.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Line:
    key: str
    label: str
    band: str | None = None  # the key of a spread drawn as +/- around the line
    dashed: bool = False


@dataclass(frozen=True)
class Chart:
    title: str
    lines: tuple[Line, ...]
    ylabel: str = ""
    note: str = ""  # one sentence under the chart: what to read in it
    log_scale: bool = False
    unit_interval: bool = False  # a fraction: the axis spans [0, 1]
    keys: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(line.key for line in self.lines))


def _lines(*specs: tuple) -> tuple[Line, ...]:
    return tuple(Line(*spec) for spec in specs)


def reward_names(rows: Sequence[dict]) -> list[str]:
    """The reward functions logged (rewards/<name>/mean), in the order first seen."""
    names: dict[str, None] = {}
    for row in rows:
        for key in row:
            if key.startswith("rewards/") and key.endswith("/mean"):
                names[key[len("rewards/") : -len("/mean")]] = None
    return list(names)


def charts(rows: Sequence[dict]) -> list[Chart]:
    """The charts the logged rows can fill, in the report's order."""
    names = reward_names(rows)
    evals = ["eval_reward"] + sorted({k for row in rows for k in row if k.startswith("eval_pass@")})
    every = [
        Chart(
            "Reward",
            _lines(("reward", "total (weighted sum)", "reward_std"), ("eval_reward", "held-out eval", None, True)),
            note="Mean reward per completion, with its spread (+/- std) across the batch.",
        ),
        Chart(
            "Reward per function",
            tuple(Line(f"rewards/{n}/mean", n, f"rewards/{n}/std") for n in names),
            note="Each reward function's mean (unweighted), +/- its std.",
        ),
        Chart(
            "Groups with no reward spread",
            _lines(("frac_reward_zero_std", "fraction of groups")),
            unit_interval=True,
            note="Groups whose completions all scored the same: their advantage is 0, they teach nothing.",
        ),
        Chart(
            "Completion length",
            _lines(
                ("completions/mean_length", "mean"),
                ("completions/min_length", "min", None, True),
                ("completions/max_length", "max", None, True),
            ),
            ylabel="tokens",
        ),
        Chart(
            "Truncated completions",
            _lines(("completions/clipped_ratio", "fraction truncated")),
            unit_interval=True,
            note="Completions that hit max_completion_length before ending.",
        ),
        Chart("KL to the reference model", _lines(("kl", "KL")), note="Logged when beta > 0."),
        Chart("Entropy", _lines(("entropy", "mean token entropy")), ylabel="nats / token"),
        Chart(
            "Clip ratios",
            _lines(
                ("clip_ratio/region_mean", "clipped (either side)"),
                ("clip_ratio/low_mean", "below 1 - epsilon", None, True),
                ("clip_ratio/high_mean", "above 1 + epsilon_high", None, True),
            ),
            unit_interval=True,
            note="Fraction of tokens whose policy ratio the clipped objective cut.",
        ),
        Chart(
            "Sampling mismatch",
            _lines(
                ("sampling/sampling_logp_difference/mean", "mean |log p_train - log p_sampler|"),
                ("sampling/sampling_logp_difference/max", "max", None, True),
            ),
            log_scale=True,
            note="How far the trained policy's log-probs are from the sampler's, per generated token.",
        ),
        Chart(
            "Importance-sampling ratio",
            _lines(
                ("sampling/importance_sampling_ratio/mean", "mean"),
                ("sampling/importance_sampling_ratio/min", "min", None, True),
                ("sampling/importance_sampling_ratio/max", "max", None, True),
            ),
            note="p_train / p_sampler per token: 1 when the sampler has the trained weights.",
        ),
        Chart(
            "Tool calls",
            _lines(("tools/call_frequency", "calls per completion"), ("tools/failure_frequency", "failed fraction")),
        ),
        Chart("Gradient norm", _lines(("grad_norm", "before clipping")), log_scale=True),
        Chart("Learning rate", _lines(("learning_rate", "learning rate"))),
        Chart(
            "Where the time goes",
            _lines(
                ("step_time", "optimizer step"),
                ("timing/generation_s", "generation"),
                ("timing/scoring_s", "scoring (rewards)"),
                ("timing/gather_s", "gathering (processes)"),
            ),
            ylabel="seconds",
            note="Seconds per optimizer step, and per generation batch for generating, scoring and gathering it.",
        ),
        Chart(
            "Throughput",
            _lines(("timing/generation_tokens_per_s", "generation"), ("timing/training_tokens_per_s", "training")),
            ylabel="tokens / s",
        ),
        Chart("Evaluation", tuple(Line(k, k[len("eval_") :]) for k in evals), note="On the eval dataset."),
    ]
    return [chart for chart in every if any(_points(rows, key) for key in chart.keys) or left_out(chart, rows)]


DRAWABLE = 1e300  # values up to it keep every span, band and tick of a chart a finite float


def _number(value: Any) -> float | None:
    """A logged value as a float a chart can draw (a number, not NaN, |x| <= DRAWABLE), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or _too_large(value):
        return None
    return None if math.isnan(value) else float(value)


def _too_large(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > DRAWABLE


def left_out(chart: Chart, rows: Sequence[dict]) -> int:
    """How many of the chart's logged values are too large to draw."""
    return sum(_too_large(row.get(key)) for row in rows for key in chart.keys)


def _points(rows: Sequence[dict], key: str) -> list[tuple[int, float]]:
    numbers = [(row["step"], _number(row["step"]), _number(row.get(key))) for row in rows]
    return [(step, y) for step, x, y in numbers if x is not None and y is not None]


WIDTH, HEIGHT = 560, 290
LEFT, RIGHT, BOTTOM = 62, 14, 40  # the plot area's margins (the top one holds the legend)
MAX_POINTS = 1000  # per line; longer series are thinned (`thinned`)
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")


def render(chart: Chart, rows: Sequence[dict]) -> str:
    """The chart as an inline SVG element (a few kilobytes; a few milliseconds to build)."""
    skipped = left_out(chart, rows)
    plural = skipped != 1
    note = f"{skipped} value{'s' * plural} too large to draw (|x| > 1e300) {'are' if plural else 'is'} left out"
    drawn = []
    for n, line in enumerate(chart.lines):
        points = _points(rows, line.key)
        if points:
            spread = dict(_points(rows, line.band)) if line.band else {}
            band = [(x, y - spread[x], y + spread[x]) for x, y in points if x in spread]
            drawn.append((line, COLORS[n % len(COLORS)], points, band))
    frame = (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(chart.title)}" font-family="system-ui,sans-serif" font-size="11" fill="#333">'
    )
    if not drawn:  # every value too large: the frame says so
        return f'{frame}<text x="{WIDTH / 2:.0f}" y="{HEIGHT / 2:.0f}" text-anchor="middle">{escape(note)}</text></svg>'
    values = [y for _, _, points, _ in drawn for _, y in points]
    log = chart.log_scale and min(values) > 0 and max(values) > min(values)
    scale = Scale(values + [v for *_, band in drawn for _, lo, hi in band for v in (lo, hi)], log, chart.unit_interval)
    steps = [x for _, _, points, _ in drawn for x, _ in points]
    x_lo, x_hi = min(steps), max(steps)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    x_ticks = ticks(x_lo, x_hi, 8, integer=True)
    legend, top = _legend([(line, color) for line, color, _, _ in drawn])

    def px(x: float) -> float:
        return LEFT + (x - x_lo) / (x_hi - x_lo) * (WIDTH - LEFT - RIGHT)

    def py(y: float) -> float:
        return top + (1 - scale.fraction(y)) * (HEIGHT - top - BOTTOM)

    bottom, right = HEIGHT - BOTTOM, WIDTH - RIGHT
    out = [frame]
    for y in scale.ticks():
        out.append(f'<line x1="{LEFT}" x2="{right}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#e4e7ec"/>')
        out.append(f'<text x="{LEFT - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{_tick(y)}</text>')
    for x in x_ticks:
        if x_lo <= x <= x_hi:
            out.append(f'<line x1="{px(x):.1f}" x2="{px(x):.1f}" y1="{top}" y2="{bottom}" stroke="#eef0f3"/>')
            out.append(f'<text x="{px(x):.1f}" y="{bottom + 15}" text-anchor="middle">{_tick(x)}</text>')
    out.append(f'<path d="M{LEFT},{top}V{bottom}H{right}" fill="none" stroke="#555"/>')
    out.append(f'<text x="{(LEFT + right) / 2:.0f}" y="{HEIGHT - 6}" text-anchor="middle">step</text>')
    if chart.ylabel:
        turn = f"translate(14 {(top + bottom) / 2:.0f}) rotate(-90)"
        out.append(f'<text transform="{turn}" text-anchor="middle">{escape(chart.ylabel)}</text>')
    for line, color, points, band in drawn:
        if len(band) > 1:
            edge = [f"{px(x):.1f},{py(hi):.1f}" for x, _, hi in band] + [
                f"{px(x):.1f},{py(lo):.1f}" for x, lo, _ in reversed(band)
            ]
            out.append(f'<polygon points="{" ".join(edge)}" fill="{color}" fill-opacity="0.15"/>')
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in thinned(points))
        dash = ' stroke-dasharray="5 3"' if line.dashed else ""
        width = 1.2 if line.dashed else 2
        out.append(
            f'<polyline class="series" points="{coords}" fill="none" stroke="{color}" stroke-width="{width}"{dash}/>'
        )
        if len(points) <= 30:
            out.extend(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.4" fill="{color}"/>' for x, y in points)
    out.extend(legend)
    if skipped:
        out.append(f'<text x="{right - 4}" y="{top + 12}" text-anchor="end" fill="#b42318">{escape(note)}</text>')
    out.append("</svg>")
    return "".join(out)


def thinned(points: list[tuple[int, float]], buckets: int = MAX_POINTS // 2) -> list[tuple[int, float]]:
    """A long series drawn with at most MAX_POINTS points: each of `buckets` runs of steps keeps its lowest and
    highest value, in step order (a spike stays visible; the page stays small)."""
    if len(points) <= MAX_POINTS:
        return points
    size = math.ceil(len(points) / buckets)
    kept = []
    for start in range(0, len(points), size):
        run = points[start : start + size]
        low, high = min(run, key=lambda p: p[1]), max(run, key=lambda p: p[1])
        kept.extend(sorted({low, high}))
    return kept


def _legend(lines: Sequence[tuple[Line, str]]) -> tuple[list[str], int]:
    """The legend in rows above the plot area (wrapped at the width); returns it and the plot area's top."""
    out, x, row = [], LEFT, 0
    for line, color in lines:
        label = escape(line.label[:48])
        width = 26 + 6 * len(line.label[:48])
        if x + width > WIDTH - RIGHT and x > LEFT:
            x, row = LEFT, row + 1
        y = 12 + 14 * row
        dash = ' stroke-dasharray="5 3"' if line.dashed else ""
        out.append(
            f'<line x1="{x}" x2="{x + 18}" y1="{y - 4}" y2="{y - 4}" stroke="{color}" stroke-width="2"{dash}/>'
            f'<text x="{x + 22}" y="{y}" font-size="10">{label}</text>'
        )
        x += width + 10
    return out, 12 + 14 * row + 12


class Scale:
    """The y axis: linear (nice bounds around the values) or log10, or the unit interval for fractions."""

    def __init__(self, values: Sequence[float], log: bool, unit: bool) -> None:
        self.log = log
        self.lo: float
        self.hi: float
        if log:
            positive = [v for v in values if v > 0]
            self.lo, self.hi = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
            self.hi = max(self.hi, self.lo + 1)
            return
        lo, hi = min(values), max(values)
        if unit:
            lo, hi = min(lo, 0.0), max(hi, 1.0)
        if hi == lo:
            pad = abs(hi) * 0.1 or 1.0
            lo, hi = lo - pad, hi + pad
        self.tick_values = ticks(lo, hi, 5)
        self.lo, self.hi = min(self.tick_values[0], lo), max(self.tick_values[-1], hi)

    def fraction(self, y: float) -> float:
        if self.log:
            y = math.log10(y) if y > 0 else self.lo
        return min(max((y - self.lo) / (self.hi - self.lo), -0.02), 1.02)

    def ticks(self) -> list[float]:
        if self.log:
            return [10.0**k for k in range(int(self.lo), int(self.hi) + 1)]
        return self.tick_values


def ticks(lo: float, hi: float, count: int, integer: bool = False) -> list[float]:
    """About `count` round values (1, 2 or 5 times a power of ten) covering [lo, hi]."""
    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = min((m * power for m in (1, 2, 5, 10)), key=lambda c: abs(math.log(c / raw)))
    if integer:
        step = max(1, round(step))
    first = math.floor(lo / step) * step
    out = []
    value = first
    while value <= hi + step * 1e-9:
        out.append(round(value, 12))
        value += step
    if out[-1] < hi:
        out.append(round(out[-1] + step, 12))
    return out


def _tick(value: float) -> str:
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        mantissa, exponent = f"{value:.2e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return f"{value:.4g}"


def escape(text: Any) -> str:
    """Text from the run, safe inside the page's markup and attributes."""
    return html.escape(str(text), quote=True)


def data_points(chart: Chart, rows: Sequence[dict]) -> int:
    """How many logged values the chart shows (the page states it, a test checks it)."""
    return sum(len(_points(rows, key)) for key in chart.keys)


def first_and_last(rows: Sequence[dict], key: str) -> tuple[Any, Any]:
    points = _points(rows, key)
    return (points[0][1], points[-1][1]) if points else (None, None)
