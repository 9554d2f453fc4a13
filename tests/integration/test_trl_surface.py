"""TRL's public surface that its own GRPO test file reads (scripts/trl_suite.py found each missing): the HF Trainer's
end-of-training record in log_history, eval_loss, and the trainer attributes TRL users read."""

from __future__ import annotations

import pytest
import torch

from support.rewards import length_reward
from support.runs import cfg, chat_dataset
from support.scripted import ScriptedEngine


def trainer_for(model_dir, tmp_path, reward=length_reward, **kw):
    from grpo import GRPOTrainer

    eval_dataset = kw.pop("eval_dataset", None)
    return GRPOTrainer(
        model=model_dir,
        reward_funcs=reward,
        train_dataset=chat_dataset(),
        eval_dataset=eval_dataset,
        args=cfg(tmp_path, **kw),
    )


def test_train_ends_log_history_with_the_hf_trainers_summary_record(tiny_model_dir, tmp_path):
    seen = []

    from transformers import TrainerCallback

    class Watch(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            seen.append(dict(logs))

    trainer = trainer_for(tiny_model_dir, tmp_path, max_steps=3)
    trainer.add_callback(Watch())
    output = trainer.train()
    rows = trainer.state.log_history
    last = rows[-1]
    losses = [row["loss"] for row in rows]
    assert len(rows) == 3  # the record completes the last step's row (grpo always logs the last step)
    assert last["train_loss"] == pytest.approx(sum(losses) / 3)
    assert last["step"] == 3 and last["epoch"] == trainer.state.epoch and "reward" in last
    for key in ("train_runtime", "train_samples_per_second", "train_steps_per_second"):
        assert last[key] > 0
    # 6 x non-embedding parameters x positions trained (prompt + completion, padding included), as the HF Trainer
    assert last["total_flos"] > 0 and last["total_flos"] == trainer.state.total_flos
    assert last["total_flos"] % (6 * trainer.unwrapped_model.num_parameters(exclude_embeddings=True)) == 0
    # callbacks' on_log gets the record by itself, as from the HF Trainer
    assert seen[-1] == {k: last[k] for k in seen[-1]} and "loss" not in seen[-1] and "train_loss" in seen[-1]
    assert output.metrics["train_loss"] == last["train_loss"] and output.training_loss == last["train_loss"]
    assert output.metrics["loss"] == last["loss"]  # train()'s output: the last row's metrics and the record
    metrics_file = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics_file) == 3 and "train_loss" not in metrics_file[-1]  # the per-step rows only


def test_a_run_ending_on_an_evaluation_gets_a_record_row_of_its_own(tiny_model_dir, tmp_path):
    trainer = trainer_for(
        tiny_model_dir, tmp_path, max_steps=2, eval_dataset=chat_dataset(2), eval_strategy="steps", eval_steps=2
    )
    trainer.train()
    *_, training, evaluated, record = trainer.state.log_history
    assert "loss" in training and "eval_reward" in evaluated and record["step"] == 2
    assert record["train_loss"] == pytest.approx((trainer.state.log_history[0]["loss"] + training["loss"]) / 2)
    assert record["reward"] == training["reward"] and "loss" not in record


