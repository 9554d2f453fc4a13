"""`FastEngine`: our own decode loop, for the rollouts GRPO makes.

What it does that `model.generate` does not, each measured in `bench/` and checked against the plain path in
the tests:
- **prefix sharing**: a request's samples share its prompt; the prompt is prefilled once and its KV cache
  copied to the request's rows (prefill work / G);
- **finished rows leave the batch**: a row that emitted a stop token (or used its request's token budget) is
  dropped from the decode batch and its cache, so late steps run on the rows still going (on a CPU at once; on
  a GPU, which would wait for the host at every look, every 16 steps);
- **on a GPU, fixed shapes** (`grpo.rollout.graphed`): with the lean decoder, a decode step reads and writes
  device buffers only, sampling included, so it is captured once as a CUDA graph and replayed; both loops read
  the same uniform numbers, one per row and step, and sample the same tokens from one generator;
- **lean sampling**: the processed distribution is built once per step with transformers' own logits
  processors (repetition penalty, temperature, top-k, top-p, min-p: the plain path's semantics and order),
  the token drawn from it, and its log-probability read from the same tensor.

- **weights rounded once per rollout**: under bfloat16 autocast every forward re-casts every float32 weight;
  `low_precision_linears` casts (and on CPUs with oneDNN, pre-packs) each linear weight once per rollout and
  feeds the same bfloat16 numbers to the same matmul: identical logits, less time per token;
- **float32 weights packed once per rollout** (CPUs without fast bfloat16): on x86 with AVX2 the lean decoder
  packs every weight into grpo's panel kernel's layout and runs each decode step's layers in one C call
  (`grpo.rollout.cpu.panels`); elsewhere it packs the MLP and head weights into MKL's sgemm layout for the decode batch
  (`grpo.rollout.cpu.packed`), and again for fewer rows as the batch empties. Float32 arithmetic throughout;
- **sampling by a two-level CDF inversion** (`sample_from`): block sums, then one block's cumulative sum, where
  a full-vocabulary float64 exp and cumsum took a tenth of a decode step.

Models or settings it does not handle (custom generation_kwargs, caches without batch selection) use the
plain engine; `grpo.rollout.build_engine` picks and logs which.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from transformers import (
    DynamicCache,
    GenerationMixin,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grpo.algo.sampling import SamplingSettings
from grpo.base import sigterm
from grpo.base.records import Request, Rollout, expand, left_pad
from grpo.distributed.sharding import full_parameters
from grpo.models.modeling import accepts_logits_to_keep, cache_argument, keeps_recurrent_state, swapped_forwards
from grpo.perf.kernels import fixed_linear
from grpo.rollout import graphed, lean_decoder, lean_families
from grpo.rollout.base import assemble
from grpo.rollout.plain import TransformersEngine

logger = logging.getLogger("grpo")

Sampler = Callable[[torch.Tensor], torch.Tensor]


def logits_processors(sampling: SamplingSettings) -> LogitsProcessorList:
    """The plain path's processors for the sampling parameters, in transformers' order."""
    procs = LogitsProcessorList()
    if sampling.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty))
    if sampling.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k:
        procs.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        procs.append(TopPLogitsWarper(sampling.top_p))
    if sampling.min_p:
        procs.append(MinPLogitsWarper(sampling.min_p))
    return procs


_thread = threading.local()  # a thread's own sampling generator (`own_generator`)


@contextmanager
def own_generator(generator: torch.Generator | None) -> Iterator[None]:
    """While active, `sample_from` in this thread draws from `generator` instead of torch's global one (an
    asynchronous producer's rounds then do not depend on what other threads draw)."""
    previous = getattr(_thread, "generator", None)
    _thread.generator = generator
    try:
        yield
    finally:
        _thread.generator = previous


# `sample_from` inverts the CDF in two levels: block sums locate the block holding the draw, then only that block is
# scanned; a full-vocabulary float64 exp and cumsum took a tenth of a CPU decode step (`bench/RESULTS.md`).
SAMPLE_BLOCK = 512


