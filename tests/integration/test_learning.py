"""GRPO learns: a tiny random model raises its mean reward on a toy task by a clear margin, in seconds."""

from __future__ import annotations

from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer


def digit_reward(completions, **kwargs):
    """Fraction of the completion's characters that are the digit 7 (a random model: about 1%)."""
    texts = [c[0]["content"] for c in completions]
    return [t.count("7") / max(len(t), 1) for t in texts]


def test_mean_reward_rises(tiny_model_dir, tmp_path):
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Say sevens {i}"}]} for i in range(16)])
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=32,
        num_generations=8,
        max_completion_length=8,
        max_steps=40,
        learning_rate=2e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        disable_tqdm=True,
        save_strategy="no",
        gradient_checkpointing=False,
        seed=0,
        temperature=1.0,
    )
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=digit_reward, train_dataset=dataset, args=args)
    trainer.train()
    rewards = [row["reward"] for row in trainer.state.log_history]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert first < 0.1
    assert last > first + 0.4
