"""The in-process engine: stop tokens, truncation, the sampler's log-probs, sampling parameters; the prompt
order; the training batch layout."""

from __future__ import annotations

import torch

from grpo import GRPOConfig
from grpo.algo.sampling import SamplingSettings
from grpo.base.records import Request
from grpo.data.prompts import end_of_turn_ids, generation_prompt_indices, make_prompt
from grpo.learner.batch import collate
from grpo.learner.forward import token_logps
from grpo.learner.layouts import PassSettings
from grpo.rollout.base import cut_at_stop
from grpo.rollout.plain import TransformersEngine
from support.tiny import make_model, make_tokenizer


def engine_for(model, tok, **kw):
    args = GRPOConfig(
        output_dir="x",
        max_completion_length=kw.pop("max_completion_length", 12),
        per_device_train_batch_size=4,
        num_generations=2,
        **kw,
    )
    stop = end_of_turn_ids(tok, model.generation_config.eos_token_id)
    return TransformersEngine(model, tok, SamplingSettings.of(args), stop), args


def prompts(tok, n=4):
    chats = [[{"role": "user", "content": f"hello {i}" * (i + 1)}] for i in range(n)]
    return [Request(make_prompt(chat, tok)) for chat in chats]


def test_stop_ids_include_end_of_turn_and_eos():
    tok = make_tokenizer()
    ids = end_of_turn_ids(tok)
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids and tok.eos_token_id in ids
    assert cut_at_stop([5, 6, 7, 8], {7}) == ([5, 6, 7], False)
    assert cut_at_stop([5, 6], {7}) == ([5, 6], True)


