"""The `grpo` command: `grpo train ...` (TRL's `trl grpo`, `grpo.train_cli`) and `grpo vllm-serve ...` (a
generation server for the trainer, `grpo.server`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from grpo import server, train_cli


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
        parents=[server.build_parser(add_help=False)],
        help="serve generation from a vLLM engine (weights updatable by the trainer)",
        description=server.build_parser().description,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # its own parser: every GRPOConfig field and TRL's script and model arguments
        return train_cli.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "vllm-serve":
        return server.serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
