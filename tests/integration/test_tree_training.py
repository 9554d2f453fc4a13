"""packing="tree" through the trainer: it trains like the padded layout (with gradient checkpointing, where the
padded pass neither shares prompts nor skips padding), async too; a wrong value is named; a model it cannot serve
keeps the padded layout with one warning."""

from __future__ import annotations

import pytest
import torch
import transformers

from grpo import AsyncGRPOConfig, GRPOTrainer
from grpo.learner import tree, tree_attention
from grpo.learner.forward import token_logps
from grpo.learner.layouts import PassSettings
from support.layouts import batch_and_model, turns_batch
from support.rewards import length_reward
from support.runs import BASE, cfg, chat_dataset, params
from support.tiny import NEMOTRON_H, make_tokenizer

MAX_WIDTH = tree.MAX_WIDTH


def trained(model_dir, tmp_path, **kw):
    """Two steps of SGD (an update linear in the gradient, so the layouts' float32 rounding stays that small)."""
    args = cfg(tmp_path, max_steps=2, logging_steps=1, **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2)
    trainer = GRPOTrainer(
        model=model, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args, optimizers=(sgd, None)
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_tree_run_trains_like_a_padded_one(tiny_model_dir, tmp_path, checkpointing):
    padded = trained(tiny_model_dir, tmp_path / "padded", gradient_checkpointing=checkpointing, packing="padded")
    trees = trained(tiny_model_dir, tmp_path / "tree", gradient_checkpointing=checkpointing, packing="tree")
    assert trees.training_pass.tree and not padded.training_pass.tree
    assert trees.training_pass.laid_out["trees"] > 0 and "trees" not in padded.training_pass.laid_out
    assert padded.training_pass.share_prefix is not checkpointing  # the cache sharing gradient checkpointing stops
    tree_params = params(trees.model)
    for name, value in params(padded.model).items():
        torch.testing.assert_close(tree_params[name], value, rtol=1e-4, atol=1e-6)
    for row, tree_row in zip(padded.state.log_history, trees.state.log_history):
        if "loss" in row:
            assert tree_row["loss"] == pytest.approx(row["loss"], rel=1e-4, abs=1e-6)
            assert tree_row["entropy"] == pytest.approx(row["entropy"], rel=1e-4)
            # the share of the gradient pass's pieces laid out as trees: all of them; padded rows log none
            assert tree_row["packing/trees"] == 1.0 and "packing/trees" not in row


@pytest.mark.parametrize("checkpointing", [True, False])
def test_auto_lays_out_each_piece_as_the_cheaper_and_trains_like_padded(tiny_model_dir, tmp_path, checkpointing):
    """packing="auto": each piece of the training pass as trees or padded rows, whichever the cost model puts
    lower; the run trains as the padded one does. On this workload (short completions after long chat prompts)
    the trees win where gradient checkpointing runs each row's prompt itself, and the padded rows where the prompt
    is shared through the KV cache."""
    padded = trained(tiny_model_dir, tmp_path / "padded", gradient_checkpointing=checkpointing, packing="padded")
    auto = trained(tiny_model_dir, tmp_path / "auto", gradient_checkpointing=checkpointing, packing="auto")
    laid_out = auto.training_pass.laid_out
    assert auto.training_pass.tree and auto.training_pass.by_cost and not padded.training_pass.tree
    assert set(laid_out) == ({"trees"} if checkpointing else {"shared_prefix"}), laid_out
    rows = [row for row in auto.state.log_history if "loss" in row]
    assert len(rows) == 2 and all(row["packing/trees"] == float(checkpointing) for row in rows)  # what auto took
    auto_params = params(auto.model)
    for name, value in params(padded.model).items():
        torch.testing.assert_close(auto_params[name], value, rtol=1e-4, atol=1e-6)


def test_async_trains_as_trees(tiny_model_dir, tmp_path):
    args = AsyncGRPOConfig(**{**BASE, "output_dir": str(tmp_path / "out"), "max_steps": 2, "packing": "tree"})
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    before = params(trainer.model)
    trainer.train()
    assert trainer.training_pass.tree and trainer.state.global_step == 2
    assert trainer.training_pass.laid_out["trees"] > 0
    assert any(not torch.equal(before[n], v) for n, v in params(trainer.model).items())


def test_the_default_packing_on_the_cpu_is_auto(tiny_model_dir, tmp_path):
    trainer = trained(tiny_model_dir, tmp_path)
    assert trainer.args.packing is None  # the field keeps what the user gave; the pass resolves it
    assert trainer.training_pass.packing == "auto" and trainer.training_pass.by_cost
    assert trainer.training_pass.laid_out["trees"] > 0


def test_an_unknown_packing_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"packing.*'trees'.*'padded', 'tree', 'auto' or None"):
        cfg(tmp_path, packing="trees")


