"""A vision-language model learns to name the color of a square in an image (docs/vision.md).

    python examples/train_images.py
    accelerate launch --config_file examples/accelerate/ddp.yaml examples/train_images.py

The dataset is built here: an `image` column of PIL images beside conversational prompts. The processor loads with
the model.
"""

import os

from datasets import Dataset
from PIL import Image

from grpo import GRPOConfig, GRPOTrainer

COLORS = ["red", "green", "blue", "yellow", "purple", "orange"]


def says_the_color(completions, answer, **kwargs):
    return [1.0 if a in c[0]["content"].lower() else 0.0 for c, a in zip(completions, answer)]


question = [{"role": "user", "content": "What color is this square? Answer with one word."}]
dataset = Dataset.from_list(
    [{"prompt": question, "image": Image.new("RGB", (64, 64), color), "answer": color} for color in COLORS * 32]
)
args = GRPOConfig(
    output_dir=os.environ.get("OUTPUT_DIR", "runs/colors"),
    max_completion_length=16,
    learning_rate=1e-6,
    logging_steps=1,
)
trainer = GRPOTrainer(
    model=os.environ.get("MODEL", "HuggingFaceTB/SmolVLM-256M-Instruct"),
    reward_funcs=says_the_color,
    train_dataset=dataset,
    args=args,
)
trainer.train()
trainer.save_model()
