"""Decoding on fixed shapes (`grpo.rollout.graphed`, the fast engine's loop on CUDA) against the shrinking-batch loop
the CPU runs: the same tokens from the same generator and log-probs within the device's tolerance, across sampling
settings, budgets, stop tokens and rows that finish at every step; a step that compiles with `fullgraph=True` (no
host sync inside it); the key/value cache's memory: never held twice when rows leave; and, emulated on the CPU, what
CUDA graphs need: a step replayed from a trace per segment (`make_fx`) across rollouts as the policy's weights
change, a failed capture remembered, no capture beside the learner's cache release or micro-step.

The tests marked `device` run on `on_device.device()`; on CUDA the fixed-shape loop replays CUDA graphs."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from grpo.algo.sampling import SamplingSettings
from grpo.data.prompts import tokenize_prompts
from grpo.rollout import graphed
from grpo.rollout.fast import FastEngine, logits_processors, sample_from
from grpo.rollout.graphed import StaticDecode, bucket
from grpo.rollout.lean_decoder import GROW, LeanDecoder
from support import on_device
from support.scripted import as_requests
from support.tiny import make_model, make_qwen3, make_tokenizer, with_lora


def setup(device, budgets=(150, 40, 7), family="llama", **kw):
    """Three prompts of different lengths, 5 samples each (15 rows: a batch of 16 with a spare slot), each request
    its own budget; one token stops a row (~1% a step here), so rows finish all along the rollout."""
    tok = make_tokenizer()
    model = (make_qwen3(tok) if family == "qwen3" else make_model(tok, hidden=64)).eval().to(device)
    args = SamplingSettings(max_completion_length=max(budgets), **kw)
    stop = [7]  # one token of the tiny vocabulary's 102
    chats = [[{"role": "user", "content": text}] for text in ("hi", "what is two plus two?", "count: one two three")]
    requests = as_requests([ids for ids in tokenize_prompts(chats, tok) for _ in range(5)])
    requests = [dataclasses.replace(r, max_tokens=b) for r, b in zip(requests, budgets)]
    return tok, model, args, stop, requests


def both(model, tok, args, stop, requests, seed=0, **kw):
    out = {}
    for static in (False, True):
        torch.manual_seed(seed)
        out[static] = FastEngine(model, tok, args, stop, static=static, **kw).generate(requests)
    return out[False], out[True]


def assert_same(eager, fixed):
    assert fixed.completion_ids == eager.completion_ids
    assert fixed.truncated == eager.truncated
    tolerance = on_device.float32_tolerance()
    for a, b in zip(eager.sampling_logps, fixed.sampling_logps):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), **tolerance)


SAMPLING = {
    "plain": {},
    "processed": dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05),
    "repetition": dict(repetition_penalty=1.3, temperature=0.9),
}


@on_device.mark
@pytest.mark.parametrize("sampling", SAMPLING)
def test_fixed_shapes_sample_what_the_shrinking_batch_samples(sampling):
    tok, model, args, stop, requests = setup(on_device.device(), **SAMPLING[sampling])
    eager, fixed = both(model, tok, args, stop, requests)
    lengths = [len(c) for c in eager.completion_ids]
    # rows end before the first look at the rows, between looks, and on their budgets (150, 40 and 7 tokens)
    assert min(lengths) < graphed.CHECK_EVERY < max(lengths) and any(t for t in eager.truncated)
    assert len(set(lengths)) > 6
    if sampling == "plain":
        assert max(lengths) > GROW  # the cache grew while rows were going
    assert_same(eager, fixed)
    # and the next rollout draws on from the same generator state
    torch.manual_seed(1)
    again_eager = FastEngine(model, tok, args, stop, static=False).generate(requests)
    torch.manual_seed(1)
    again_fixed = FastEngine(model, tok, args, stop, static=True).generate(requests)
    assert_same(again_eager, again_fixed)


@on_device.mark
def test_fixed_shapes_without_prefix_sharing_and_with_a_custom_sampler():
    tok, model, args, stop, requests = setup(on_device.device(), budgets=(30, 30, 30))
    assert_same(*both(model, tok, args, stop, requests, share_prefix=False))
    assert_same(*both(model, tok, args, stop, requests, sampler=lambda logprobs: logprobs.argmax(-1)))
    # a custom sampler gets the log-probs only: no uniform numbers are drawn for it
    torch.manual_seed(5)
    FastEngine(model, tok, args, stop, static=True, sampler=lambda lp: lp.argmax(-1)).generate(requests)
    after = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(1))


@on_device.mark
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@on_device.dtypes
def test_fixed_shape_sampling_logps_equal_training_logps(dtype, family):
    """The fixed-shape loop on bfloat16 weights against the training pass under bfloat16 autocast, as the trainer
    runs both (float32: the device's tolerance; bfloat16: 0.01 nats on average); Qwen3 with its query/key norms."""
    tok, model, args, stop, requests = setup(on_device.device(), budgets=(40, 20, 7), family=family, temperature=0.8)
    low = dtype if dtype == torch.bfloat16 else None
    torch.manual_seed(0)
    engine = FastEngine(model, tok, args, stop, compute_dtype=low, static=True)
    rollout = engine.generate(requests)
    on_device.assert_sampling_logps_match_training(model, tok.pad_token_id, rollout, args.temperature, dtype)


def test_the_step_compiles_whole_with_no_host_sync():
    """`fullgraph=True` refuses a graph break: reading a tensor's value on the host (.item(), .tolist(), a branch on
    a tensor, nonzero's data-dependent shape) inside the step would fail here. The compiled step samples the same
    rollout as the eager one."""
    tok, model, args, stop, requests = setup("cpu", budgets=(40, 20, 7), **SAMPLING["processed"])
    torch.manual_seed(0)
    eager = FastEngine(model, tok, args, stop, static=True).generate(requests)
    original = StaticDecode.__init__

    def compiled_init(self, *a, **kw):
        original(self, *a, **kw)
        self.step_fn = torch.compile(self._step, fullgraph=True, backend="eager", dynamic=False)

    torch._dynamo.reset()
    try:
        StaticDecode.__init__ = compiled_init
        torch.manual_seed(0)
        compiled = FastEngine(model, tok, args, stop, static=True).generate(requests)
    finally:
        StaticDecode.__init__ = original
        torch._dynamo.reset()
    assert_same(eager, compiled)


# ops that wait for the device inside their kernels (or read a value on the host), which a CUDA graph cannot hold
# and which would stall every eager step: none may run in the decode step
SYNCING = {
    "aten.nonzero.default",
    "aten.nonzero_static.default",
    "aten._local_scalar_dense.default",
    "aten.masked_select.default",
    "aten.item.default",
    "aten.unique_consecutive.default",
    "aten._unique2.default",
    "aten.repeat_interleave.Tensor",
    "aten.index.Tensor",  # boolean indexing (integer indexing goes through index_select in the step)
    "aten.index_put_.default accumulate",  # a sort, and a range check that may wait for the host
    "aten._assert_async.msg",
}


@pytest.mark.parametrize("sampling", SAMPLING)
def test_the_decode_step_runs_no_op_that_syncs_with_the_host(sampling):
    """A CPU emulation of what a CUDA graph capture refuses: every op of the step, recorded in a dispatch mode,
    is outside the denylist of ops that sync inside their kernels (the GPU audit's `index_put_(accumulate)`
    included), across growth, compaction and the history the repetition penalty reads."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
            seen.add(str(func) + (" accumulate" if "index_put" in str(func) and accumulate else ""))
            return func(*args, **kwargs)

    tok, model, args, stop, requests = setup("cpu", budgets=(40, 20, 7), **SAMPLING[sampling])
    original = StaticDecode.__init__

    def recorded_init(self, *a, **kw):
        original(self, *a, **kw)
        step = self._step

        def recorded():
            with Record():
                step()

        self.step_fn = recorded

    try:
        StaticDecode.__init__ = recorded_init
        torch.manual_seed(0)
        FastEngine(model, tok, args, stop, static=True).generate(requests)
    finally:
        StaticDecode.__init__ = original
    assert seen and not (seen & SYNCING), sorted(seen & SYNCING)


def test_row_buckets_and_uniform_numbers():
    assert [bucket(n) for n in (1, 2, 3, 8, 9, 255, 256, 257)] == [1, 2, 4, 8, 16, 256, 256, 512]
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    u = graphed.draw_uniforms(5, torch.device("cpu"), g1)
    assert u.shape == (graphed.CHECK_EVERY, 5) and u.dtype == torch.float64
    assert torch.equal(u, graphed.draw_uniforms(5, torch.device("cpu"), g2))
    # sample_from with the caller's numbers draws nothing itself
    logprobs = torch.log_softmax(torch.randn(5, 1000), -1)
    state = torch.get_rng_state()
    assert torch.equal(sample_from(logprobs, u[0, :, None]), sample_from(logprobs, u[0, :, None]))
    assert torch.equal(state, torch.get_rng_state())


def test_the_cache_grows_with_the_tokens_rows_need():
    """A 500-token budget whose rows stop within a few tokens: the eager loop's buffers stay one `GROW` past the
    prompt and grow by `GROW` columns when the tokens reach them; the fixed-shape loop's steps attend over the first
    multiple of `GROW` that holds the prompt and the tokens to come (its buffers are laid out for the budget, kept
    for the run)."""
    tok, model, args, stop, requests = setup("cpu", budgets=(500, 500, 500))
    ids = torch.tensor([requests[0].prompt.ids])
    mask = torch.ones_like(ids)
    dec = LeanDecoder(model, torch.float32)
    dec.prefill(ids, mask, torch.zeros(3, dtype=torch.long), max_new=500)
    assert dec.keys[0].shape[2] == ids.shape[1] + GROW
    token = torch.tensor([5, 6, 7])
    for _ in range(GROW + 3):
        dec.step(token)
    assert dec.keys[0].shape[2] == ids.shape[1] + 2 * GROW
    decode = StaticDecode(
        LeanDecoder(model, torch.float32), logits_processors(args), torch.tensor(stop), sample_from, False, None
    )
    budgets = torch.full((3,), 500)
    _, _, lengths = decode.run(ids, mask, torch.zeros(3, dtype=torch.long), budgets, 500, None, True)
    assert int(lengths.max()) < GROW - graphed.CHECK_EVERY  # every row stopped early
    assert (
        decode.width == graphed.columns(ids.shape[1] + graphed.CHECK_EVERY) and decode.keys[0].shape[2] == decode.width
    )
    assert decode.buffers.width == graphed.columns(ids.shape[1] + 500)


def test_finished_rows_never_hold_the_cache_twice():
    """Peak resident memory while finished rows leave a 320 MB cache (8 layers of 2 x 20 MB buffers): at most one
    layer's copy above the cache, in the shrinking batch (`LeanDecoder._keep`) and in the fixed-shape batch
    (`StaticDecode._compact`, in place in the buffers the engine keeps). Measured in a fresh process from VmHWM,
    reset just before."""
    script = textwrap.dedent(
        """
        import sys, torch
        from grpo.rollout.lean_decoder import LeanDecoder
        from grpo.rollout.graphed import Buffers, StaticDecode

        def status(key):
            with open("/proc/self/status") as f:
                return 1024 * int(next(line for line in f if line.startswith(key)).split()[1])

        shape = (64, 4, 320, 64)  # 64 rows, 20 MiB a buffer in float32
        layer = 4 * 64 * 4 * 320 * 64
        def caches():
            return [torch.ones(shape) for _ in range(8)], [torch.ones(shape) for _ in range(8)]
        keep = torch.arange(0, 64, 2)  # half the rows leave

        dec = LeanDecoder.__new__(LeanDecoder)
        dec.keys, dec.values = caches()
        dec.valid, dec.positions = torch.ones(64, 320, dtype=torch.bool), torch.zeros(64, 1, dtype=torch.long)
        dec.key_positions = None  # no sliding layers
        before = status("VmRSS:")
        open("/proc/self/clear_refs", "w").write("5")
        dec._keep(keep)
        print("shrinking", (status("VmHWM:") - before) / layer)

        static = StaticDecode.__new__(StaticDecode)
        static.buffers, static.with_history = Buffers(), False
        held = static.buffers
        held.keys, held.values = caches()
        going = torch.zeros(64, dtype=torch.bool)
        going[keep] = True
        held.rows, held.going, held.row = 64, going, torch.arange(64)
        held.valid, held.logits = torch.ones(64, 320, dtype=torch.bool), torch.zeros(64, 100)
        held.positions, held.budget = torch.zeros(64, 1, dtype=torch.long), torch.ones(64)
        held.tokens = held.logps = held.lengths = held.uniforms = held.t = held.start = held.stop_ids = torch.zeros(1)
        static._segment(64, 320)
        before = status("VmRSS:")
        open("/proc/self/clear_refs", "w").write("5")
        static._compact(32)
        print("fixed", (status("VmHWM:") - before) / layer)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    peaks = dict(line.split() for line in out.stdout.splitlines())
    # a copy of one layer's kept half is 0.5 layers; holding the whole cache twice would be 8 layers
    for path, peak in peaks.items():
        assert float(peak) < 1.5, (path, peak)


def test_a_one_token_prompt_decodes():
    """A prompt of one token (a bare BOS) runs the prompt pass, not a decode step's fused kernel, in both loops."""
    tok, model, args, stop, _ = setup("cpu", budgets=(12,))
    requests = as_requests([[tok.bos_token_id or 1]] * 4)
    for static in (False, True):
        rollout = FastEngine(model, tok, args, stop, static=static).generate(requests)
        assert len(rollout.completion_ids) == 4 and all(rollout.completion_ids)


def test_spare_slots_copy_a_real_row():
    """The slots past the rows (a batch of `bucket(rows)`) repeat the first row: finite logits, never read (they write
    into the buffers' last row)."""
    tok, model, args, stop, requests = setup("cpu", budgets=(5, 5, 5))
    decode = StaticDecode(
        LeanDecoder(model, torch.float32), logits_processors(args), torch.tensor(stop), sample_from, False, None
    )
    ids = torch.tensor([requests[0].prompt.ids])
    decode.prefill(ids, torch.ones_like(ids), torch.zeros(3, dtype=torch.long), torch.full((3,), 5), 5)
    assert len(decode.row) == 4 and decode.row.tolist() == [0, 1, 2, decode.buffers.rows] and decode.buffers.rows == 4
    assert decode.going.tolist() == [True, True, True, False]
    assert torch.isfinite(decode.logits).all()


class _FailingGraph:
    """A stand-in for torch.cuda.CUDAGraph whose capture fails, as a real one does on an op that cannot be captured
    (the CPU emulation of a CUDA-only path): it counts the captures tried and the pools they asked for."""

    tried: list = []

    def capture_begin(self, pool=None, capture_error_mode=None):
        _FailingGraph.tried.append(pool)
        raise RuntimeError("operation not permitted when stream is capturing")

    def capture_end(self):
        pass


class _Stream:
    made = 0

    def __init__(self):
        _Stream.made += 1

    def wait_stream(self, other):
        pass


def test_a_failed_capture_is_remembered_by_the_engine_one_warning_and_eager_from_then_on(monkeypatch, caplog):
    """The GPU audit: the fallback flag lived on a per-rollout object, so every rollout tried (and failed) a capture
    again, a fresh side stream each time. Now the engine's `Graphs` keeps the failure: one capture tried in the run,
    one warning, one side stream, and the same tokens as eager decoding in every rollout."""
    import contextlib

    _FailingGraph.tried, _Stream.made = [], 0
    monkeypatch.setattr(graphed, "graphs_here", lambda device: True)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FailingGraph)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    current = _Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool", 1))
    tok, model, args, stop, requests = setup("cpu", budgets=(20, 20, 20))
    engine = FastEngine(model, tok, args, stop, static=True)
    with caplog.at_level("WARNING", logger="grpo"):
        rollouts = []
        for seed in (0, 1, 2):
            torch.manual_seed(seed)
            rollouts.append(engine.generate(requests))
    warnings = [r for r in caplog.records if "could not be captured" in r.getMessage()]
    assert len(warnings) == 1 and _FailingGraph.tried == [("pool", 1)]  # one capture in three rollouts
    assert engine.graphs.failed and _Stream.made == 2  # the current stream and the one side stream
    monkeypatch.setattr(graphed, "graphs_here", lambda device: False)
    for seed, rollout in zip((0, 1, 2), rollouts):
        torch.manual_seed(seed)
        assert_same(FastEngine(model, tok, args, stop, static=True).generate(requests), rollout)