def test_completion_ends_at_end_of_turn_token():
    tok = make_tokenizer()
    model = make_model(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    calls = {"n": 0}

    def hook(module, inputs, output):
        calls["n"] += 1
        if calls["n"] >= 3:  # after two sampled tokens, end the turn
            output[..., im_end] += 1e4
        return output

    model.lm_head.register_forward_hook(hook)
    engine, _ = engine_for(model, tok)
    rollout = engine.generate(prompts(tok))
    for ids, truncated in zip(rollout.completion_ids, rollout.truncated):
        assert ids[-1] == im_end and len(ids) == 3 and not truncated


def test_truncation_and_masking_truncated_rows():
    tok = make_tokenizer()
    model = make_model(tok)
    engine, _ = engine_for(model, tok, max_completion_length=5)
    stops = list(engine.stop_ids)
    model.lm_head.register_forward_hook(lambda m, i, out: out.index_fill(-1, torch.tensor(stops), -1e4))
    rollout = engine.generate(prompts(tok))
    assert all(rollout.truncated) and all(len(c) == 5 for c in rollout.completion_ids)
    batch = collate(rollout, torch.zeros(4), tok.pad_token_id, mask_truncated=True)
    assert batch.mask.sum() == 0 and batch.completion_attention.sum() == 0
    kept = collate(rollout, torch.zeros(4), tok.pad_token_id, mask_truncated=False)
    assert kept.mask.sum() == 20


def sample_and_score(**sampling):
    """Sample with the plain engine, then score the same tokens with the training pass."""
    tok = make_tokenizer()
    model = make_model(tok).eval()
    torch.manual_seed(0)
    engine, args = engine_for(model, tok, **sampling)
    batch = collate(engine.generate(prompts(tok)), torch.zeros(4), tok.pad_token_id, mask_truncated=False)
    with torch.no_grad():
        logps = token_logps(model, batch, PassSettings(args.temperature, with_entropy=False)).logps
    return model, batch, logps


def test_sampling_logps_equal_training_logps_at_temperature():
    model, batch, logps = sample_and_score(temperature=0.7)
    m = batch.mask.bool()
    torch.testing.assert_close(logps[m], batch.sampling_logps[m], rtol=1e-5, atol=1e-5)


def test_top_k_is_honoured_and_logps_are_processed():
    model, batch, logps = sample_and_score(top_k=3)
    with torch.no_grad():
        full = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
        attn = torch.cat([batch.prompt_mask, batch.completion_attention], 1)
        logits = model(full, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
    c = batch.completion_ids.shape[1]
    top3 = logits[:, -c - 1 : -1].topk(3, dim=-1).indices
    m = batch.mask.bool()
    assert (top3 == batch.completion_ids.unsqueeze(-1)).any(-1)[m].all()  # every token from the top 3
    # renormalised over 3 tokens, the sampler's log-prob is higher than the full-softmax one
    assert (batch.sampling_logps[m] > logps[m]).all()


def test_generation_kwargs_override_builtins():
    tok = make_tokenizer()
    model = make_model(tok).eval()
    engine, _ = engine_for(model, tok, generation_kwargs={"do_sample": False})
    rollout = engine.generate([Request(make_prompt([{"role": "user", "content": "same"}], tok), num_samples=4)])
    assert all(c == rollout.completion_ids[0] for c in rollout.completion_ids)  # greedy: identical


def test_prompt_order_is_a_pure_function_of_seed_and_generation():
    n, per_gen = 10, 3
    blocks = [generation_prompt_indices(g, n, per_gen, seed=1, shuffle=True) for g in range(3)]
    assert len({i for b in blocks for i in b}) == 9  # one epoch: 3 whole blocks, distinct rows, 1 dropped
    assert blocks == [generation_prompt_indices(g, n, per_gen, seed=1, shuffle=True) for g in range(3)]
    assert generation_prompt_indices(3, n, per_gen, 1, True) != blocks[0]  # next epoch: a new permutation
    assert generation_prompt_indices(1, n, per_gen, 1, False) == [3, 4, 5]


def test_the_plain_engine_holds_one_steps_scores_at_a_time():
    """generate's scores for every step would be (rows, vocabulary) floats per token until it returns (256 rows x
    1,024 steps at a 152k vocabulary: ~159 GB): the engine reads each step's sampled log-prob and releases the step.
    Counted every 8 steps: live tensors of the vocabulary's width, over those alive before. The log-probs still
    equal the training pass's."""
    import gc

    tok = make_tokenizer()
    model = make_model(tok).eval()
    vocab = model.config.vocab_size
    engine, args = engine_for(model, tok, max_completion_length=24, temperature=0.8)
    stops = list(engine.stop_ids)
    live, steps = [], []

    def vocabulary_wide() -> int:
        return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.shape[-1:] == (vocab,))

    before = vocabulary_wide()  # whatever earlier tests in this process left alive

    def count(module, inputs, output):
        if len(steps) % 8 == 7:  # (a look at every object takes a while)
            live.append(vocabulary_wide() - before)
        steps.append(1)
        return output.index_fill(-1, torch.tensor(stops), -1e4)  # every row runs all 24 steps

    model.lm_head.register_forward_hook(count)
    torch.manual_seed(0)
    rollout = engine.generate(prompts(tok))
    assert len(steps) == 24 and all(len(c) == 24 for c in rollout.completion_ids)
    assert max(live) <= 3, live  # before: one more at every step ([10, 18, 26])
    batch = collate(rollout, torch.zeros(4), tok.pad_token_id, mask_truncated=False)
    with torch.no_grad():
        logps = token_logps(model, batch, PassSettings(args.temperature, with_entropy=False)).logps
    m = batch.mask.bool()
    torch.testing.assert_close(logps[m], batch.sampling_logps[m], rtol=1e-5, atol=1e-5)


def test_the_plain_engine_falls_back_to_returned_scores_and_to_nan():
    """A decoding loop that does not hand its stopping criteria the scores: the log-probs come from the scores
    generate returned; with none, NaN (no sampling correction) rather than a wrong value."""
    from grpo.rollout.plain import _SampledLogps

    tokens = torch.tensor([[1, 2], [0, 3]])
    scores = (torch.randn(2, 5), torch.randn(2, 5))
    expected = torch.stack(
        [torch.log_softmax(s, -1).gather(-1, tokens[:, t, None])[:, 0] for t, s in enumerate(scores)], 1
    )
    torch.testing.assert_close(_SampledLogps().logps(tokens, scores), expected)
    assert _SampledLogps().logps(tokens, None).isnan().all()
    assert _SampledLogps().logps(tokens[:, :0], None).shape == (2, 0)
