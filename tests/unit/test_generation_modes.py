"""The plain engine under `generate` options that change how many rows a decoding step holds (beams) or how many
rows generate returns: beam search samples one completion per row with NaN sampler log-probs (its tokens are not
draws from a per-token distribution); an option it cannot run is refused when the engine is built, naming it."""

from __future__ import annotations

import pytest
import torch

from grpo import GRPOConfig
from grpo.algo.sampling import SamplingSettings
from grpo.base.records import Request
from grpo.data.prompts import end_of_turn_ids, make_prompt
from grpo.rollout.plain import TransformersEngine, _SampledLogps
from support.tiny import make_model, make_tokenizer

# TRL's own test_train_with_generation_kwargs
TRL_KWARGS = {"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1}


def build(generation_kwargs=None, model=None, **kw):
    tok = make_tokenizer()
    model = model or make_model(tok).eval()
    args = GRPOConfig(
        output_dir="x",
        max_completion_length=6,
        per_device_train_batch_size=3,
        num_generations=3,
        generation_kwargs=generation_kwargs,
        **kw,
    )
    stop = end_of_turn_ids(tok, model.generation_config.eos_token_id)
    return tok, model, TransformersEngine(model, tok, SamplingSettings.of(args), stop)


def requests(tok):
    """Two prompts of different lengths (left padding), three samples each, the second with a smaller budget."""
    return [
        Request(make_prompt([{"role": "user", "content": "hello there"}], tok), num_samples=3),
        Request(make_prompt("Say", tok), num_samples=3, max_tokens=4),
    ]


@pytest.mark.parametrize(
    "kwargs",
    [TRL_KWARGS, {"do_sample": False, "num_beams": 3}, {"num_beams": 2, "early_stopping": True}],
    ids=["beam-sample", "beam-search", "early-stopping"],
)
def test_beam_search_gives_one_completion_per_row_without_sampler_logps(kwargs):
    tok, model, engine = build(kwargs)
    torch.manual_seed(0)
    rollout = engine.generate(requests(tok))
    assert len(rollout) == 6
    assert rollout.prompt_ids == [rollout.prompt_ids[0]] * 3 + [list(make_prompt("Say", tok).ids)] * 3
    lengths = [len(c) for c in rollout.completion_ids]
    assert all(1 <= n <= 6 for n in lengths[:3]) and all(1 <= n <= 4 for n in lengths[3:])
    assert [len(lp) for lp in rollout.sampling_logps] == lengths
    # beam search picks tokens by beam score, not by drawing from the policy: no sampler log-prob is recorded
    assert all(lp != lp for row in rollout.sampling_logps for lp in row)
    assert rollout.texts == tok.batch_decode(rollout.completion_ids, skip_special_tokens=True)


def test_beam_search_keeps_no_per_step_scores():
    """Beam search's scores are (rows x beams, vocabulary) per step: not asked for (they are not read)."""
    _, _, engine = build(TRL_KWARGS)
    assert engine.config.output_scores is False


def test_beams_from_the_models_own_generation_config_are_seen():
    """The model's generation_config fills what GRPOConfig leaves unset (transformers' merge): num_beams there
    makes generate search beams, and the engine reads no per-step log-probs then."""
    tok = make_tokenizer()
    model = make_model(tok).eval()
    model.generation_config.num_beams = 2
    tok, model, engine = build(None, model=model)
    rollout = engine.generate(requests(tok))
    assert len(rollout) == 6 and all(lp != lp for row in rollout.sampling_logps for lp in row)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"num_return_sequences": 2}, r"num_return_sequences=2.*num_generations"),
        ({"num_beams": 2, "num_return_sequences": 2}, r"num_return_sequences=2.*num_generations"),
        ({"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0}, r"'num_beam_groups'.*group beam search"),
        ({"num_beams": 2, "force_words_ids": [[7]]}, r"'force_words_ids'.*constrained beam search"),
        ({"do_sample": False, "penalty_alpha": 0.6, "top_k": 4}, r"'penalty_alpha'.*contrastive search"),
        ({"dola_layers": "low"}, r"'dola_layers'.*dola"),
        ({"prompt_lookup_num_tokens": 3}, r"'prompt_lookup_num_tokens'.*assisted"),
        ({"assistant_early_exit": 1}, r"'assistant_early_exit'.*assisted"),
        ({"assistant_model": "some/model"}, r"'assistant_model'.*assisted"),
    ],
)
def test_options_the_engine_cannot_run_are_refused_by_name(kwargs, pattern):
    with pytest.raises(ValueError, match=r"generation_kwargs.*" + pattern):
        build(kwargs)


def test_beam_search_with_the_samplers_logps_as_behaviour_is_refused():
    """async_behaviour_logps='sampler' would train against log-probs beam search does not have."""
    with pytest.raises(ValueError, match=r"num_beams=2.*async_behaviour_logps='sampler'.*'training'"):
        build(TRL_KWARGS, async_generation=True, async_behaviour_logps="sampler")
    build(TRL_KWARGS, async_generation=True, async_behaviour_logps="training")  # the training pass's: fine


def test_a_step_whose_rows_do_not_match_its_scores_records_nothing():
    """A decoding loop that hands its stopping criteria more rows than scores (beam search: the candidate beams
    against the kept beams' scores) gives NaN log-probs, never a misread; returned scores of another row count
    are not read either."""
    sampled = _SampledLogps()
    ids = torch.tensor([[1, 2]] * 4)
    scores = (torch.randn(2, 5),)
    sampled(ids, scores)
    assert sampled.steps == [] and sampled.logps(torch.tensor([[2], [3]]), None).isnan().all()
    tokens = torch.tensor([[1], [2], [3]])
    assert _SampledLogps().logps(tokens, (torch.randn(6, 5),)).isnan().all()