def test_total_flos_is_saved_and_resumed(tiny_model_dir, tmp_path):
    straight = trainer_for(tiny_model_dir, tmp_path / "a", max_steps=2, save_strategy="steps", save_steps=1)
    straight.train()
    resumed = trainer_for(tiny_model_dir, tmp_path / "b", max_steps=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-1"))
    assert resumed.state.total_flos == straight.state.total_flos > 0


def test_crafted_total_flos_in_a_checkpoint_is_refused(tiny_model_dir, tmp_path):
    import json

    from grpo.checkpoint.files import CheckpointError

    trainer = trainer_for(tiny_model_dir, tmp_path / "a", max_steps=1, save_strategy="steps", save_steps=1)
    trainer.train()
    path = tmp_path / "a" / "out" / "checkpoint-1"
    state = json.loads((path / "trainer_state.json").read_text())
    state["total_flos"] = "1e400"
    (path / "trainer_state.json").write_text(json.dumps(state))
    again = trainer_for(tiny_model_dir, tmp_path / "b", max_steps=1)
    with pytest.raises(CheckpointError, match="total_flos"):
        again.train(resume_from_checkpoint=str(path))


def test_aux_loss_enabled_and_entropy_coef(tiny_model_dir, tmp_path):
    from support.tiny import save_tiny_moe

    plain = trainer_for(tiny_model_dir, tmp_path / "plain")
    assert plain.aux_loss_enabled is False and plain.entropy_coef == 0.0
    moe = trainer_for(save_tiny_moe(tmp_path / "moe"), tmp_path / "m", max_steps=1)
    moe.train()
    assert moe.aux_loss_enabled is True
    assert moe.state.log_history[-1]["aux_loss"] is not None
    adaptive = trainer_for(
        tiny_model_dir,
        tmp_path / "adaptive",
        max_steps=2,
        entropy_coef=0.01,
        use_adaptive_entropy=True,
        entropy_target=100.0,  # above any entropy: the coefficient rises at every step
        entropy_coef_delta=0.005,
    )
    assert adaptive.entropy_coef == 0.01
    adaptive.train()
    assert adaptive.entropy_coef == pytest.approx(0.02)


def test_eval_loss_is_the_on_policy_loss_of_the_eval_batches(tiny_model_dir, tmp_path):
    """dapo on-policy: loss = -sum_i A_i L_i / sum_i L_i (ratio 1: each token contributes -A of its completion),
    with A the group-normalized rewards; averaged over eval batches. Named eval_<name>_loss for a dict of them."""
    evals = chat_dataset(4)
    trainer = trainer_for(tiny_model_dir, tmp_path, eval_dataset=evals, loss_type="dapo", per_device_eval_batch_size=8)
    trainer.engine = ScriptedEngine(trainer.processing_class)
    metrics = trainer.evaluate()
    expected = []
    for first in (0, 2):  # two batches of 2 prompts x 4 completions
        lengths, advantages = [], []
        for i in (first, first + 1):
            ids = trainer.parts.evaluations[None].source[i].ids
            letters = torch.tensor([1 + (sum(ids) + 3 * j) % 8 for j in range(4)], dtype=torch.float64)
            rewards = letters / 8.0
            advantages.append((rewards - rewards.mean()) / (rewards.std() + 1e-4))
            lengths.append(letters + (letters < 8))  # the end-of-turn token unless truncated
        a, n = torch.cat(advantages), torch.cat(lengths)
        expected.append(float(-(a * n).sum() / n.sum()))
    assert metrics["eval_loss"] == pytest.approx(sum(expected) / 2, rel=1e-4)
    named = trainer.evaluate(eval_dataset={"one": evals, "two": chat_dataset(2)})
    assert named["eval_one_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-6)
    assert named["eval_two_loss"] is not None


def test_trls_static_helpers_on_the_trainer(tiny_model_dir, tmp_path):
    from grpo import GRPOTrainer

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    logps = torch.tensor([[-2.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    keep = GRPOTrainer.get_off_policy_mask(torch.tensor([[-1.0], [-1.0]]), logps, torch.zeros(2, 3), mask, 1.0)
    assert keep.tolist() == [[0.0], [1.0]]  # drift 2 (padding ignored) > 1 with a negative advantage: dropped
    trainer = trainer_for(tiny_model_dir, tmp_path)
    entropies = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
    pad = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    top = trainer.get_high_entropy_mask(entropies, pad, 0.8)  # the top 20% of the 10 non-pad tokens
    assert top.tolist() == [[False] * 6, [False, False, True, True, False, False]]
    assert trainer.get_high_entropy_mask(entropies, pad, 0.0).tolist() == pad.bool().tolist()


def test_the_reward_and_data_sources_trl_requires(tiny_model_dir, tmp_path):
    from grpo import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "out"), report_to="none")
    with pytest.raises(ValueError, match="No reward source provided"):
        GRPOTrainer(model=tiny_model_dir, args=args, train_dataset=chat_dataset())
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=args)

    class Env:
        def reset(self, **kwargs):
            return "Guess."

    with pytest.raises(ValueError, match="set max_steps"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=args, environment_factory=Env)
    stepped = GRPOConfig(output_dir=str(tmp_path / "out"), report_to="none", max_steps=1)
    with pytest.raises(ValueError, match="requires a `train_dataset`"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=stepped, environment_factory={"a": Env})


def test_accelerator_config_and_streaming_datasets(tiny_model_dir, tmp_path, caplog):
    from datasets import IterableDataset
    from transformers.trainer_pt_utils import AcceleratorConfig

    from grpo import GRPOConfig, GRPOTrainer

    assert GRPOConfig(output_dir=str(tmp_path)).accelerator_config == AcceleratorConfig()
    with pytest.warns(UserWarning, match="accelerator_config=.*no effect"):
        args = GRPOConfig(output_dir=str(tmp_path), accelerator_config={"dispatch_batches": True})
    assert args.accelerator_config.dispatch_batches is True
    assert GRPOConfig(output_dir=str(tmp_path), accelerator_config='{"split_batches": true}').accelerator_config == (
        AcceleratorConfig(split_batches=True)
    )
    with pytest.raises(ValueError, match="unknown option.*dispatch"):
        GRPOConfig(output_dir=str(tmp_path), accelerator_config={"dispatch": True})

    rows = list(chat_dataset())
    stream = IterableDataset.from_generator(lambda: iter(rows))
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=stream)
    with pytest.warns(UserWarning, match="dataloader_num_workers"):
        workers = cfg(tmp_path, max_steps=1, dataloader_num_workers=4)
    with caplog.at_level("WARNING", logger="grpo"):
        trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=workers, train_dataset=stream)
    assert "overriding the provided value (4)" in caplog.text
    assert trainer.args.dataloader_num_workers == 0 and trainer.args.accelerator_config.dispatch_batches is False
    mapped = cfg(tmp_path, dataloader_num_workers=4)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=mapped, train_dataset=chat_dataset())
    assert trainer.args.dataloader_num_workers == 4  # a map-style train dataset keeps the value