class _TracedGraphs(graphed.Graphs):
    """The CPU emulation of CUDA graphs: a segment's step traced with `make_fx` (every tensor it reads held by
    identity as a constant of the trace, every Python value baked in, as a CUDA graph holds the addresses and launch
    parameters it was captured with) and replayed for the rest of the segment and in every later rollout. Tracing
    runs the step, so the buffers are put back after it: a capture, as on CUDA, changes nothing. It records each
    capture's segment and the buffers' and weights' version it was captured on, and counts each graph's replays."""

    def __init__(self, buffers):
        super().__init__()
        self.buffers = buffers
        self.log: list = []  # (version, (rows, width)) of each capture
        self.replays: dict = {}

    def warm_up(self, step):
        step()
        self.warm = True

    def capture(self, key, step):
        self.segment = key
        return super().capture(key, step)

    def _record(self, step):
        from torch.fx.experimental.proxy_tensor import make_fx

        saved = [t.clone() for t in self.buffers.tensors()]
        traced = make_fx(lambda: step())()
        for tensor, before in zip(self.buffers.tensors(), saved):
            tensor.copy_(before)
        self.log.append(((self.buffers.version, self.buffers.held.version), self.segment))
        self.replays[len(self.log) - 1] = 0

        def replay(capture=len(self.log) - 1):
            self.replays[capture] += 1
            traced()

        return SimpleNamespace(replay=replay)


