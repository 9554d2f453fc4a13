"""Decoding on fixed shapes, for GPUs: the fast engine's loop with no host sync inside a step, captured as CUDA graphs.

A GPU runs a small model's decode step in well under a millisecond when it is handed whole steps. Eager decoding
hands it ~800 small kernels a token and waits for the host several times a token (reading the sampled tokens,
asking which rows finished): launch- and sync-bound. `StaticDecode` makes a step a function of device buffers only:
- every row's keys and values sit in buffers of a fixed width (grown by `lean_decoder.GROW` columns between steps,
  as the tokens come), attended over that width with a mask;
- sampling happens inside the step: transformers' logits processors, the log-softmax, and `sample_from` reading
  uniform numbers drawn beforehand, `CHECK_EVERY` steps at a time, one per row and step (the same numbers the
  eager loop reads, so both sample the same tokens from the same generator);
- the sampled tokens and their log-probs are written into (rows, budget) buffers and each row's length counted,
  read back once at the end.
The host looks at the rows every `CHECK_EVERY` steps (one sync): it stops when no row is going, and moves the rows
still going into a smaller batch when they fit one (row counts are powers of two), layer by layer, so the cache is
never held twice. Rows that finished in between keep their slots until then, their tokens not counted.

On CUDA each (rows, width) segment's step is captured once as a CUDA graph (`torch.cuda.CUDAGraph`, after one
warm-up step on a side stream) and replayed: one launch a step. Graphs live for one rollout (the buffers they
read do), so a rollout captures one graph per segment: a few, since widths grow by GROW columns and row counts
halve. What outlives a rollout is the engine's `Graphs`: one memory pool that every capture of the run shares,
one side stream, and whether capturing failed (then one warning, and every later rollout decodes eagerly: no
capture is tried again, and none leaves a stale entry behind). Elsewhere the same step runs eagerly; the tests
compile it with `fullgraph=True` to show that nothing in it waits for the host.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from grpo.base import sigterm
from grpo.rollout.lean_decoder import GROW, LeanDecoder
from grpo.rollout.lean_ops import grouped_attention, rotated

logger = logging.getLogger("grpo")

CHECK_EVERY = 16  # decode steps between the host's looks at the rows (and between draws of uniform numbers)


class Graphs:
    """The CUDA graph state of one engine for the whole run (see the module's docstring): created lazily, so that
    building it touches no device."""

    def __init__(self) -> None:
        self.failed = False  # a capture failed: eager decoding from then on
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


class StaticDecode:
    """One rollout on the lean decoder's weights, on fixed shapes (see the module's docstring)."""

    def __init__(
        self,
        decoder: LeanDecoder,
        processors: Callable[[Any, Any], torch.Tensor],  # (history or None, logits) -> processed logits
        stop_ids: torch.Tensor,
        draw: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        with_history: bool,
        graphs: Graphs | None,
    ) -> None:
        self.decoder = decoder
        self.processors = processors
        self.draw = draw  # (logprobs, uniforms) -> tokens
        self.with_history = with_history  # the processors read every row's tokens so far (repetition penalty)
        self.graphs = graphs  # the engine's CUDA graph state; None: eager steps (not on CUDA)
        self.stop_ids = stop_ids
        self.graph: Any = None  # the captured step of the current segment
        self.warm = False  # a step ran eagerly (CUDA graphs capture after one)
        self.step_fn: Callable[[], None] = self._step  # what runs a step eagerly (the tests compile it)

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
            width = self.decoder.keys[0].shape[2]
            if self.prompt + done + steps > width:
                self._grow(min(self.prompt + longest, max(self.prompt + done + steps, width + GROW)))
            for _ in range(steps):
                self.advance()
            done += steps
            sigterm.check()  # SIGTERM ends a long rollout within CHECK_EVERY tokens
            if done >= longest:
                break
            live = int(self.going.sum())  # the loop's one host sync per CHECK_EVERY steps
            if live == 0:
                break
            if bucket(live) < len(self.going):
                self._compact(live)
        return self.tokens[:n], self.logps[:n], self.lengths[:n]

    def prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, owner: torch.Tensor, budgets: torch.Tensor, longest: int
    ) -> None:
        """The prompts' pass, and every buffer of the loop laid out for `bucket(rows)` slots."""
        dec = self.decoder
        dec._unpack()  # the plain linears: weights cast once for the rollout
        logits = dec.prompt_pass(ids, mask, ids.shape[1])
        n, device = len(owner), ids.device
        rows = bucket(n)
        slot = torch.arange(rows, device=device)
        real = slot < n
        slot = torch.where(real, slot, 0)  # a spare slot repeats the first row (finite numbers, never read)
        source = owner[slot]
        self.prompt = ids.shape[1]
        self.row = torch.where(real, slot, n)  # each slot's row; spare slots write into row n, never read
        for cache in (dec.keys, dec.values):
            for i in range(len(cache)):
                cache[i] = cache[i].index_select(0, source)
        self.valid = mask.bool()[source]
        self.logits = logits.index_select(0, source)
        self.positions = mask.sum(-1, keepdim=True)[source]
        self.going = real.clone()
        self.budget = budgets[slot]
        self.t = torch.zeros((), dtype=torch.long, device=device)
        self.tokens = torch.zeros(n + 1, longest, dtype=torch.long, device=device)
        self.logps = torch.zeros(n + 1, longest, dtype=torch.float32, device=device)
        self.lengths = torch.zeros(n + 1, dtype=torch.long, device=device)
        self.uniforms = torch.full((CHECK_EVERY, n + 1), 0.5, dtype=torch.float64, device=device)
        # the processors' view of each row's tokens: the prompt, then the sampled tokens written in as they come;
        # columns not yet written repeat the prompt's last token (a token the row already has: no new penalty)
        self.history = (
            torch.cat([ids[source], ids[source][:, -1:].expand(rows, longest)], dim=1) if self.with_history else None
        )
        self._grow(self.prompt + min(longest, GROW))

    def advance(self) -> None:
        """One decode step: the segment's captured graph replayed, or (on CUDA) captured first, or an eager step
        (on CUDA: the run's first step, a warm-up on a side stream before any capture)."""
        graphs = self.graphs if self.graphs is not None and not self.graphs.failed else None
        if self.graph is not None:
            self.graph.replay()
        elif graphs is not None and self.warm:
            self._capture(graphs)
            if self.graph is not None:
                self.graph.replay()  # capturing recorded the step without running it
            else:
                self.step_fn()
        elif graphs is not None:  # warm-up on a side stream, as CUDA graph capture wants
            current, side = torch.cuda.current_stream(), graphs.stream()
            side.wait_stream(current)
            with torch.cuda.stream(side):
                self.step_fn()
            current.wait_stream(side)
            self.warm = True
        else:
            self.step_fn()

    def _capture(self, graphs: Graphs) -> None:
        """Record the step as the segment's CUDA graph (nothing runs). Not `torch.cuda.graph()`: it synchronizes
        the device, collects Python's garbage and empties the allocator's cache before every capture (vLLM skips
        those too). Thread-local: in an asynchronous run the learner's thread uses the device meanwhile. A step
        that cannot be captured runs eagerly from then on, for the rest of the run (`Graphs.fail`: one warning)."""
        graph = torch.cuda.CUDAGraph()
        current, side = torch.cuda.current_stream(), graphs.stream()
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(pool=graphs.pool(), capture_error_mode="thread_local")
                try:
                    self._step()
                finally:
                    graph.capture_end()
        except RuntimeError as err:
            graphs.fail(err)
            return
        finally:
            current.wait_stream(side)
        self.graph = graph

    def _new_segment(self) -> None:
        self.graph = None  # buffers moved: the next step is captured again

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
        column = (t + self.prompt).view(1)
        if self.history is not None:
            self.history.index_copy_(1, column, chosen.unsqueeze(-1))
        self.valid.index_fill_(1, column, True)
        self.logits.copy_(self._forward(chosen, column))
        self.positions.add_(1)
        self.t.add_(1)

    def _forward(self, tokens: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
        """The lean decoder's layers for one token per row, its keys and values written at `column`, attention
        over the buffers' whole width (the columns not attended masked out)."""
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
            dec.keys[i].index_copy_(2, column, k.to(dec.dtype))
            dec.values[i].index_copy_(2, column, v.view(b, 1, dec.kv_heads, dec.head_dim).transpose(1, 2).to(dec.dtype))
            out = grouped_attention(q.to(dec.dtype), dec.keys[i], dec.values[i], bias, dec.scale)
            x = x + layer["o"](out.transpose(1, 2).reshape(b, 1, q_size))
            gate, up = layer["gate_up"](layer["norm2"](x)).split(layer["intermediate"], dim=-1)
            x = x + layer["down"](F.silu(gate) * up)
        return dec.head(dec.norm(x[:, -1])).float()

    def _grow(self, width: int) -> None:
        """Key/value buffers `width` columns wide, layer by layer (each old buffer freed as it is copied)."""
        dec = self.decoder
        more = width - dec.keys[0].shape[2]
        if more <= 0:
            return
        for cache in (dec.keys, dec.values):
            for i in range(len(cache)):
                cache[i] = F.pad(cache[i], (0, 0, 0, more))
        self.valid = F.pad(self.valid, (0, width - self.valid.shape[1]))
        self._new_segment()

    def _compact(self, live: int) -> None:
        """The rows still going into a batch of `bucket(live)` slots, layer by layer."""
        keep = self.going.nonzero().squeeze(-1)
        rows = bucket(live)
        slot = torch.cat([keep, keep[:1].expand(rows - live)])
        real = torch.arange(rows, device=slot.device) < live
        dec = self.decoder
        for cache in (dec.keys, dec.values):
            for i in range(len(cache)):
                cache[i] = cache[i].index_select(0, slot)
        self.row = torch.where(real, self.row[slot], len(self.lengths) - 1)
        self.going = self.going[slot] & real
        self.valid, self.logits, self.positions = self.valid[slot], self.logits[slot], self.positions[slot]
        self.budget = self.budget[slot]
        self.history = self.history[slot] if self.history is not None else None
        self._new_segment()
