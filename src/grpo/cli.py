"""The `grpo` command: `grpo train ...` (TRL's `trl grpo`, `grpo.train_cli`), `grpo vllm-serve ...` (vLLM's own
server with the flags the trainer needs, `grpo.serve.launcher`) and `grpo report <output_dir>` (a run's report.html
rebuilt from its files, `grpo.observe.report`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from grpo import train_cli
from grpo.observe import report
from grpo.serve import launcher


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo", description="grpo: a GRPO trainer compatible with TRL 1.16.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.add_parser(
        "train",
        help="train with GRPO from a YAML recipe and flags (TRL's `trl grpo`; `grpo train --help`)",
        add_help=False,
    )
    commands.add_parser(
        "vllm-serve",
        parents=[launcher.build_parser(add_help=False)],
        help="run vLLM's server for the trainer (server mode); unknown flags go to vLLM",
        description=launcher.build_parser().description,
    )
    reporting = commands.add_parser(
        "report",
        help="rebuild a run's report.html from its output_dir (finished or not, resumed or not)",
        description="Write <output_dir>/report.html from the files a run left there: metrics.jsonl, completions/, "
        "run_info.json. The diagnostics are replayed over the metrics.",
    )
    reporting.add_argument("output_dir", help="the run's output_dir")
    reporting.add_argument("--output", metavar="FILE", help="write the page here instead of <output_dir>/report.html")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # its own parser: every GRPOConfig field and TRL's script and model arguments
        try:
            return train_cli.main(argv[1:])
        except train_cli.UsageError as err:  # a bad flag or config file: one line, argparse's status
            print(err, file=sys.stderr)
            return 2
    args, extra = build_parser().parse_known_args(argv)
    if args.command == "vllm-serve":
        return launcher.serve(args, extra)
    if extra:
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "report":
        try:
            path = report.rebuild(args.output_dir, args.output)
        except (report.ReportError, OSError) as err:
            print(f"grpo report: {err}", file=sys.stderr)
            return 2
        print(path)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
