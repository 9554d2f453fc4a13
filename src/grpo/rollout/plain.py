"""`TransformersEngine`: samples in-process with `model.generate`, the plain path.

It honours every `generation_kwargs` key transformers knows. Each sampled token's log-probability is taken from
the processed scores (after temperature and every logits processor), the quantity vLLM calls "processed
logprobs".

Beam search (`num_beams` > 1, from generation_kwargs or the model's generation_config) returns one completion per
row too, but its tokens are chosen by beam score, not drawn from a per-token distribution: no sampler log-prob is
recorded (NaN: no sampling correction, the sampling/* metrics skip them; the trainer's own pass gives the old
log-probs). Options under which `generate` returns another number of rows than asked for (num_return_sequences),
runs one sequence at a time (assisted decoding) or runs code transformers moved to the Hub (group and constrained
beam search, contrastive search, DoLa) are refused when the engine is built, naming the option.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode

from grpo.algo.sampling import SamplingSettings
from grpo.base import sigterm
from grpo.base.records import Request, Rollout, expand, left_pad
from grpo.models.vision import suppressed_tokens
from grpo.rollout.base import assemble, cut_at_stop

logger = logging.getLogger("grpo")

# arguments of `generate()` itself, not of a GenerationConfig: each selects assisted decoding
GENERATE_ARGUMENTS = ("assistant_model", "assistant_tokenizer")

# decoding modes the engine cannot run: the options that select each, and why
UNSUPPORTED_MODES = {
    GenerationMode.ASSISTED_GENERATION: (
        ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp", *GENERATE_ARGUMENTS),
        "assisted decoding, which transformers runs for one sequence at a time (batch size 1), where the engine "
        "samples every completion of a generation batch together",
    ),
    GenerationMode.GROUP_BEAM_SEARCH: (
        ("num_beam_groups", "diversity_penalty"),
        "group beam search (diverse beam search)",
    ),
    GenerationMode.CONSTRAINED_BEAM_SEARCH: (("constraints", "force_words_ids"), "constrained beam search"),
    GenerationMode.CONTRASTIVE_SEARCH: (("penalty_alpha",), "contrastive search"),
    GenerationMode.DOLA_GENERATION: (("dola_layers",), "dola decoding"),
}
HUB_MODES = (
    "transformers moved it out of the library into a Hub repository of remote code (custom_generate), which the "
    "engine does not run"
)
BEAM_MODES = (GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE)


def sampling_config(sampling: SamplingSettings, stop_ids: list[int], pad_id: int) -> GenerationConfig:
    """The generation parameters of the run, with `generation_kwargs` applied over them (options the engine
    cannot run refused first, by name)."""
    for name in GENERATE_ARGUMENTS:
        if name in sampling.generation_kwargs:
            _refuse(sampling.generation_kwargs, GenerationMode.ASSISTED_GENERATION)
    params = dict(
        max_new_tokens=sampling.max_completion_length,
        do_sample=True,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
        cache_implementation=sampling.cache_implementation,
        output_scores=True,
        return_dict_in_generate=True,
    )
    params.update(sampling.generation_kwargs)
    return GenerationConfig(**params)


def decoding_mode(config: GenerationConfig, model: Any, given: Mapping[str, Any] | None) -> GenerationMode:
    """The decoding mode `model.generate` runs under `config`: the model's own generation_config fills the
    fields `config` leaves unset, as `generate` merges them (a model may ask for beams there). A mode the engine
    cannot run, or one that returns another number of rows than it is given, is refused, naming the option
    (`given`: the run's generation_kwargs)."""
    effective = copy.deepcopy(config)
    own = getattr(model, "generation_config", None)
    if isinstance(own, GenerationConfig):
        effective.update(**own.to_dict(), defaults_only=True, allow_custom_entries=True)
    returned = effective.num_return_sequences
    if returned is not None and returned != 1:
        where = "generation_kwargs" if "num_return_sequences" in (given or {}) else "The model's generation_config has"
        raise ValueError(
            f"{where} num_return_sequences={returned}: generate would return {returned} completions per "
            "row, where the trainer samples each completion as a row of its own. Remove num_return_sequences: "
            "num_generations sets how many completions each prompt gets."
        )
    mode = effective.get_generation_mode()
    if mode in UNSUPPORTED_MODES:
        _refuse(given or {}, mode)
    return mode


def _refuse(given: Mapping[str, Any], mode: GenerationMode) -> None:
    options, what = UNSUPPORTED_MODES[mode]
    named = [repr(name) for name in options if name in given]
    where = f"generation_kwargs {', '.join(named)}" if named else "The model's generation_config"
    hub = "" if mode == GenerationMode.ASSISTED_GENERATION else f"; {HUB_MODES}"
    raise ValueError(
        f"{where} selects {what}{hub}. The plain engine samples (or searches beams, num_beams) with transformers' "
        f"own decoding: remove {' / '.join(options)} from generation_kwargs (and from the model's "
        "generation_config)."
    )


def _check_beam_behaviour(sampling: SamplingSettings) -> None:
    """Beams leave no sampler log-probs: the behaviour policy of async_generation cannot be taken from them."""
    if sampling.sampler_logps:
        beams = sampling.generation_kwargs.get("num_beams", "from the model's generation_config")
        raise ValueError(
            f"generation_kwargs num_beams={beams} searches beams, which gives no sampler log-probs, and "
            "async_behaviour_logps='sampler' takes the behaviour policy's log-probs from them. Set "
            "async_behaviour_logps='training' (the training pass computes them), or sample without beams."
        )


class _StopOnPreemption(StoppingCriteria):
    """Ends `model.generate` at the next token once SIGTERM has arrived (the engine then raises `Preempted`)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), sigterm.requested(), dtype=torch.bool, device=input_ids.device)


def _token_logps(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(rows,) log-probs of `tokens` under one step's (rows, vocabulary) processed scores."""
    return torch.log_softmax(scores.float(), dim=-1).gather(-1, tokens[:, None])[:, 0]


class _SampledLogps(StoppingCriteria):
    """After each step, the log-probability of the token just sampled, read from that step's processed scores (the
    last of generate's `scores`); then those scores' memory is released. generate would otherwise keep every
    step's (rows, vocabulary) float32 scores until it returns: 256 rows x 1,024 steps at a 152k vocabulary is
    ~159 GB. Never stops generation itself."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []
        self.misaligned = False  # a step whose scores had another number of rows than its tokens (beams)

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(scores, tuple) and scores and scores[-1].numel():
            if scores[-1].shape[0] == input_ids.shape[0] and not self.misaligned:
                self.steps.append(_token_logps(scores[-1], input_ids[:, -1]))
            else:  # beam search hands the candidate beams with the kept beams' scores: nothing to read
                self.misaligned = True
            scores[-1].set_()  # generate's tuple keeps the tensor object, no longer its (rows, vocabulary) memory
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def logps(self, new_tokens: torch.Tensor, scores: Any) -> torch.Tensor:
        """(rows, steps) log-probs of `new_tokens`: the steps read as they came (a deferred stop check may have
        run steps that generate then undid: only the first ones count), else from scores generate returned whole
        (a decoding loop that does not hand its criteria the scores), else NaN (no sampling correction). Scores of
        another number of rows than `new_tokens` (beams) are never read."""
        rows, count = new_tokens.shape
        steps = [] if self.misaligned else self.steps
        if (
            len(steps) < count
            and scores is not None
            and len(scores) >= count
            and all(s.numel() and s.shape[0] == rows for s in scores[:count])
        ):
            steps = [_token_logps(s, new_tokens[:, t]) for t, s in enumerate(scores[:count])]
        if len(steps) < count or any(step.shape[0] != rows for step in steps[:count]):
            return torch.full(new_tokens.shape, float("nan"))
        return torch.stack(steps[:count], dim=1) if count else torch.zeros(new_tokens.shape)


class TransformersEngine:
    """Samples with `model.generate` on the given (unwrapped) model, in eval mode and without gradients."""

    name = "transformers"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        sampling: SamplingSettings,
        stop_ids: list[int],
        autocast: Any = None,
        batch_size: int | None = None,
        pixels: Any = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.config = sampling_config(sampling, stop_ids, tokenizer.pad_token_id)
        self.max_new_tokens = self.config.max_new_tokens  # generation_kwargs may set it
        self.beams = decoding_mode(self.config, model, sampling.generation_kwargs) in BEAM_MODES
        if self.beams:
            self.config.output_scores = False  # (rows x beams, vocabulary) per step, and no sampler log-prob in them
            _check_beam_behaviour(sampling)
            logger.info(
                "generate searches beams (num_beams=%s): completions are the best beams, not draws from the "
                "policy, so the engine records no sampler log-probs (the sampling/* metrics compare none: ratio 1).",
                self.config.num_beams if self.config.num_beams not in (None, 1) else "from the model's config",
            )
        self.autocast = autocast
        self.batch_size = batch_size
        self.pixels = pixels  # a vision-language model's image inputs (`grpo.models.vision.Pixels`)
        if pixels is not None:  # a sampled image token would have no image features (the training pass agrees)
            self.config.suppress_tokens = [*(self.config.suppress_tokens or []), *suppressed_tokens(model)]

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Nothing to do: the engine samples from the training model itself."""

    @torch.no_grad()
    def generate(self, requests: Sequence[Request]) -> Rollout:
        rows = expand(requests)
        step = self.batch_size or len(rows)
        completions, logps = [], []
        for start in range(0, len(rows), step):
            part_ids, part_logps = self._generate(rows[start : start + step])
            completions += part_ids
            logps += part_logps
        return assemble(rows, completions, logps, self.stop_ids, self.tokenizer)

    def _generate(self, rows: Sequence[Request]) -> tuple[list[list[int]], list[list[float]]]:
        device = next(self.model.parameters()).device
        ids, mask = left_pad([row.prompt.ids for row in rows], self.tokenizer.pad_token_id)
        budgets = [row.max_tokens or self.max_new_tokens for row in rows]
        images = {}
        if self.pixels is not None:
            images = self.pixels.inputs([row.prompt for row in rows], ids.to(device), device)
        was_training = self.model.training
        self.model.eval()  # dropout off, and the KV cache on even when gradient checkpointing is enabled
        sampled = _SampledLogps()
        criteria = [_StopOnPreemption()] if self.beams else [_StopOnPreemption(), sampled]
        try:
            with self.autocast() if self.autocast else nullcontext():
                out = self.model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    **images,
                    generation_config=self.config,
                    max_new_tokens=max(budgets),
                    stopping_criteria=StoppingCriteriaList(criteria),
                )
        finally:
            self.model.train(was_training)
        sigterm.check()
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        if sequences.shape[0] != len(rows):
            raise ValueError(
                f"model.generate returned {sequences.shape[0]} sequences for {len(rows)} rows: the engine takes one "
                "completion per row. Remove the generate option that changes the row count (num_return_sequences) "
                "from generation_kwargs or the model's generation_config."
            )
        new_tokens = sequences[:, ids.shape[1] :]
        if isinstance(out, torch.Tensor) or self.beams:  # tokens the engine did not score: a replaced generate
            # returning sequences only, or beams (NaN log-probs: no sampling correction, as vLLM's unscored)
            token_logps = torch.full(new_tokens.shape, float("nan"))
        else:  # from the processed scores each token was drawn from (after temperature and every logits processor)
            token_logps = sampled.logps(new_tokens, out.scores)
        completions, logps = [], []
        for row, row_logps, budget in zip(new_tokens.tolist(), token_logps.tolist(), budgets):
            kept, _ = cut_at_stop(row[:budget], self.stop_ids)
            completions.append(kept)
            logps.append(row_logps[: len(kept)])
        return completions, logps
