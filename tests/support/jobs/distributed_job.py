"""One GRPO step on fixed completions, launched with torchrun (gloo on CPU) by test_distributed.py:

    torchrun --nproc_per_node N distributed_job.py OUT MODEL_DIR LOSS_TYPE [fsdp|zero2|zero3|ddp][+lora][+kl][+ga2]
    torchrun --nproc_per_node N distributed_job.py OUT MODEL_DIR --runs LOSS_TYPE:ddp[+...] ...

(+sync: beta > 0 and sync_ref_model every step; the reference's parameters go to OUT too. +tree: packing="tree".)
With --runs, several replicated (ddp) runs one after another in the same processes, a trainer each, run
LOSS_TYPE:MODE into OUT/LOSS_TYPE:MODE: one launch for what several would compute alike (a sharded mode sets up the
whole process, so it has a launch of its own).

Every process takes 8/N completions per micro-step, so the global batch is the same 8 completions whatever N is.
The update (SGD, linear in the gradient) and the logged metrics go to OUT (main process).

With `fsdp`, the run goes through accelerate's FSDP2 path as `accelerate launch` with an FSDP config sets it up
(ACCELERATE_USE_FSDP / FSDP_VERSION=2 in the environment): accelerate's `prepare` shards every decoder layer and
the root. accelerate enables FSDP only on accelerators (its state keeps MULTI_CPU), while torch's FSDP2 runs on
CPU over gloo, so the job lifts that one gate (`use_fsdp`) and everything else is accelerate's own path.
With `zero2` / `zero3`, the run goes through accelerate's DeepSpeed path as `accelerate launch --use_deepspeed
--zero_stage N` sets it up (ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_ZERO_STAGE); DeepSpeed runs on the CPU
by itself (its CPU accelerator, gloo), nothing is lifted (`use_deepspeed` leaves out one inference-only kernel).
In these modes, before training, the trainer's own engine samples from the sharded model; then the trainer saves
its model."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from grpo import GRPOTrainer
from grpo.models.modeling import unwrap
from support.rewards import token_count_reward
from support.runs import cfg, chat_dataset
from support.scripted import FixedEngine, as_requests
from support.sharded import use_deepspeed, use_fsdp, whole


def main() -> None:
    out, model_dir = sys.argv[1:3]
    if sys.argv[3] == "--runs":
        for run_spec in sys.argv[4:]:
            loss_type, mode = run_spec.split(":")
            assert mode.split("+")[0] == "ddp", f"{run_spec}: only replicated runs share a launch"
            run(os.path.join(out, run_spec), model_dir, loss_type, mode)
    else:
        run(out, model_dir, sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else "ddp")


def run(out: str, model_dir: str, loss_type: str, mode_spec: str) -> None:
    os.makedirs(out, exist_ok=True)
    mode, *options = mode_spec.split("+")
    if mode == "fsdp":
        use_fsdp()
    if mode.startswith("zero"):
        use_deepspeed(mode[-1])
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    lora = "lora" in options  # LoRA adapters on q/v (random A and B, so both train), KL to the adapter-less model
    sync = "sync" in options  # sync_ref_model: the policy mixed into the reference after every step
    kl = lora or sync or "kl" in options  # beta > 0: without LoRA, a reference model
    ga = 2 if "ga2" in options else 1  # the same 8 completions in two accumulated micro-steps
    packing = "tree" if "tree" in options else "padded"  # packing="tree": the training pass as token trees
    args = cfg(
        Path(out),
        output_dir=out,
        per_device_train_batch_size=8 // world // ga,
        loss_type=loss_type,
        gradient_accumulation_steps=ga,
        shuffle_dataset=False,
        gradient_checkpointing=False,
        save_strategy="no",
        beta=0.04 if kl else 0.0,
        max_steps=2 if kl else 1,
        sync_ref_model=sync,
        ref_model_sync_steps=1,
        packing=packing,
    )  # step 2: the policy has left the reference
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        model = get_peft_model(
            model,
            LoraConfig(
                r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM"
            ),
        )
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    trainer = GRPOTrainer(
        model=model, reward_funcs=token_count_reward, train_dataset=chat_dataset(), args=args, optimizers=(sgd, None)
    )
    extra = {"tree": trainer.training_pass.tree}  # packing="tree" taken (not fallen back from)
    if mode != "ddp":
        from grpo.data.prompts import tokenize_prompts
        from grpo.distributed import zero
        from grpo.distributed.sharding import is_sharded

        extra["sharded"] = is_sharded(trainer.model) or zero.is_partitioned(trainer.unwrapped_model)
        if trainer.ref_model is not None:
            extra["reference_sharded"] = is_sharded(trainer.ref_model) or zero.is_partitioned(trainer.ref_model)
        extra["engine"] = (
            f"zero{zero.plugin(trainer.accelerator).zero_stage}"
            if zero.in_use(trainer.accelerator)
            else "fsdp"
            if is_sharded(trainer.model)
            else "ddp"
        )
        rows = as_requests(tokenize_prompts([chat_dataset()[0]["prompt"]] * 2, trainer.processing_class))
        extra["sampled"] = [len(c) for c in trainer.engine.generate(rows).completion_ids]
    rank = trainer.accelerator.process_index  # rows before this process's share of the global batch:
    trainer.engine = FixedEngine(trainer.processing_class, offset=rank * args.generation_batch_size // world)
    before = whole(trainer.unwrapped_model)
    trainer.train()
    after = whole(trainer.unwrapped_model)
    reference = whole(unwrap(trainer.ref_model)) if sync else None
    if mode != "ddp":
        trainer.save_model(os.path.join(out, "saved"))
    if trainer.accelerator.is_main_process:
        torch.save({n: p - before[n] for n, p in after.items()}, os.path.join(out, "update.pt"))
        torch.save(before, os.path.join(out, "initial.pt"))
        if reference is not None:
            torch.save(reference, os.path.join(out, "reference.pt"))
        with open(os.path.join(out, "row.json"), "w") as f:
            json.dump({**trainer.state.log_history[-1], "world": trainer.accelerator.num_processes, **extra}, f)


if __name__ == "__main__":
    main()
