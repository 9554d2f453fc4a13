"""GRPO on DeepMath with one reward function: the script the recipes launch (docs/recipes.md).

    python examples/train_grpo.py                                                        # one GPU (or the CPU)
    accelerate launch --config_file examples/accelerate/ddp.yaml examples/train_grpo.py  # every GPU: DDP
    accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/train_grpo.py
    accelerate launch --config_file examples/accelerate/zero3.yaml examples/train_grpo.py
    LORA=1 python examples/train_grpo.py                      # LoRA adapters only (the peft extra)
    VLLM=colocate python examples/train_grpo.py               # generate with vLLM in each training process
    VLLM=server python examples/train_grpo.py                 # generate on `grpo vllm-serve` (GRPO_SERVER_URL)

MODEL and OUTPUT_DIR choose the model and where the run goes; any GRPOConfig field can be changed below.
"""

import os

from datasets import load_dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.rewards import accuracy_reward

vllm = os.environ.get("VLLM")  # None, "colocate" or "server"
args = GRPOConfig(
    output_dir=os.environ.get("OUTPUT_DIR", "runs/deepmath"),
    per_device_train_batch_size=8,
    num_generations=8,
    max_completion_length=256,
    learning_rate=1e-6,
    logging_steps=1,
    save_steps=100,
    use_vllm=vllm is not None,
    vllm_mode=vllm or "colocate",
    vllm_server_base_url=os.environ.get("GRPO_SERVER_URL", "http://127.0.0.1:8000"),
)
peft_config = None
if os.environ.get("LORA") == "1":
    from peft import LoraConfig

    peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    args.learning_rate = 1e-5  # LoRA usually wants a larger learning rate than full fine-tuning

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")
trainer = GRPOTrainer(
    model=os.environ.get("MODEL", "Qwen/Qwen2.5-0.5B-Instruct"),
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
    args=args,
    peft_config=peft_config,
)
trainer.train()
trainer.save_model()