def traced_engine(model, tok, args, stop, monkeypatch, **kw):
    monkeypatch.setattr(graphed, "graphs_here", lambda device: True)
    engine = FastEngine(model, tok, args, stop, static=True, **kw)
    engine.graphs = _TracedGraphs(engine.buffers)
    return engine


def held_tensors(engine):
    """The addresses of everything the step reads: the buffers and the held weights."""
    return [t.data_ptr() for t in engine.buffers.tensors()] + [
        t.data_ptr() for t, _ in engine.buffers.held.kept.values()
    ]


@pytest.mark.parametrize("sampling", ["plain", "repetition"])
def test_traced_graphs_replayed_across_segments_and_rollouts_sample_what_eager_decoding_samples(sampling, monkeypatch):
    """The CPU emulation of CUDA graphs (`_TracedGraphs`): each (rows, width) segment's step traced once, replayed
    through the cache's growth (budgets past `GROW`), compaction (rows leaving: 16 slots, then 8, 4, ...) and the
    history the repetition penalty reads, then in the next rollout: the same tokens and log-probs as the
    shrinking-batch loop, no segment captured twice, none captured in the second rollout (the same requests and
    seed: the same segments), and every buffer and weight the step reads at the address it had."""
    tok, model, args, stop, requests = setup("cpu", budgets=(150, 40, 7), **SAMPLING[sampling])
    engine = traced_engine(model, tok, args, stop, monkeypatch)
    rollouts, addresses = [], []
    for _ in range(2):
        torch.manual_seed(0)
        rollouts.append(engine.generate(requests))
        addresses.append(held_tensors(engine))
    torch.manual_seed(0)
    eager = FastEngine(model, tok, args, stop, static=False).generate(requests)
    for rollout in rollouts:
        assert_same(eager, rollout)
    graphs = engine.graphs
    segments = set(graphs.captured)
    assert graphs.captures == len(graphs.log) == len(segments) > 3  # several segments, each captured once
    assert {rows for rows, _ in segments} >= {16, 8} and all(width % GROW == 0 for _, width in segments)
    if sampling == "plain":
        assert {width for _, width in segments} >= {GROW, 2 * GROW}  # the cache grew past GROW columns
    assert len({version for version, _ in graphs.log}) == 1  # nothing moved: one version of the buffers and weights
    assert all(count > 0 for count in graphs.replays.values())
    assert addresses[0] == addresses[1]