def test_a_recurrent_model_keeps_the_padded_layout_with_a_warning(tmp_path):
    tokenizer = make_tokenizer()
    model = transformers.NemotronHForCausalLM(
        transformers.NemotronHConfig(
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **NEMOTRON_H,
        )
    )
    with pytest.warns(UserWarning, match="packing='tree' is not used: the model has recurrent layers"):
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            args=cfg(tmp_path, packing="tree"),
            processing_class=tokenizer,
        )
    assert not trainer.training_pass.tree


def test_flex_attention_scores_the_trees_as_the_padded_pass(monkeypatch):
    """The "flex" kernel (FlexAttention, compiled here for the CPU, where it runs forward only; the GPU check runs
    it forward and backward on CUDA) gives the padded pass's log-probs and entropies, for groups whole and cut
    into trees packed side by side, and for rendered turns against their forked rows."""
    monkeypatch.setattr(tree_attention, "FORCE_KERNEL", "flex")
    groups, model = batch_and_model()
    turns, _, _, _, turns_model = turns_batch()
    widest = int((groups.prompt_mask.sum(-1) + groups.completion_attention.sum(-1)).max())
    with torch.no_grad():
        for batch, scorer, width in ((groups, model, None), (groups, model, widest), (turns, turns_model, None)):
            monkeypatch.setattr(tree, "MAX_WIDTH", width or MAX_WIDTH)
            padded = token_logps(scorer, batch, PassSettings(0.9, layouts=("shared_prefix",)))
            flex = token_logps(scorer, batch, PassSettings(0.9, layouts=("trees",)))
            assert flex.layouts == ("trees",)
            m = batch.mask.bool()
            for got, expected in ((flex.logps, padded.logps), (flex.entropies, padded.entropies)):
                torch.testing.assert_close(got[m], expected[m], rtol=1e-5, atol=1e-6)


# models that place tokens by other means than the mask and positions a tree gives them
ELSEWISE = {
    "Mpt": lambda v: transformers.MptForCausalLM(
        transformers.MptConfig(d_model=16, n_layers=2, n_heads=4, vocab_size=v)
    ),
    "Bloom": lambda v: transformers.BloomForCausalLM(
        transformers.BloomConfig(hidden_size=16, n_layer=2, n_head=4, vocab_size=v)
    ),
    "TrOCR": lambda v: transformers.TrOCRForCausalLM(
        transformers.TrOCRConfig(
            d_model=16, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=32, vocab_size=v
        )
    ),
}


@pytest.mark.parametrize("family", list(ELSEWISE))
def test_a_model_whose_trees_are_not_its_padded_rows_trains_padded_rows(family, tmp_path):
    """MPT biases attention by each key's column (ALiBi): as trees its log-probs were 0.017 off the padded rows'
    (on ragged completions), silently, under the CPU's default packing="auto" too; TrOCR's decoder places tokens
    itself (0.24 off); BLOOM's ALiBi attention failed on a tree's mask. A probe of a few tokens before training
    (`grpo.learner.tree_probe`) finds each, and the padded rows train, with the sampling log-probs they score."""
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    model = ELSEWISE[family](len(tokenizer))
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    from grpo.learner import tree_probe
    from grpo.learner.forward import token_logps as score
    from grpo.learner.layouts import PassSettings

    first = next(model.children())
    first.eval()  # a module the run keeps in eval mode stays there
    found = tree_probe.mismatch(
        model,
        lambda b, t: score(model, b, PassSettings(with_entropy=False, layouts=("trees" if t else "padded",))).logps,
    )
    expected = "a tree pass failed here" if family == "Bloom" else "its log-probs as token trees differ"
    assert found is not None and found.startswith(expected), found
    # the probe ran in eval mode (no dropout) and gave each module its own mode back
    assert model.training and not first.training and not any(m.training for m in first.modules())
    with pytest.warns(UserWarning, match=f"packing='tree' is not used: {expected}"):
        trainer = GRPOTrainer(
            model=str(tmp_path / "model"),
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            args=cfg(tmp_path / "tree", packing="tree", logging_steps=1, disable_dropout=True),  # TrOCR drops out
        )
    assert not trainer.training_pass.tree
    trainer.train()
    row = next(r for r in reversed(trainer.state.log_history) if "loss" in r)
    assert "packing/trees" not in row and row["sampling/sampling_logp_difference/max"] < 1e-3
    auto = GRPOTrainer(
        model=str(tmp_path / "model"), reward_funcs=length_reward, train_dataset=chat_dataset(), args=cfg(tmp_path)
    )
    assert auto.training_pass.packing == "auto" and not auto.training_pass.tree  # the CPU's default: padded rows
