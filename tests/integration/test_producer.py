"""The producer/learner seam (`grpo.rounds.producer`) and the checkpoints' state components
(`grpo.checkpoint.components`): the engine gets the policy's weights exactly when their version changed (once per
generation, not per step; again after a resume), a produced round is this process's rows with the version that sampled
it and what the reward functions logged (kept out of the learner's metrics until it takes the round), and a component
added to `state_components` is saved with every checkpoint and restored on resume."""

from __future__ import annotations

import json
import os

from grpo import GRPOTrainer
from support.rewards import length_reward
from support.runs import cfg, chat_dataset


def counting_syncs(trainer):
    calls = []
    engine = trainer.engine
    original = engine.sync_weights
    engine.sync_weights = lambda model: calls.append(trainer.policy_version) or original(model)
    return calls


def test_weights_are_pushed_once_per_version_not_once_per_step(tiny_model_dir, tmp_path):
    # steps_per_generation=2: generations before steps 1, 3 and 5; each after a new version, pushed once
    args = cfg(tmp_path, max_steps=5, per_device_train_batch_size=4, steps_per_generation=2)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    calls = counting_syncs(trainer)
    trainer.train()
    assert calls == [0, 2, 4] and trainer.policy_version == 5
    assert trainer.parts.producer.version == 4  # the weights of the last generation, not of the last step
    trainer.evaluate(chat_dataset(2))  # the policy's current weights: version 5 is pushed now, once
    trainer.evaluate(chat_dataset(2))
    assert calls == [0, 2, 4, 5]


def test_a_produced_round_is_this_processs_rows_scored_with_its_version_and_logs(tiny_model_dir, tmp_path):
    def logging_reward(completions, log_metric, **kwargs):
        log_metric("my_metric", 3.0)
        return length_reward(completions)

    args = cfg(tmp_path)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=logging_reward, train_dataset=chat_dataset(), args=args)
    trainer.parts.producer.sync(trainer.unwrapped_model, 7)
    produced = trainer.parts.producer.produce(0)
    assert produced.scored.rows == trainer.parts.producer.rows(0) and produced.version == 7
    assert len(produced.scored.rollout.completion_ids) == len(produced.scored.rows) == produced.scored.rewards.shape[0]
    assert produced.logged == (("my_metric", 3.0),)
    assert produced.generation_s > 0 and produced.scoring_s > 0
    assert trainer.metrics is None  # no learner's window yet: what was logged travels with the round
    calls = counting_syncs(trainer)
    trainer.parts.producer.sync(trainer.unwrapped_model, 7)  # the same version: nothing pushed
    trainer.parts.producer.sync(trainer.unwrapped_model, 8)
    assert calls == [0]  # pushed once, for version 8 (the trainer's own counter is still 0: the test numbers)


class Counter:
    """A state component of the test's own: a number saved as JSON in each checkpoint."""

    name = "counter"

    def __init__(self):
        self.value, self.restored = 0, None

    def save(self, directory):
        with open(os.path.join(directory, "counter.json"), "w") as f:
            json.dump(self.value, f)

    def read(self, checkpoint, state):
        with open(os.path.join(checkpoint, "counter.json")) as f:
            return json.load(f)

    def restore(self, value):
        self.restored = value


def test_a_state_component_is_saved_in_each_checkpoint_and_restored_on_resume(tiny_model_dir, tmp_path):
    args = cfg(tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    counter = Counter()
    trainer.state_components.insert(0, counter)
    counter.value = 41
    trainer.train()
    out = tmp_path / "out"
    assert json.loads((out / "checkpoint-2" / "counter.json").read_text()) == 41
    resumed = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    again = Counter()
    resumed.state_components.insert(0, again)
    syncs = counting_syncs(resumed)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    assert again.restored == 41 and resumed.state.global_step == 2
    assert syncs == [1]  # the loaded weights are a new version: pushed before the resumed run's generation