def _perturb(model, change):
    """The policy's weights between two rollouts: an optimizer's in-place update (of float32 or bfloat16 weights and
    a float32 head), a LoRA policy's adapters updated in place, or every parameter given a new tensor (an
    asynchronous run's snapshot takes each publication's)."""
    torch.manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if change == "lora" and "lora_" not in name:
                continue
            new = param + 0.05 * torch.randn_like(param)
            if change == "moved":
                param.data = new
            else:
                param.copy_(new)


@pytest.mark.parametrize(
    "change,dtype",
    [
        ("in place", torch.bfloat16),
        ("in place", torch.float32),
        ("fp32 head", torch.bfloat16),
        ("lora", torch.float32),
        ("moved", torch.float32),
    ],
    ids=["in place, bf16 compute", "in place", "bf16 weights, fp32 head", "lora", "moved"],
)
def test_replayed_graphs_read_the_policy_weights_of_now(change, dtype, monkeypatch):
    """Graphs captured in one rollout and replayed in the next read the weights the policy has then: the held copies
    (bfloat16 casts, q/k/v and gate/up stacked, LoRA's merged weights) refreshed in place, the parameters read as
    they are updated in place by the optimizer, and a parameter that moved copied from then on (its graphs captured
    again once). Each rollout samples what a fresh engine samples from the weights of now (the fixed-shape loop
    without graphs); a refresh skipped would leave the first rollout's weights in the replayed graphs."""
    tok, model, args, stop, requests = setup("cpu", budgets=(40, 20, 7))
    if change == "lora":
        model = with_lora(model, target_modules=["q_proj", "o_proj", "down_proj"]).eval()
    if change == "fp32 head":  # bfloat16 weights read as they are (o, down, norms), the float32 head's too
        from grpo.models.fp32_head import cast_lm_head_to_fp32

        model = model.to(torch.bfloat16)
        cast_lm_head_to_fp32(model)
    low = dtype if dtype == torch.bfloat16 else None
    engine = traced_engine(model, tok, args, stop, monkeypatch, compute_dtype=low)
    torch.manual_seed(0)
    engine.generate(requests)
    before = held_tensors(engine)
    graphs = engine.graphs
    captured = len(graphs.log)
    _perturb(model, change)
    for seed in (0, 1):
        torch.manual_seed(seed)
        replayed = engine.generate(requests)
        monkeypatch.setattr(graphed, "graphs_here", lambda device: False)
        torch.manual_seed(seed)
        fresh = FastEngine(model, tok, args, stop, static=True, compute_dtype=low).generate(requests)
        monkeypatch.setattr(graphed, "graphs_here", lambda device: True)
        assert_same(fresh, replayed)
    assert len(set(graphs.log)) == len(graphs.log)  # no segment captured twice on the same buffers and weights
    versions = [version for version, _ in graphs.log]
    if change == "moved":  # the parameters read as they were moved: copied, the graphs captured again once
        assert len(set(versions)) == 2 and versions[captured] != versions[0]
    else:
        assert set(versions) == {versions[0]} and held_tensors(engine) == before
        assert any(graphs.replays[i] for i in range(captured))  # the first rollout's graphs, replayed


