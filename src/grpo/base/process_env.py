"""Environment variables that grpo sets for a dependency: one helper, so each is set once, before the code that
reads it, never overrides the user's own value, and is logged."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("grpo")


def set_for_dependency(name: str, value: str, why: str) -> bool:
    """Set `name=value` for the whole process unless the user has set it; returns whether it is now `value`."""
    if name in os.environ:
        if os.environ[name] != value:
            logger.info(
                "%s=%s is set in the environment; grpo leaves it (it would set %s: %s).",
                name,
                os.environ[name],
                value,
                why,
            )
        return os.environ[name] == value
    os.environ[name] = value
    logger.info("Environment: %s=%s (%s).", name, value, why)
    return True
