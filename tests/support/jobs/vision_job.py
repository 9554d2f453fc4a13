"""One process of the two-process vision-language run of `tests/integration/test_vision.py` (torchrun, gloo on CPU): a
tiny VLM trains two steps on rows of which the second process gets only text (its vision tower has no gradient: DDP's
default for a vision-language model, find_unused_parameters, lets it be); each process saves its parameters.

    python -m torch.distributed.run --nproc_per_node=2 tests/vision_job.py OUT ARCH [PACKING]

(PACKING: GRPOConfig's `packing`, default None; with it, plain SGD, whose update is the gradient itself, so that
two layouts' runs compare to float32 rounding (Adam's first steps normalize a near-zero gradient element into a
full step); the pieces each layout took are saved too.)
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/: support.*

from grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from support.rewards import length_reward  # noqa: E402
from support.vision import MODELS, image  # noqa: E402


def main() -> None:
    out, arch = sys.argv[1:3]
    packing = sys.argv[3] if len(sys.argv) > 3 else None
    rows = [
        {"prompt": [{"role": "user", "content": f"Picture {i}?"}], "image": image(i, 30 + 6 * i, 30) if i < 2 else None}
        for i in range(4)
    ]
    args = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        max_steps=2,
        shuffle_dataset=False,  # prompts 0, 1 (images) on the first process, 2, 3 (text) on the second
        bf16=False,
        disable_tqdm=True,
        save_strategy="no",
        report_to="none",
        beta=0.04,
        packing=packing,
        **({"learning_rate": 1e-2} if packing is None else {"optim": "sgd", "learning_rate": 0.5}),
    )
    model, processor = MODELS[arch](0)
    trainer = GRPOTrainer(
        model=model, processing_class=processor, reward_funcs=length_reward, train_dataset=rows, args=args
    )
    assert trainer.args.ddp_find_unused_parameters is True
    local = trainer.parts.producer.rows(0)
    trainer.train()
    rank = dist.get_rank()
    state = {n: p.detach().clone() for n, p in trainer.unwrapped_model.named_parameters()}
    laid_out = dict(trainer.training_pass.laid_out)
    torch.save({"params": state, "rows": local, "laid_out": laid_out}, os.path.join(out, f"params_{rank}.pt"))


if __name__ == "__main__":
    main()