def sample_from(logprobs: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row from exp(logprobs) by inverting the CDF: one uniform number per row, where
    torch.multinomial or a Gumbel race would draw one per vocabulary entry. The CDF is summed in float64 (its bias is
    far below sampling noise), in two levels: per-block sums of SAMPLE_BLOCK entries find the block that holds the
    draw, and the cumulative sum runs within that block only (the same inversion as one full cumulative sum, in
    another summation order). Never a zero-probability token. `u`: the uniform numbers (rows, 1) float64, drawn
    by the caller; by default from the thread's `own_generator` when one is set, else torch's global generator."""
    rows, vocab = logprobs.shape
    p = logprobs.float().exp()
    blocks = -(-vocab // SAMPLE_BLOCK)
    if blocks * SAMPLE_BLOCK != vocab:  # zero probability past the vocabulary
        p = torch.nn.functional.pad(p, (0, blocks * SAMPLE_BLOCK - vocab))
    p = p.view(rows, blocks, SAMPLE_BLOCK)
    block_cdf = p.sum(-1, dtype=torch.float64).cumsum(-1)  # (rows, blocks)
    if u is None:
        u = torch.rand(rows, 1, dtype=torch.float64, device=p.device, generator=getattr(_thread, "generator", None))
    u = u * block_cdf[:, -1:]
    # the first block whose CDF exceeds u holds positive mass; u's remainder within it
    block = torch.searchsorted(block_cdf, u, right=True).clamp(max=blocks - 1)
    before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0)), torch.zeros_like(u))
    inner = p.gather(1, block[:, :, None].expand(-1, -1, SAMPLE_BLOCK)).squeeze(1).double().cumsum(-1)
    index = torch.searchsorted(inner, u - before, right=True)
    # rounding between the block sum and the in-block sum can leave the remainder at the block's total: the block's
    # last positive entry then (the first index reaching the total), never a zero-probability one
    index = torch.minimum(index, torch.searchsorted(inner, inner[:, -1:].contiguous(), right=False))
    return (block * SAMPLE_BLOCK + index).squeeze(-1)


class low_precision_linears:  # noqa: N801 (a context manager used like a function)
    """While active, every plain `nn.Linear` of `model` computes with a bfloat16/float16 copy of its weight made on
    entry, exactly what autocast would feed the matmul, without autocast's per-forward cast. On CPUs with oneDNN the
    copy is also pre-packed into oneDNN's blocked layout (the same kernel, without a per-call reorder). Subclasses
    of `nn.Linear` (LoRA, quantized layers) keep their own forward. Does nothing for other dtypes."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None) -> None:
        self.model, self.dtype = model, dtype
        self.patched: list[torch.nn.Linear] = []
        self.swap: Any = nullcontext()

    def __enter__(self) -> low_precision_linears:
        if self.dtype in (torch.bfloat16, torch.float16):
            self.patched = [
                m for m in self.model.modules() if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32
            ]
            self.swap = swapped_forwards([(m, fixed_linear(m.weight, m.bias, self.dtype)) for m in self.patched])
        self.swap.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.swap.__exit__(*exc)
        self.patched, self.swap = [], nullcontext()


def unsupported_reason(model: Any, sampling: SamplingSettings) -> str | None:
    """Why the fast engine cannot run this model with these settings (None when it can)."""
    if sampling.generation_kwargs:
        return "generation_kwargs are set (only the plain path applies arbitrary generation parameters)"
    if sampling.cache_implementation:
        return f"cache_implementation={sampling.cache_implementation!r} is set (the fast path uses a dynamic cache)"
    if not getattr(model, "_supports_cache_class", True) or getattr(model.config, "is_encoder_decoder", False):
        return "the model does not use transformers' dynamic KV cache"
    if keeps_recurrent_state(model):  # NemotronH, Jamba, Qwen3-Next, Mamba...
        return (
            "the model keeps recurrent state (Mamba or linear-attention layers), which the fast engine's "
            "shared-prefix KV cache does not hold"
        )
    return None


_TRANSFORMERS_GENERATE = GenerationMixin.__dict__["generate"]  # transformers' own, as grpo was imported


def generate_replaced(model: Any) -> bool:
    """Whether `model.generate` was replaced after the model was made: on the instance, or transformers' own patched
    at the class (as TRL's tests do). A class that defines its own generate (PEFT's wrapper) does not count."""
    if "generate" in vars(model):
        return True
    current = GenerationMixin.__dict__.get("generate")
    return current is not _TRANSFORMERS_GENERATE and getattr(type(model), "generate", None) is current


class FastEngine:
    """Prefix-shared, shrinking-batch sampling on an (unwrapped) transformers causal LM."""

    name = "fast"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        sampling: SamplingSettings,
        stop_ids: list[int],
        autocast: Any = None,
        share_prefix: bool = True,
        sampler: Sampler | None = None,
        compute_dtype: torch.dtype | None = None,
        lean: bool = True,
        static: bool | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.settings = sampling
        self._plain: TransformersEngine | None = None  # for a model whose generate is replaced (`generate`)
        self.compute_dtype = compute_dtype  # autocast's dtype, if any: linears then use weights cast once
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
        self.max_new_tokens = sampling.max_completion_length
        self.processors = logits_processors(sampling)
        self.needs_history = sampling.repetition_penalty != 1.0
        self.autocast = autocast
        self.share_prefix = share_prefix
        self.sampler = sampler  # None: `sample_from` on uniform numbers drawn per row and step (`draw_uniforms`)
        self.static = static  # decode on fixed shapes (`graphed.StaticDecode`); None: on CUDA, with the lean decoder
        self.graphs = graphed.Graphs()  # on CUDA: one graph pool and side stream for the run, and a failure kept
        self.buffers = graphed.Buffers()  # the fixed-shape loop's cache, state and weights, kept for the run
        self.lean_reason = lean_families.unsupported_reason(model) if lean else "turned off"
        # the fixed-shape loop runs the Llama layer only: other lean models take the per-step loop
        self.fixed_reason = lean_families.fixed_shape_reason(model) if self.lean_reason is None else self.lean_reason
        if self.lean_reason is not None:
            logger.info("Sampling with the transformers forward: %s.", self.lean_reason)

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Nothing to do: the engine samples from the training model itself (weights are read at each rollout)."""

    @torch.no_grad()
    def generate(self, requests: Sequence[Request]) -> Rollout:
        if generate_replaced(self.model):  # a wrapper or a test's patch of generate: sample through it
            if self._plain is None:
                self._plain = TransformersEngine(
                    self.model, self.tokenizer, self.settings, self.stop_ids.tolist(), autocast=self.autocast
                )
            return self._plain.generate(requests)
        was_training = self.model.training
        self.model.eval()
        try:
            # the transformers forward: linear weights cast once for the whole rollout (the lean decoder
            # casts its own)
            lowp = low_precision_linears(self.model, self.compute_dtype) if self.lean_reason else nullcontext()
            # the lean decoder sets every dtype itself: autocast would only add dispatch overhead
            amp = self.autocast() if self.autocast and self.lean_reason else nullcontext()
            # it also reads the weights directly: a sharded model (FSDP) is gathered for the rollout (the
            # transformers forward gathers layer by layer through FSDP's own hooks)
            whole = full_parameters(self.model) if self.lean_reason is None else nullcontext()
            with amp, lowp, whole:
                tokens, logps = self._decode(requests)
        finally:
            self.model.train(was_training)
        return assemble(expand(requests), tokens, logps, set(self.stop_ids.tolist()), self.tokenizer)

    def _decode(self, requests: Sequence[Request]) -> tuple[list[list[int]], list[list[float]]]:
        device = next(self.model.parameters()).device
        counts = torch.tensor([r.num_samples for r in requests], dtype=torch.long)
        if self.share_prefix:  # one prefill per request, its cache copied to the request's rows
            unique = [r.prompt.ids for r in requests]
            owner = torch.arange(len(requests)).repeat_interleave(counts)
        else:
            unique = [row.prompt.ids for row in expand(requests)]
            owner = torch.arange(len(unique))
        budgets = torch.tensor([r.max_tokens or self.max_new_tokens for r in requests]).repeat_interleave(counts)
        n = len(owner)
        longest = int(budgets.max()) if n else 0
        if longest == 0:
            return [[] for _ in range(n)], [[] for _ in range(n)]
        ids, mask = left_pad(unique, self.tokenizer.pad_token_id)
        ids, mask, owner, budgets = ids.to(device), mask.to(device), owner.to(device), budgets.to(device)
        generator = getattr(_thread, "generator", None)
        static = self.static if self.static is not None else device.type == "cuda"
        if static and self.fixed_reason is None:
            # the weights the graphs read, refreshed in place (the engine's held copies, or the parameters themselves)
            decoder = lean_decoder.LeanDecoder(self.model, self._dtype(), held=self.buffers.held)
            graphs = self.graphs if graphed.graphs_here(device) else None
            run = graphed.StaticDecode(
                decoder, self.processors, self.stop_ids, self._draw, self.needs_history, graphs, self.buffers
            )
            tokens, logps, lengths = run.run(ids, mask, owner, budgets, longest, generator, self.sampler is None)
        else:
            # a GPU would wait for the host at every look at the rows: there, finished rows leave every
            # CHECK_EVERY steps; on the CPU at once
            every = graphed.CHECK_EVERY if device.type == "cuda" else 1
            tokens, logps, lengths = self._eager(ids, mask, owner, budgets, longest, generator, every)
        ends, tokens, logps = lengths.tolist(), tokens.cpu(), logps.cpu()  # the rollout's one read-back
        return (
            [tokens[r, : ends[r]].tolist() for r in range(n)],
            [logps[r, : ends[r]].tolist() for r in range(n)],
        )

    def _draw(self, logprobs: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        return sample_from(logprobs, u) if self.sampler is None else self.sampler(logprobs)

    def _eager(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        owner: torch.Tensor,
        budgets: torch.Tensor,
        longest: int,
        generator: torch.Generator | None,
        every: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The shrinking batch: finished rows leave the batch and the cache at the first look at the rows (every
        `every` steps). Returns the tokens and log-probs (rows, longest) and each row's length."""
        n, device = len(owner), ids.device
        stepper = self._stepper()
        logits = stepper.prefill(ids, mask, owner, longest)
        history = ids[owner] if self.needs_history else None
        active = torch.arange(n, device=device)  # original row of each batch row
        going = torch.ones(n, dtype=torch.bool, device=device)
        tokens = torch.zeros(n, longest, dtype=torch.long, device=device)
        logps = torch.zeros(n, longest, dtype=torch.float32, device=device)
        lengths = torch.zeros(n, dtype=torch.long, device=device)
        stop_ids = self.stop_ids.to(device)
        sample = self.sampler is None
        for step in range(longest):
            sigterm.check()  # SIGTERM ends a long rollout at the next token
            if sample and step % graphed.CHECK_EVERY == 0:
                uniforms = graphed.draw_uniforms(n, device, generator)
            # history is None where no processor reads the tokens (no repetition penalty); transformers types it
            # as a LongTensor
            logprobs = torch.log_softmax(self.processors(history, logits), dim=-1)  # type: ignore[arg-type]
            u = uniforms[step % graphed.CHECK_EVERY, active].unsqueeze(-1) if sample else None
            chosen = self._draw(logprobs, u)
            tokens[active, step] = chosen
            logps[active, step] = logprobs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
            lengths[active] += going
            going = going & ~torch.isin(chosen, stop_ids) & (budgets[active] > step + 1)
            if step == longest - 1:
                break
            if (step + 1) % every == 0:
                if not going.any():
                    break
                if not going.all():  # finished rows leave the batch and the cache
                    keep = going.nonzero().squeeze(-1)
                    stepper.select(keep)
                    active, chosen, going = active[keep], chosen[keep], going[keep]
                    history = history[keep] if history is not None else None
            if history is not None:
                history = torch.cat([history, chosen.unsqueeze(-1)], dim=-1)
            logits = stepper.step(chosen)
        return tokens, logps, lengths

    def _stepper(self) -> Any:
        """The lean decoder where the model allows it, else the transformers forward with a dynamic cache."""
        if self.lean_reason is None:
            return lean_decoder.LeanDecoder(self.model, self._dtype())
        return _TransformersStepper(self.model)

    def _dtype(self) -> torch.dtype:
        return self.compute_dtype or next(self.model.parameters()).dtype


class _TransformersStepper:
    """`LeanDecoder`'s interface on the model's own forward and a DynamicCache."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache = DynamicCache()
        self.cache_arg = cache_argument(model)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, owner: torch.Tensor, max_new: int) -> torch.Tensor:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        keep_last = {"logits_to_keep": 1} if accepts_logits_to_keep(self.model) else {}
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self.cache_arg: self.cache},
            **keep_last,
        )
        self.cache.batch_select_indices(owner)  # copy each prompt's cache to its rows
        self.mask = mask[owner]
        self.positions = self.mask.sum(-1, keepdim=True)
        return out.logits[owner, -1, :].float()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], dim=-1)
        out = self.model(
            input_ids=tokens.unsqueeze(-1),
            attention_mask=self.mask,
            position_ids=self.positions,
            use_cache=True,
            **{self.cache_arg: self.cache},
        )
        self.positions = self.positions + 1
        return out.logits[:, -1, :].float()

    def select(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.mask, self.positions = self.mask[rows], self.positions[rows]
