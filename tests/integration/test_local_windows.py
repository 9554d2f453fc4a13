"""Windows a model applies over the columns of its input: GPT-Neo's local layers attend a band of `window_size`
columns, built inside the model (not from the mask grpo hands it). A tree's columns are not positions: a token sits
a whole sibling branch away from its prompt. Trees laid out past such a window trained other numbers than the
padded rows (0.22 off the sampler's log-probs in a review's run, 0.015 in the runs below, under packing="tree" and
the CPU's default "auto"), and the probe's
few-token trees fit inside the window, so it saw nothing. Now no tree is wider than a window the config names, of any
spelling (`grpo.learner.model_windows.window_cap`), and a piece with a row longer than it keeps padded rows."""

from __future__ import annotations

import pytest
import torch
import transformers

from grpo import GRPOTrainer
from grpo.base.records import Rollout
from grpo.learner import tree
from grpo.learner import windows as model_windows
from grpo.learner.batch import collate
from grpo.learner.forward import token_logps
from grpo.learner.layouts import PassSettings
from support.rewards import length_reward
from support.runs import cfg, chat_dataset
from support.tiny import make_tokenizer


def gpt_neo(window: int, seed: int = 0) -> transformers.GPTNeoForCausalLM:
    """A tiny GPT-Neo: a global layer, then a local one attending `window` columns."""
    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    config = transformers.GPTNeoConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=window,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return transformers.GPTNeoForCausalLM(config)


def one_group(prompt: int, lengths: list[int], seed: int = 0):
    """One prompt of `prompt` random tokens with completions of `lengths` random tokens."""
    vocab = len(make_tokenizer())
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(10, vocab, (prompt,), generator=g).tolist()
    completions = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]
    rollout = Rollout(
        prompt_ids=[prompt_ids] * len(lengths),
        completion_ids=completions,
        sampling_logps=[[0.0] * n for n in lengths],
        truncated=[False] * len(lengths),
    )
    group = torch.zeros(len(lengths), dtype=torch.long)
    return collate(rollout, torch.zeros(len(lengths)), 0, mask_truncated=False, group=group)


def test_trees_stay_within_a_window_the_model_applies_over_columns():
    """Rows of 6 + up to 12 tokens fit GPT-Neo's 24-column window, the group's tree (6 + 8 completions) does not:
    trees wider than the window were 5.3e-3 off the padded rows here; now each tree is at most 24 columns wide, and
    the trees give the padded numbers."""
    model = gpt_neo(24)
    batch = one_group(6, [12, 5, 9, 12, 4, 11, 7, 12])
    assert model_windows.window_cap(model) == 24 and tree.fits_window(model, batch)
    with torch.no_grad():
        padded = token_logps(model, batch, PassSettings(1.0, with_entropy=False)).logps
        scored = token_logps(model, batch, PassSettings(1.0, with_entropy=False, layouts=("trees",)))
    trees = scored.logps
    assert scored.layouts == ("trees",)
    laid = tree.layout(batch, max_width=model_windows.window_cap(model))
    assert laid.input_ids.shape[1] <= 24
    m = batch.mask.bool()
    torch.testing.assert_close(trees[m], padded[m], rtol=1e-5, atol=1e-6)


def test_without_local_layers_the_window_bounds_nothing():
    model = gpt_neo(24)
    model.config.attention_layers = ["global", "global"]
    assert model_windows.window_cap(model) is None


def save(path, window: int) -> str:
    gpt_neo(window).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("window", [24, 48])
