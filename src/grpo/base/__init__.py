"""The leaves: what every layer may use and that imports nothing of grpo (the plain records that pass between the
layers: prompts, requests, rollouts; SIGTERM, secrets, the environment set for dependencies, background threads,
seeds)."""