def test_trl_warnings_are_logged_where_trl_logs_them(tiny_model_dir, tmp_path, caplog):
    from grpo import GRPOTrainer

    with pytest.warns(UserWarning, match="use_liger_kernel=True.*no effect"):
        cfg(tmp_path, use_liger_kernel=True)  # deprecated in TRL 1.16, which warns too
    for loss_type, warned in (("grpo", False), ("dapo", True)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="grpo"):
            trainer_for(tiny_model_dir, tmp_path, loss_type=loss_type, importance_sampling_level="sequence")
        assert ("weights each sequence by its completion length" in caplog.text) is warned

    def never(completions, **kwargs):
        return [None] * len(completions)

    caplog.clear()
    with caplog.at_level("WARNING", logger="grpo"):
        GRPOTrainer(
            model=tiny_model_dir, reward_funcs=never, train_dataset=chat_dataset(), args=cfg(tmp_path, max_steps=1)
        ).train()
    assert "All reward functions returned None for the following kwargs:" in caplog.text


def test_a_model_with_custom_code_needs_trust_remote_code(tiny_model_dir, tmp_path):
    import json
    import shutil

    from grpo.models.modeling import ModelLoadError

    remote = tmp_path / "remote"
    shutil.copytree(tiny_model_dir, remote)
    (remote / "configuration_remote.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass RemoteConfig(LlamaConfig):\n    model_type = 'remote'\n"
    )
    (remote / "modeling_remote.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_remote import RemoteConfig\n\n\n"
        "class RemoteForCausalLM(LlamaForCausalLM):\n    config_class = RemoteConfig\n"
    )
    config = json.loads((remote / "config.json").read_text())
    config.update(
        model_type="remote",
        architectures=["RemoteForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_remote.RemoteConfig",
            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
        },
    )
    (remote / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="custom code.*trust_remote_code=True") as refused:
        trainer_for(str(remote), tmp_path)
    assert isinstance(refused.value, ModelLoadError)
    trainer = trainer_for(str(remote), tmp_path, trust_remote_code=True)
    assert type(trainer.unwrapped_model).__name__ == "RemoteForCausalLM"


def test_logs_holds_the_latest_generation_batch_as_trl_does(tiny_model_dir, tmp_path):
    def tagged(completions, log_extra=None, **kwargs):
        log_extra("first_letter", [c[0]["content"][:1] for c in completions])
        return [len(c[0]["content"]) / 8.0 for c in completions]

    trainer = trainer_for(tiny_model_dir, tmp_path, reward=tagged, max_steps=1)
    assert trainer._logs["prompt"] == [] and trainer._logs["rewards"] == {}
    trainer.engine = ScriptedEngine(trainer.processing_class)
    trainer.train()
    logs = trainer._logs
    n = trainer.args.generation_batch_size
    assert len(logs["prompt"]) == len(logs["completion"]) == len(logs["advantages"]) == n
    assert all(isinstance(p, list) and p[0]["role"] == "user" for p in logs["prompt"])  # as the dataset gives them
    rewards = logs["rewards"]["tagged"]
    assert rewards == [len(c[0]["content"]) / 8.0 for c in logs["completion"]]
    assert logs["extra"]["first_letter"] == [c[0]["content"][:1] for c in logs["completion"]]
    groups = torch.tensor(logs["advantages"]).view(-1, trainer.args.num_generations)
    assert torch.allclose(groups.sum(dim=1), torch.zeros(len(groups)), atol=1e-4)  # group-relative
    assert logs["images"] == []


