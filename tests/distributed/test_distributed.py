"""Two CPU processes (torchrun, gloo) make the same update as one process on the same global batch: prompts,
groups and rewards are distributed, rewards normalized over whole groups, metrics reduced, the loss normalized
so that DDP's gradient average equals the one-process gradient (dapo: token sum over the global token count;
grpo: mean of per-sequence means). bnpo is a mean of per-process token means by definition, so it is not
compared."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from support.launch import job_script, launch, launch_runs, needs_deepspeed, torchrun

# the one-process runs that two-process runs are compared with (the sharded modes with gradient accumulation, or
# with LoRA, share theirs)
ONE_PROCESS = [("dapo", "ddp"), ("grpo", "ddp"), ("dapo", "ddp+ga2"), ("dapo", "ddp+lora"), ("dapo", "ddp+kl")]
TWO_PROCESSES = [("dapo", "ddp"), ("grpo", "ddp")]
# packing="tree" at two processes, against one padded process: beta > 0 with a reference, LoRA (its reference the
# adapter-less model), gradient accumulation
TREES = [("dapo", "ddp+kl+tree"), ("dapo", "ddp+lora+tree"), ("dapo", "ddp+ga2+tree"), ("grpo", "ddp+tree")]


@pytest.fixture(scope="module")
def replicated(tiny_model_dir, tmp_path_factory):
    """Every one-process run in a single launch (a trainer each, one after another), and beside it the replicated
    (DDP) two-process runs of both loss types in another: (one-process runs, two-process runs)."""
    with ThreadPoolExecutor(1) as beside:
        two = beside.submit(launch_runs, 2, tmp_path_factory.mktemp("two"), tiny_model_dir, TWO_PROCESSES + TREES)
        one = launch_runs(1, tmp_path_factory.mktemp("one"), tiny_model_dir, ONE_PROCESS)
        return one, two.result()


@pytest.fixture(scope="module")
def one_process(replicated):
    return replicated[0]


@pytest.fixture(scope="module")
def two_processes(replicated):
    return replicated[1]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_processes_update_like_one(one_process, two_processes, loss_type):
    one, row1 = one_process[(loss_type, "ddp")]
    two, row2 = two_processes[(loss_type, "ddp")]
    assert (row1["world"], row2["world"]) == (1, 2)
    for name in one:
        assert one[name].abs().sum() > 0
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-7)
    # metrics are reduced over both processes: the same numbers as one process on the whole batch
    for key in ("reward", "reward_std", "completions/mean_length", "entropy", "grad_norm", "loss"):
        assert row2[key] == pytest.approx(row1[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("loss_type, mode", TREES)
def test_two_processes_of_token_trees_update_like_one_padded_process(one_process, two_processes, loss_type, mode):
    """packing="tree" at two processes (each laying out its rows of a group as that group's tree) updates the
    weights as one process training the padded layout, with the KL to a reference, LoRA and accumulation."""
    one, row1 = one_process[(loss_type, mode.removesuffix("+tree"))]
    two, row2 = two_processes[(loss_type, mode)]
    assert (row1["world"], row2["world"], row1["tree"], row2["tree"]) == (1, 2, False, True)
    lora = "lora" in mode
    for name in one:
        assert bool(one[name].abs().sum() > 0) is ("lora_" in name or not lora), name
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6)
    compared = ("reward", "reward_std", "completions/mean_length", "entropy", "grad_norm", "loss")
    for key in compared + ("kl",) * ("kl" in mode or lora):
        assert row2[key] == pytest.approx(row1[key], rel=1e-5, abs=1e-6), key


SHARDED_MODES = ["fsdp+ga2", "fsdp+lora"] + [
    pytest.param(mode, marks=needs_deepspeed) for mode in ("zero2+ga2", "zero3+ga2", "zero3+lora", "zero3+kl")
]


@pytest.mark.parametrize("mode", SHARDED_MODES)
def test_sharded_training_through_accelerate_updates_like_one_process(tiny_model_dir, tmp_path, one_process, mode):
    """The trainer under accelerate's FSDP2 path, or DeepSpeed ZeRO-2 / ZeRO-3, at 2 processes (see
    distributed_job.py): parameters sharded (FSDP, ZeRO-3; ZeRO-2 partitions gradients and optimizer state),
    the trainer's fast engine samples from the sharded model, the update equals one unsharded process's on the
    same global batch, metrics are reduced alike, and save_model after train() writes the whole updated model.
    With +lora: a PEFT model with LoRA on q/v, sharded the same way, and beta > 0 with the adapter-less model as
    the reference: only the adapters move, as in one process, and save_model writes the adapter. With +kl: two
    steps with beta > 0 and a reference model, which ZeRO-3 partitions too. With +ga2: the same completions in
    two accumulated micro-steps (DeepSpeed reduces, clips and steps at the boundary the trainer marks)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    stage, *options = mode.split("+")
    lora, kl = "lora" in options, "kl" in options
    one, row1 = one_process[("dapo", "+".join(["ddp", *options]))]
    two, row2 = launch(2, tmp_path / "two", tiny_model_dir, "dapo", mode)
    assert row2["world"] == 2 and row2["sharded"] is (stage != "zero2") and row2["engine"] == stage
    if kl:
        assert row2["step"] == 2 and row2["reference_sharded"] is True and row1["kl"] > 0
    assert len(row2["sampled"]) == 2 and all(1 <= n <= 8 for n in row2["sampled"])
    for name in one:
        trains = "lora_" in name or not lora
        assert bool(one[name].abs().sum() > 0) is trains, name
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-7)
    compared = ("reward", "reward_std", "completions/mean_length", "entropy", "grad_norm", "loss")
    for key in compared + ("kl",) * (lora or kl):
        assert row2[key] == pytest.approx(row1[key], rel=1e-5, abs=1e-7), key
    if lora:
        saved = load_file(os.path.join(tmp_path / "two", "saved", "adapter_model.safetensors"))
        initial = torch.load(os.path.join(tmp_path / "two", "initial.pt"))
        assert set(saved) == {n.replace(".default", "") for n in two if "lora_" in n}
        for name, update in two.items():
            if "lora_" in name:
                torch.testing.assert_close(
                    saved[name.replace(".default", "")], initial[name] + update, rtol=0, atol=1e-6
                )
        return
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    saved = load_file(os.path.join(tmp_path / "two", "saved", "model.safetensors"))
    for name, update in two.items():
        torch.testing.assert_close(saved[name], initial[name].detach() + update, rtol=0, atol=1e-6)


def test_auto_takes_one_layout_in_every_process_where_forwards_are_collectives(tmp_path):
    """Under DDP every forward broadcasts buffers, so each process must run as many forwards as the others: where
    packing="auto" alone would lay out trees in one process (one forward) and padded rows sharing the prompt in the
    other (two), both take one layout (the padded rows here: together they cost less) instead of hanging, and
    score as the padded pass does."""
    torchrun(2, job_script("layouts_job.py"), tmp_path, timeout=120)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["alone_trees"] for r in ranks] == [True, False]  # alone, the processes would disagree
    # the gradient pass and the pass without gradients: each as padded rows sharing the prompt in both processes
    assert ranks[0]["laid_out"] == ranks[1]["laid_out"] == {"shared_prefix": 2}
    for r in ranks:
        for got, expected in zip(r["auto"], r["padded"]):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-6)
