"""Running on several processes through accelerate: the accelerator, the collectives the loop uses, gradient
accumulation across processes, sharded models (FSDP) and DeepSpeed ZeRO. The loop calls these small helpers so
that it reads the same on 1 and N processes."""