def test_no_empty_cache_or_learner_micro_step_while_a_graph_is_captured(monkeypatch):
    """In an asynchronous run the producer captures graphs in its own thread while the learner trains. Emptying the
    allocator's cache (`torch_empty_cache_steps`) or a micro-step's compilation and autotuning (which synchronize the
    device) during a capture would break it: both wait for the capture to end (`allocator.DEVICE_WIDE`). A stand-in
    capture blocks until released; the learner's calls come after it ends."""
    import threading
    import time

    from grpo.perf import allocator
    from grpo.rounds.asynchronous import AsyncRounds

    events, started, release = [], threading.Event(), threading.Event()

    class Blocking(graphed.Graphs):
        def _record(self, step):
            events.append("capture begins")
            started.set()
            assert release.wait(10)
            events.append("capture ends")
            return SimpleNamespace(replay=lambda: None)

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    rounds = AsyncRounds.__new__(AsyncRounds)
    rounds.rng_lock, rounds.seed = threading.Lock(), 0

    def micro_step():
        with rounds.learning(1):
            events.append("micro-step")

    for learner_call in (lambda: allocator.release_cached_memory("cuda"), micro_step):
        events.clear()
        started.clear()
        release.clear()
        producer = threading.Thread(target=lambda: Blocking().capture((1, GROW), lambda: None))
        producer.start()
        assert started.wait(10)
        learner = threading.Thread(target=learner_call)
        learner.start()
        time.sleep(0.3)
        assert events == ["capture begins"]  # the learner waits
        release.set()
        producer.join(10)
        learner.join(10)
        assert events[:2] == ["capture begins", "capture ends"] and events[2] in ("empty_cache", "micro-step")


