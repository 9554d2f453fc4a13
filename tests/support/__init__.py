"""What the tests share. Only tests/ is on sys.path (tests/conftest.py puts it there; job processes get it on their
PYTHONPATH), so a test imports its helpers from here: `from support.tiny import make_model`.

- `runs`: the small run's config (`BASE`, `cfg`), datasets, a generation from a trainer, parameter snapshots;
- `rewards`: reward functions (`length_reward`, ...);
- `tiny`, `vision`: the tiny models and tokenizer, the tiny vision-language models; `scripted`: engines that answer
  by a fixed rule; `on_device`: the equivalence tests' device and tolerances;
- `served`: `grpo vllm-serve` servers for the vLLM tests;
- `launch`, `zygote`, `jobs/`: tests of several processes: the launcher, the process the jobs are forked from, and
  the job scripts themselves;
- `field_effects`: the registered effect of each TRL config field (tests/integration/test_trl_fields.py)."""
