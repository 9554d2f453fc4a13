"""Decoding on fixed shapes, for GPUs: the fast engine's loop with no host sync inside a step, captured as CUDA graphs.

A GPU runs a small model's decode step in well under a millisecond when it is handed whole steps. Eager decoding
hands it ~800 small kernels a token and waits for the host several times a token (reading the sampled tokens,
asking which rows finished): launch- and sync-bound. `StaticDecode` makes a step a function of device buffers only:
- every row's keys and values sit in buffers of a fixed width (widened by `lean_decoder.GROW` columns between
  steps, as the tokens come), attended over that width with a mask;
- sampling happens inside the step: transformers' logits processors, the log-softmax, and `sample_from` reading
  uniform numbers drawn beforehand, `CHECK_EVERY` steps at a time, one per row and step (the same numbers the
  eager loop reads, so both sample the same tokens from the same generator);
- the sampled tokens and their log-probs are written into (rows, budget) buffers and each row's length counted,
  read back once at the end.
The host looks at the rows every `CHECK_EVERY` steps (one sync): it stops when no row is going, and moves the rows
still going into a smaller batch when they fit one (row counts are powers of two), layer by layer, so the cache is
never held twice. Rows that finished in between keep their slots until then, their tokens not counted.

On CUDA each (rows, width) segment's step is captured once as a CUDA graph (`torch.cuda.CUDAGraph`, after one
warm-up step on a side stream) and replayed: one launch a step. Graphs are kept for the run and replayed in every
later rollout, so every tensor a step reads stays where it is for the run, and is written in place:
- the engine's `Buffers`: the key/value cache and the loop's state, laid out for the most slots, columns and tokens
  a rollout has needed (larger ones are made, and the graphs dropped, only when a rollout needs more). A segment
  reads their first `bucket(rows)` slots and first `width` columns, a multiple of `GROW` (whatever the prompts'
  width: the first column decoded is a tensor of the step), so segments of every rollout share their graphs. Growth
  moves nothing; rows that leave are moved into the first slots in place, layer by layer. The cache is held for the
  whole budget of the rollouts' rows (as vLLM reserves its cache), where the eager loop grows it with the tokens;
- the weights (`held.HeldWeights`): the model's own parameters, or copies refreshed in place at each rollout.
So a run captures one graph per (rows, width) it meets, in its first rollouts, and none after. What else outlives
a rollout is in the engine's `Graphs`: one memory pool that every capture shares, one side stream, and whether
capturing failed (then one warning, and every later rollout decodes eagerly: no capture is tried again, and none
leaves a stale entry behind). Captures hold `allocator.DEVICE_WIDE`, which the learner's thread takes before it
empties the allocator's cache or runs a micro-step. Elsewhere the same step runs eagerly; the tests compile it
with `fullgraph=True` to show that nothing in it waits for the host, and replay it traced per segment (`make_fx`)
to show that it reads nothing a graph would not hold.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from grpo.base import sigterm
from grpo.perf import allocator
from grpo.rollout.held import HeldWeights
from grpo.rollout.lean_decoder import GROW, LeanDecoder
from grpo.rollout.lean_ops import grouped_attention, rotated

logger = logging.getLogger("grpo")

CHECK_EVERY = 16  # decode steps between the host's looks at the rows (and between draws of uniform numbers)


class Graphs:
    """The CUDA graph state of one engine for the whole run (see the module's docstring): created lazily, so that
    building it touches no device. `capture` and `warm_up` are what a stand-in overrides to emulate CUDA on a CPU."""

    def __init__(self) -> None:
        self.failed = False  # a capture failed: eager decoding from then on
        self.warm = False  # a step ran on the side stream (a capture follows one)
        self.captured: dict[tuple[int, int], Any] = {}  # (rows, width) -> that segment's graph
        self.captures = 0  # graphs captured in the run
        self.version: tuple[int, int] | None = None  # the buffers' and weights' version the graphs were captured on
        self._stream: Any = None
        self._pool: Any = None

    def stream(self) -> Any:
        """The one side stream of warm-ups and captures."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def pool(self) -> Any:
        """The one memory pool of every graph the engine captures."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def fail(self, err: BaseException) -> None:
        if not self.failed:
            logger.warning(
                "Decoding without CUDA graphs for the rest of the run: the decode step could not be captured (%s).", err
            )
        self.failed = True

    def graph(self, key: tuple[int, int], version: tuple[int, int]) -> Any:
        """The graph captured for segment `key` on the buffers and weights of `version` (None: none yet). Graphs of
        another version read addresses that are gone: all are dropped (their memory returns to the pool)."""
        if version != self.version:
            self.captured.clear()
            self.version = version
        return self.captured.get(key)

    def warm_up(self, step: Callable[[], None]) -> None:
        """The run's first step, eagerly on the side stream (as CUDA graph capture wants before a capture)."""
        current, side = torch.cuda.current_stream(), self.stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            step()
        current.wait_stream(side)
        self.warm = True

    def capture(self, key: tuple[int, int], step: Callable[[], None]) -> Any:
        """Record `step` as segment `key`'s CUDA graph (nothing runs), or None where that fails (`fail`: eager from
        then on). Not `torch.cuda.graph()`: it synchronizes the device, collects Python's garbage and empties the
        allocator's cache before every capture (vLLM skips those too). Thread-local, in the one pool and on the one
        side stream, under `allocator.DEVICE_WIDE`: in an asynchronous run the learner's thread uses the device
        meanwhile, but never empties the cache or runs a micro-step (compilation, autotuning) while a capture is
        under way."""
        with allocator.DEVICE_WIDE:
            try:
                graph = self._record(step)
            except RuntimeError as err:
                self.fail(err)
                return None
        self.captured[key] = graph
        self.captures += 1
        return graph

    def _record(self, step: Callable[[], None]) -> Any:
        graph = torch.cuda.CUDAGraph()
        current, side = torch.cuda.current_stream(), self.stream()
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(pool=self.pool(), capture_error_mode="thread_local")
                try:
                    step()
                finally:
                    graph.capture_end()
        finally:
            current.wait_stream(side)
        return graph


class Buffers:
    """Every tensor the fixed-shape step reads or writes, kept by the engine for the run (see the module's
    docstring), laid out for at most `rows` slots (and a row that spare slots write into), `width` key columns and
    `longest` tokens a row. A rollout that needs more makes larger ones (`version` changes: the graphs captured on
    the old ones are dropped); none is ever made smaller. A segment reads their first rows and columns."""

    def __init__(self) -> None:
        self.held = HeldWeights()  # the weights the step reads, refreshed in place at each rollout
        self.rows = self.width = self.longest = 0
        self.layout: tuple[Any, ...] = ()  # (layers, kv_heads, head_dim, dtype, vocab, device, stop ids)
        self.version = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def fit(self, dec: LeanDecoder, rows: int, width: int, longest: int, vocab: int, stop_ids: torch.Tensor) -> None:
        """Buffers for `rows` slots, `width` columns and `longest` tokens: the ones held where they are large
        enough, else larger ones (the old ones freed first)."""
        device = dec.embed.device
        layout = (len(dec.layers), dec.kv_heads, dec.head_dim, dec.dtype, vocab, device, tuple(stop_ids.tolist()))
        if layout == self.layout and rows <= self.rows and width <= self.width and longest <= self.longest:
            return
        if layout == self.layout:
            rows, width, longest = max(rows, self.rows), max(width, self.width), max(longest, self.longest)
        self.keys, self.values = [], []  # the old cache goes before the new one is made
        self.rows, self.width, self.longest, self.layout = rows, width, longest, layout
        self.version += 1
        shape = (rows, dec.kv_heads, width, dec.head_dim)
        self.keys = [torch.zeros(shape, dtype=dec.dtype, device=device) for _ in dec.layers]
        self.values = [torch.zeros(shape, dtype=dec.dtype, device=device) for _ in dec.layers]
        self.valid = torch.zeros(rows, width, dtype=torch.bool, device=device)
        self.history = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.logits = torch.zeros(rows, vocab, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.going = torch.zeros(rows, dtype=torch.bool, device=device)
        self.budget = torch.zeros(rows, dtype=torch.long, device=device)
        self.row = torch.zeros(rows, dtype=torch.long, device=device)
        # per row, and one more that spare slots write into (never read)
        self.tokens = torch.zeros(rows + 1, longest, dtype=torch.long, device=device)
        self.logps = torch.zeros(rows + 1, longest, dtype=torch.float32, device=device)
        self.lengths = torch.zeros(rows + 1, dtype=torch.long, device=device)
        self.uniforms = torch.full((CHECK_EVERY, rows + 1), 0.5, dtype=torch.float64, device=device)
        self.t = torch.zeros((), dtype=torch.long, device=device)  # the decode step
        self.start = torch.zeros((), dtype=torch.long, device=device)  # the prompts' width: the first column decoded
        self.stop_ids = stop_ids.to(device)

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer (the tests look at their addresses)."""
        names = ("valid", "history", "logits", "positions", "going", "budget", "row", "tokens", "logps", "lengths")
        return [*self.keys, *self.values, *(getattr(self, n) for n in names), self.uniforms, self.t, self.start]


def graphs_here(device: torch.device) -> bool:
    """Whether decode steps are captured as CUDA graphs on `device` (CUDA only)."""
    return device.type == "cuda"


def bucket(rows: int) -> int:
    """The batch that holds `rows` rows: the next power of two (few distinct shapes, so few graphs)."""
    return 1 << max(rows - 1, 0).bit_length()


def draw_uniforms(rows: int, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """The uniform numbers of the next `CHECK_EVERY` decode steps, one per step and row: (CHECK_EVERY, rows) float64.
    Row r's draw at a step depends on the generator, the step and r only, not on which other rows are still going."""
    return torch.rand(CHECK_EVERY, rows, dtype=torch.float64, device=device, generator=generator)


def columns(tokens: int) -> int:
    """The key/value width that holds `tokens` columns: a multiple of GROW (few distinct widths, so few graphs, the
    same whatever the prompts' width)."""
    return -(-tokens // GROW) * GROW


class StaticDecode:
    """One rollout on the lean decoder's weights, on fixed shapes (see the module's docstring), in the engine's
    `buffers` (by default its own, for this rollout)."""

    def __init__(
        self,
        decoder: LeanDecoder,
        processors: Callable[[Any, Any], torch.Tensor],  # (history or None, logits) -> processed logits
        stop_ids: torch.Tensor,
        draw: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        with_history: bool,
        graphs: Graphs | None,
        buffers: Buffers | None = None,
    ) -> None:
        self.decoder = decoder
        self.processors = processors
        self.draw = draw  # (logprobs, uniforms) -> tokens
        self.with_history = with_history  # the processors read every row's tokens so far (repetition penalty)
        self.graphs = graphs  # the engine's CUDA graph state; None: eager steps (not on CUDA)
        self.buffers = buffers if buffers is not None else Buffers()
        self.stop_ids = stop_ids
        # what runs a step, eagerly and in a capture (the tests and the GPU check compile it)
        self.step_fn: Callable[[], None] = self._step

    @torch.no_grad()
    def run(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        owner: torch.Tensor,
        budgets: torch.Tensor,
        longest: int,
        generator: torch.Generator | None,
        sample: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample up to `budgets[row]` tokens for each row (`owner[row]`: its prompt among the left-padded `ids`);
        returns the tokens and log-probs (rows, longest) and each row's length. `sample`: draw uniform numbers
        (a custom `draw` that ignores them, such as greedy decoding, leaves the generator alone)."""
        self.prefill(ids, mask, owner, budgets, longest)
        n, device = len(owner), ids.device
        done = 0
        while done < longest:
            if sample:  # outside the graph: any generator, and the same numbers as the eager loop reads
                self.uniforms[:, :n].copy_(draw_uniforms(n, device, generator))
            steps = min(CHECK_EVERY, longest - done)
            if self.prompt + done + steps > self.width:
                self._segment(self.rows, columns(self.prompt + done + steps))  # wider: the columns are there
            for _ in range(steps):
                self.advance()
            done += steps
            sigterm.check()  # SIGTERM ends a long rollout within CHECK_EVERY tokens
            if done >= longest:
                break
            live = int(self.going.sum())  # the loop's one host sync per CHECK_EVERY steps
            if live == 0:
                break
            if bucket(live) < self.rows:
                self._compact(live)
        return self.tokens[:n, :longest].clone(), self.logps[:n, :longest].clone(), self.lengths[:n].clone()

    def prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, owner: torch.Tensor, budgets: torch.Tensor, longest: int
    ) -> None:
        """The prompts' pass, and every buffer of the loop set for `bucket(rows)` slots: the prompts' keys and
        values copied to their rows, the columns after them cleared."""
        dec, b = self.decoder, self.buffers
        dec._unpack()  # the plain linears: weights cast once (held weights: refreshed in place)
        logits = dec.prompt_pass(ids, mask, ids.shape[1])
        n, device = len(owner), ids.device
        rows, prompt = bucket(n), ids.shape[1]
        b.fit(dec, rows, columns(prompt + longest), longest, logits.shape[-1], self.stop_ids)
        slot = torch.arange(rows, device=device)
        real = slot < n
        slot = torch.where(real, slot, 0)  # a spare slot repeats the first row (finite numbers, never read)
        source = owner[slot]
        for held, made in ((b.keys, dec.keys), (b.values, dec.values)):
            for i in range(len(made)):  # layer by layer, each prompt buffer freed once copied
                held[i][:rows, :, :prompt].copy_(made[i].index_select(0, source))
                held[i][:rows, :, prompt:].zero_()
                made[i] = made[i].new_empty(0)
        b.valid[:rows].zero_()
        b.valid[:rows, :prompt].copy_(mask.bool()[source])
        b.logits[:rows].copy_(logits.index_select(0, source))
        b.positions[:rows].copy_(mask.sum(-1, keepdim=True)[source])
        b.going[:rows].copy_(real)
        b.budget[:rows].copy_(budgets[slot])
        b.row[:rows].copy_(torch.where(real, slot, b.rows))  # each slot's row; spare slots write into the last
        b.t.zero_()
        b.start.fill_(prompt)
        b.tokens.zero_()
        b.logps.zero_()
        b.lengths.zero_()
        b.uniforms.fill_(0.5)
        if self.with_history:
            # the processors' view of each row's tokens: the prompt, then the sampled tokens written in as they
            # come; columns not yet written repeat the prompt's last token (a token the row has: no new penalty)
            b.history[:rows, :prompt].copy_(ids[source])
            b.history[:rows, prompt:].copy_(ids[source][:, -1:])
        self.prompt = prompt
        self._segment(rows, columns(prompt + min(longest, CHECK_EVERY)))

    def _segment(self, rows: int, width: int) -> None:
        """The step's views for `rows` slots and `width` key columns: the buffers' first ones."""
        b = self.buffers
        self.rows, self.width = rows, width
        self.keys = [k[:rows, :, :width] for k in b.keys]
        self.values = [v[:rows, :, :width] for v in b.values]
        self.valid, self.logits, self.positions = b.valid[:rows, :width], b.logits[:rows], b.positions[:rows]
        self.going, self.budget, self.row = b.going[:rows], b.budget[:rows], b.row[:rows]
        self.history = b.history[:rows, :width] if self.with_history else None
        self.tokens, self.logps, self.lengths, self.uniforms = b.tokens, b.logps, b.lengths, b.uniforms
        self.t, self.start, self.stop_ids = b.t, b.start, b.stop_ids

    def advance(self) -> None:
        """One decode step: the segment's captured graph replayed (captured in this rollout or an earlier one), or
        captured first, or an eager step (on CUDA: the run's first step, a warm-up on the side stream)."""
        graphs = self.graphs if self.graphs is not None and not self.graphs.failed else None
        if graphs is None:
            self.step_fn()
            return
        key = (self.rows, self.width)
        graph = graphs.graph(key, (self.buffers.version, self.buffers.held.version))
        if graph is None and not graphs.warm:
            graphs.warm_up(self.step_fn)
            return
        if graph is None:
            graph = graphs.capture(key, self.step_fn)
        if graph is not None:
            graph.replay()  # capturing recorded the step without running it
        else:
            self.step_fn()

    def _step(self) -> None:
        """Sample each row's token from the logits, record it, feed it: in place on the buffers, no host sync."""
        t, rows = self.t, len(self.row)
        logprobs = torch.log_softmax(self.processors(self.history, self.logits), dim=-1)
        u = self.uniforms.index_select(0, t.remainder(CHECK_EVERY).view(1))[0].index_select(0, self.row)
        chosen = self.draw(logprobs, u.unsqueeze(-1))
        at = t.expand(rows)
        self.tokens.index_put_((self.row, at), chosen)
        self.logps.index_put_((self.row, at), logprobs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1))
        # index_add_, not index_put_(accumulate=True): that one sorts its indices and checks their range on the host
        self.lengths.index_add_(0, self.row, self.going.long())
        stopped = (chosen.unsqueeze(-1) == self.stop_ids).any(-1)
        self.going.logical_and_(~stopped & (self.budget > t + 1))
        column = (t + self.start).view(1)
        if self.history is not None:
            self.history.index_copy_(1, column, chosen.unsqueeze(-1))
        self.valid.index_fill_(1, column, True)
        self.logits.copy_(self._forward(chosen, column))
        self.positions.add_(1)
        self.t.add_(1)

    def _forward(self, tokens: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
        """The lean decoder's layers for one token per row, its keys and values written at `column`, attention
        over the segment's whole width (the columns not attended masked out)."""
        dec = self.decoder
        assert dec.head is not None  # made by the decoder's prefill
        b = len(tokens)
        q_size, kv_size = dec.heads * dec.head_dim, dec.kv_heads * dec.head_dim
        x = F.embedding(tokens.unsqueeze(-1), dec.embed).float()
        cos, sin = dec.rotary(x, self.positions)
        cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
        bias = torch.zeros(self.valid.shape, device=x.device).masked_fill_(~self.valid, float("-inf"))[:, None, None]
        for i, layer in enumerate(dec.layers):
            qkv = layer["qkv"](layer["norm1"](x))
            qk, v = qkv.split([q_size + kv_size, kv_size], dim=-1)
            qk = rotated(qk.view(b, 1, dec.heads + dec.kv_heads, dec.head_dim).transpose(1, 2), layer, cos, sin)
            q, k = qk.split([dec.heads, dec.kv_heads], dim=1)
            self.keys[i].index_copy_(2, column, k.to(dec.dtype))
            self.values[i].index_copy_(
                2, column, v.view(b, 1, dec.kv_heads, dec.head_dim).transpose(1, 2).to(dec.dtype)
            )
            out = grouped_attention(q.to(dec.dtype), self.keys[i], self.values[i], bias, dec.scale)
            x = x + layer["o"](out.transpose(1, 2).reshape(b, 1, q_size))
            gate, up = layer["gate_up"](layer["norm2"](x)).split(layer["intermediate"], dim=-1)
            x = x + layer["down"](F.silu(gate) * up)
        return dec.head(dec.norm(x[:, -1])).float()

    def _compact(self, live: int) -> None:
        """The rows still going into the first `bucket(live)` slots, in place, layer by layer (one layer's kept
        rows copied at a time: the cache is never held twice)."""
        keep = self.going.nonzero().squeeze(-1)
        rows, width, b = bucket(live), self.width, self.buffers
        slot = torch.cat([keep, keep[:1].expand(rows - live)])
        real = torch.arange(rows, device=slot.device) < live
        kept = b.keys[0].new_empty((rows, b.keys[0].shape[1], width, b.keys[0].shape[3]))  # one layer's kept rows
        for cache in (b.keys, b.values):
            for k in cache:  # the columns past the segment's are clear in every slot: nothing there to move
                torch.index_select(k[: self.rows, :, :width], 0, slot, out=kept)
                k[:rows, :, :width].copy_(kept)
        del kept
        moved = [b.valid, b.logits, b.positions, b.budget] + ([b.history] if self.with_history else [])
        for buffer in moved:  # whole rows: the columns past the segment's are the row's own too
            buffer[:rows].copy_(buffer[: self.rows].index_select(0, slot))
        b.row[:rows].copy_(torch.where(real, self.row.index_select(0, slot), b.rows))
        b.going[:rows].copy_(self.going.index_select(0, slot) & real)
        self._segment(rows, width)