@pytest.mark.parametrize("packing", ["tree", None])
def test_a_local_window_model_trains_the_sampled_numbers(tmp_path, window, packing):
    """8 completions of up to 12 tokens after chat prompts of about 28 tokens: with a window of 24 no row fits (the
    padded rows train), with 48 each row does but no group's tree (trees of at most 48 columns train). Either way,
    under packing="tree" (a warning names the window) and the CPU's default (packing=None: "auto"), the training
    pass scores what the engine sampled; trees past the window were 0.013 (window 24) and 0.015 (48) off here."""
    model = save(tmp_path / "model", window)
    args = cfg(tmp_path / "run", num_generations=8, max_completion_length=12, packing=packing, logging_steps=1)

    def make():
        return GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)

    if packing == "tree":
        with pytest.warns(UserWarning, match=f"packing='tree' lays out trees of at most {window} tokens"):
            trainer = make()
    else:
        trainer = make()
    trainer.train()
    row = next(r for r in reversed(trainer.state.log_history) if "loss" in r)
    assert row["sampling/sampling_logp_difference/max"] < 1e-3
    assert trainer.training_pass.tree  # the layout is decided piece by piece
    if window == 24:  # no row fits
        assert trainer.training_pass.laid_out and "trees" not in trainer.training_pass.laid_out
    elif packing == "tree":  # rows fit, each tree within the window
        assert trainer.training_pass.laid_out["trees"] > 0


def tiny(config_class, model_class, **settings):
    vocab = len(make_tokenizer())
    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4)
    return model_class(config_class(vocab_size=vocab, **small, **settings))


class RemoteMistral(transformers.MistralForCausalLM):
    """A model whose code is not transformers' own (as trust_remote_code loads): its window may be applied anyhow."""


def test_each_window_spelling_bounds_rows_and_trees_where_it_may_act_over_columns():
    """transformers' own sliding and chunked windows (applied through the mask, which a tree's replaces) bound the
    rows only; any other spelling, or any window of a model with code of its own, bounds the trees too."""
    mistral = tiny(transformers.MistralConfig, transformers.MistralForCausalLM, sliding_window=64)
    assert model_windows.windows(mistral) == {"sliding_window": 64} and model_windows.window_cap(mistral) is None
    llama4 = tiny(
        transformers.Llama4TextConfig,
        transformers.Llama4ForCausalLM,
        head_dim=4,
        intermediate_size_mlp=32,
        num_local_experts=2,
        attention_chunk_size=32,
    )
    assert model_windows.windows(llama4) == {"attention_chunk_size": 32} and model_windows.window_cap(llama4) is None
    remote = RemoteMistral(mistral.config)
    assert model_windows.window_cap(remote) == 64 and "sliding_window=64" in model_windows.window_cap_reason(remote)
    batch, _ = _chat_batch()
    assert tree.fits_window(mistral, batch)
    for name in ("window_size", "attention_window", "local_window", "local_attention", "keep_window_size"):
        model = tiny(transformers.LlamaConfig, transformers.LlamaForCausalLM)
        setattr(model.config, name, 12)
        assert model_windows.windows(model) == {name: 12} and model_windows.window_cap(model) == 12, name
        assert not tree.fits_window(model, batch)  # rows of 20 tokens and more
    longformer = tiny(transformers.LlamaConfig, transformers.LlamaForCausalLM)
    longformer.config.attention_window = [64, 16]  # one per layer
    assert model_windows.window_cap(longformer) == 16
    neo = gpt_neo(24)
    assert model_windows.windows(neo) == {"window_size": 24} and "window_size=24" in model_windows.window_cap_reason(
        neo
    )


def _chat_batch():
    from support.layouts import batch_and_model

    return batch_and_model()


def test_a_row_with_turns_wider_than_the_cap_as_a_tree_keeps_padded_rows():
    """A row's turns merge into one trie: where a stripped reasoning branch sits between turns, the row alone is
    wider than its longest sequence; past a window applied over columns it runs as forked padded rows."""
    from support.layouts import turns_batch

    batch, *_, model = turns_batch()
    widest = max(len(tree.layout(batch.select(torch.tensor([i]))).input_ids[0]) for i in range(len(batch)))
    longest = tree.longest(batch)
    if widest == longest:
        pytest.skip("no row's turns branch here")
    model.config.window_size = longest  # every sequence fits, the widest row's tree does not
    with torch.no_grad():
        padded = token_logps(model, batch, PassSettings(1.0, with_entropy=False)).logps
        scored = token_logps(model, batch, PassSettings(1.0, with_entropy=False, layouts=("trees",)))
    trees = scored.logps
    assert scored.layouts == ("forked",)  # the rows' turns, one row per turn
    m = batch.mask.bool()
    torch.testing.assert_close(trees[m], padded[m], rtol=1e-5, atol=1e-6)