def test_decode_attention_scores_are_float32_as_in_training():
    """The fixed-shape step's attention in bfloat16: its scores are the float32 sums of the exact products of the
    bfloat16 queries and keys (as the training pass's attention kernels compute them), not products rounded to
    bfloat16 (8 bits a score: the GPU audit's wider gap between sampling and training log-probs). Against float64
    attention over the same bfloat16 numbers, the output is several times closer than with rounded scores."""
    from grpo.rollout.lean_ops import grouped_attention, scores

    g = torch.Generator().manual_seed(0)
    b, heads, kv_heads, width, d = 4, 8, 2, 64, 64
    q = (torch.randn(b, heads, 1, d, generator=g) * 4).bfloat16()
    keys, values = (torch.randn(b, kv_heads, width, d, generator=g).bfloat16() for _ in range(2))
    bias = torch.zeros(b, 1, 1, width).masked_fill_(torch.rand(b, 1, 1, width, generator=g) < 0.2, float("-inf"))
    grouped = q.reshape(b, kv_heads, heads // kv_heads, d)
    exact = grouped.double() @ keys.double().transpose(-1, -2)
    got = scores(grouped, keys)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-5)
    scale = d**-0.5

    def attention(s):  # the probabilities rounded to the values' dtype, as the step does
        p = (s * scale + bias).softmax(-1).to(torch.bfloat16).double()
        return (p @ values.double()).reshape(b, heads, 1, d)

    truth = attention(exact)
    rounded = attention(torch.matmul(grouped, keys.transpose(-1, -2)).double())  # bfloat16 products
    fp32 = (grouped_attention(q, keys, values, bias, scale).double() - truth).abs().mean()
    bf16 = (rounded - truth).abs().mean()
    assert fp32 * 3 < bf16, (fp32, bf16)
