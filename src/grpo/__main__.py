"""`python -m grpo`: the `grpo` command (`grpo.cli`)."""

import sys

from grpo.cli import main

sys.exit(main())
