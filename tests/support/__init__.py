"""What the tests share. Only tests/ is on sys.path (tests/conftest.py puts it there; job processes get it on their
PYTHONPATH), so a test imports its helpers from here, `from support.tiny import make_model`, and never from another
test module (tests/unit/test_boundaries.py checks it).

- `runs`: the small run's config (`BASE`, `cfg`), datasets, a generation from a trainer, parameter snapshots, the
  logged rows a run reproduces; `rewards`: reward functions (`length_reward`, ...);
- `tiny`, `vision`, `families`: the tiny models and tokenizer, the tiny vision-language models, the model-family
  table; `scripted`: engines that answer by a fixed rule; `on_device`: the equivalence tests' device and tolerances;
- `layouts`: tiny batches and the training pass over them (padded rows, prefix sharing, token trees, turns);
  `decode`: the fast engine's tests' setting; `float64`: literal tensors for the math tests; `images`: PNG files of
  any size for the pixel-budget tests;
- `agent`, `vision_runs`, `hub`, `reports`, `vllm_runs`, `served`: what the tests of one theme share (tools and
  scripted turns, image rows and picture tools, a recording Hub, recorded histories, the vLLM engines against the
  policy, `grpo vllm-serve` servers);
- `launch`, `zygote`, `sharded`, `jobs/`: tests of several processes: the launcher, the process the jobs are forked
  from, accelerate's sharded paths on the CPU, and the job scripts themselves;
- `field_effects`: the registered effect of each TRL config field (tests/integration/test_trl_fields.py)."""