def test_a_hybrid_mamba_model_generates_and_trains(tmp_path):
    """NemotronH (Mamba + attention layers) keeps recurrent state the fast engine's shared-prefix KV cache cannot
    hold (it crashed in prefill): it generates with the plain engine, whose log-probs the training pass matches."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from grpo import GRPOTrainer
    from support.tiny import NEMOTRON_H, make_tokenizer

    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    config = NemotronHConfig(
        vocab_size=len(tokenizer),
        **NEMOTRON_H,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    NemotronHForCausalLM(config).save_pretrained(tmp_path / "hybrid")
    tokenizer.save_pretrained(tmp_path / "hybrid")
    trainer = GRPOTrainer(
        model=str(tmp_path / "hybrid"),
        reward_funcs=length_reward,
        args=cfg(tmp_path, max_steps=2),
        train_dataset=chat_dataset(),
    )
    assert trainer.engine.name != "fast"
    before = {n: p.detach().clone() for n, p in trainer.unwrapped_model.named_parameters()}
    trainer.train()
    row = next(r for r in reversed(trainer.state.log_history) if "loss" in r)
    assert row["sampling/sampling_logp_difference/max"] < 1e-4
    changed = [n for n, p in trainer.unwrapped_model.named_parameters() if not torch.equal(p, before[n])]
    assert any("mixer.in_proj" in n for n in changed) and any("self_attn" in n or "mixer.q_proj" in n for n in changed)


def test_reward_processing_classes_one_per_function(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from grpo import GRPOTrainer
    from support.tiny import make_tokenizer

    reward_model = str(tmp_path / "rm")
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_labels=1, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    LlamaForSequenceClassification(config).save_pretrained(reward_model)
    tok.save_pretrained(reward_model)
    given = AutoTokenizer.from_pretrained(reward_model)

    def build(funcs, classes):
        return GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=funcs,
            reward_processing_classes=classes,
            train_dataset=chat_dataset(),
            args=cfg(tmp_path),
        )

    with pytest.raises(ValueError, match=r"reward processing classes \(1\) must match .* reward functions \(2\)"):
        build([reward_model, length_reward], given)  # one object is a list of one, as in TRL
    trainer = build([reward_model, length_reward], [given, None])
    assert trainer.reward_processing_classes[0] is given and trainer.reward_processing_classes[1] is None
    assert trainer.reward_func_names == ["rm", "length_reward"]  # the reward model's directory name, as TRL
    single = build(reward_model, given)
    assert single.reward_processing_classes == [given]
    own = build(reward_model, None)  # the reward model's own tokenizer, loaded with it
    assert type(own.reward_processing_classes[0]).__name__ == type(given).__name__


def test_accelerates_autocast_wrapper_is_dropped_without_the_models_own_decorators(tiny_model_dir, tmp_path):
    """With mixed precision, accelerate wraps forward in autocast; grpo puts back the forward the model had (its
    class's, transformers' decorators included: peeling every `__wrapped__` layer broke Gemma3's generate)."""
    trainer = trainer_for(tiny_model_dir, tmp_path, bf16=True, max_steps=1)
    model = trainer.unwrapped_model
    assert "forward" not in vars(model) and "_original_forward" not in vars(model)
    out = model(input_ids=torch.tensor([[5, 6, 7]]), return_dict=True)  # a decorated forward takes return_dict
    assert out.logits.dtype == torch.float32  # outside accelerator.autocast(): float32, as before
    trainer.train()


def test_a_generate_replaced_on_the_model_is_what_samples(tiny_model_dir, tmp_path):
    """TRL's tests (and wrappers) replace model.generate on the instance, and it may return token ids only: grpo's
    engines then sample through it, and its tokens, which nothing scored, get no sampling correction."""
    from unittest.mock import patch

    trainer = trainer_for(tiny_model_dir, tmp_path, max_steps=1)
    assert trainer.engine.name == "fast"
    tok = trainer.processing_class
    answer = tok("abc", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    calls = []

    def scripted(input_ids, **kwargs):
        calls.append(input_ids.shape)
        return torch.cat([input_ids, torch.tensor([answer] * input_ids.shape[0])], dim=-1)

    model = trainer.unwrapped_model
    with patch.object(model, "generate", side_effect=scripted):
        trainer.train()
    assert calls and all(shape[0] == trainer.args.generation_batch_size for shape in calls)
    assert all(c[0]["content"] == "abc" for c in trainer._logs["completion"])
    row = trainer.state.log_history[-1]
    assert row["completions/mean_length"] == len(answer)
    assert row.get("sampling/sampling_logp_difference/max") is None  # unscored tokens: nothing to compare
    # transformers' own generate patched at the class, as TRL's tests do (for the whole test, construction too)
    calls.clear()
    with patch("transformers.generation.utils.GenerationMixin.generate", side_effect=scripted):
        patched = trainer_for(tiny_model_dir, tmp_path / "class", max_steps=1)
        patched.train()
    assert calls and all(c[0]["content"] == "abc" for c in patched._logs["completion"])
    assert trainer_for(tiny_model_dir, tmp_path / "again").engine.generate is not None  # unpatched: fast again
    from grpo.rollout.fast import generate_replaced

    assert not generate_replaced(trainer.unwrapped_model)


def test_reward_weights_and_the_latest_environments(tiny_model_dir, tmp_path):
    from grpo import GRPOTrainer

    class Counter:
        def reset(self, **kwargs):
            self.count = 0
            return None

        def get_reward(self):
            return float(self.count)

    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        environment_factory=Counter,
        args=cfg(tmp_path, max_steps=1, reward_weights=[0.5]),
    )
    assert trainer.reward_weights.tolist() == [0.5, 1.0] and trainer.reward_func_names == ["length_reward", "Counter"]
    assert len(trainer.environments) == 0
    trainer.train()
    n = trainer.args.generation_batch_size
    assert len(trainer.environments) == n and all(isinstance(trainer.environments[i], Counter) for i in range(n))


def test_log_metric_refuses_the_trainers_own_names(tiny_model_dir, tmp_path):
    from grpo.rewards.calling import RewardFunctionError

    def sneaky(completions, log_metric=None, **kwargs):
        log_metric("reward", -5.0)  # would overwrite what best-checkpoint selection and early stopping read
        return [0.0] * len(completions)

    trainer = trainer_for(tiny_model_dir, tmp_path, reward=sneaky, max_steps=1)
    with pytest.raises(RewardFunctionError, match=r"log_metric\('reward'.*trainer logs 'reward' itself.*custom/reward"):
        trainer.train()

    def fine(completions, log_metric=None, **kwargs):
        log_metric("custom/reward", -5.0)
        return [0.0] * len(completions)

    trainer = trainer_for(tiny_model_dir, tmp_path / "ok", reward=fine, max_steps=1)
    trainer.train()
    assert trainer.state.log_history[-1]["custom/reward"] == -5.0 and trainer.state.log_history[-1]["reward"] == 0.0


def test_reward_funcs_and_tools_as_trl_lists_them(tiny_model_dir, tmp_path):
    from grpo import GRPOTrainer
    from grpo.agent import CHATML_TOOLS
    from support.tiny import make_model, make_tokenizer

    class Scored:
        def reset(self, **kwargs):
            return None

        def add(self, a: int, b: int) -> int:
            """Adds.

            Args:
                a: x
                b: y
            """
            return a + b

        def get_reward(self):
            return 1.0

    def multiply(a: int, b: int) -> int:
        """Multiplies.

        Args:
            a: x
            b: y
        """
        return a * b

    tok = make_tokenizer()
    tok.chat_template = CHATML_TOOLS
    trainer = GRPOTrainer(
        model=make_model(tok),
        processing_class=tok,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        tools=[multiply],
        environment_factory=Scored,
        args=cfg(tmp_path),
    )
    assert [t.__name__ for t in trainer.tools] == ["multiply", "add"]  # never reset or get_reward
    assert trainer.reward_funcs[0] is length_reward
    assert trainer.reward_funcs[-1](environments=[Scored(), object()]) == [1.0, None]  # other rollouts: None


def test_a_relative_output_dir_stays_put_when_a_reward_changes_directory(tiny_model_dir, tmp_path, monkeypatch):
    import os

    from grpo import GRPOConfig, GRPOTrainer

    monkeypatch.chdir(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def wanders(completions, **kwargs):
        os.chdir(elsewhere)
        return [float(len(c[0]["content"])) for c in completions]

    base = {k: v for k, v in cfg(tmp_path).to_dict().items() if k in ("per_device_train_batch_size", "num_generations")}
    args = GRPOConfig(output_dir="run", max_steps=1, save_strategy="steps", save_steps=1, report_to="none", **base)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=wanders, train_dataset=chat_dataset(), args=args)
    trainer.train()
    assert (tmp_path / "run" / "checkpoint-1").is_dir() and not (elsewhere / "run").exists()
