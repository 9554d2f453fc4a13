"""The leaves: what every layer may use and that imports nothing of grpo (SIGTERM, secrets, the environment
set for dependencies, background threads, seeds)."""
