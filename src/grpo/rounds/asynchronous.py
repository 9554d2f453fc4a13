"""Asynchronous generation (`async_generation=True`): a producer thread generates and scores the next rounds while
the learner trains, on the producer/learner seam of `grpo.rounds.producer`.

Deterministic bounded staleness. Rounds are numbered by data position q (a generation batch is one round, or
several with dynamic sampling). When the learner asks for round q it publishes its policy as publication q; round
q is sampled from publication max(q - s, 0), s = `max_staleness`. So round q always samples the same weights (the
learner's when it asked for round q - s), whatever the timing, and the producer runs at most s rounds ahead.
TRL's AsyncGRPOTrainer instead samples with whatever weights the server holds and drops samples more than
max_staleness weight syncs old: its runs depend on timing. With `weight_sync_steps` = k a publication reuses the
previous one's weights until k more optimizer steps have passed.

Everything else that could depend on timing is fixed too:
- the fast engine samples round q from its own generator seeded by (seed, q) (`grpo.rollout.fast.own_generator`),
  a vLLM server from its own; engines that draw from torch's global generator (transformers' generate, vLLM in
  this process) generate under a lock the learner's micro-steps also take, each section reseeding the global
  generator from its own position (so their rounds do not overlap the learner's micro-steps);
- reward functions get the trainer state of the publication that sampled the round;
- the producer samples a snapshot (a copy of the policy module, refreshed from each publication's weights), never
  the weights the learner is changing; evaluation pauses it and samples the learner's current weights.

Off-policy correction: the producer also scores each round with the training pass on the snapshot (the behaviour
policy's log-probs, `Rollout.behaviour_logps`), which the learner uses as old_logps: the configured loss's ratio
(clipping, IS weights, masks) is taken against the policy that sampled. The learner skips its own old-policy pass.

Exact resume: a checkpoint holds the publications that the rounds after it sample from (at most s weight
versions: `inflight_<rank>.json`, and `.tensors` in safetensors' format); the resumed producer generates those
rounds again from them, which gives the same rounds as before the interruption. No wait at save time, and
SIGKILL at any moment loses nothing the last checkpoint had.

No hang: an exception in the producer stops training with an error naming the round; a producer that makes no
progress (no token sampled, no reward or tool finished) for `heartbeat_stale_after_s` seconds stops it with one
that says so; SIGTERM reaches both threads (`grpo.base.sigterm`) and saves as the sequential loop does.

Several processes: each producer makes its process's share of a round from its own streams (seed + process
index) and makes no collective the learner's thread could interleave with, except over a group of its own: with
one vLLM server for all (one weight version at a time), the producers push in lockstep (before each weight change
they meet and stop together if one stops: `_lockstep`; then the main process's push, its version broadcast), a
producer that ends for any reason meets the others once more, and at the end they stop between rounds together
(`_drain`). A sharded policy (FSDP2,
ZeRO-3) is gathered whole for each publication; the snapshot is a whole copy made before sharding
(`grpo.models.build.prepare`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

from grpo.agent import Rollouts
from grpo.base import sigterm
from grpo.checkpoint import inflight
from grpo.checkpoint.inflight import Publication
from grpo.config import ResolvedConfig
from grpo.distributed import sharding
from grpo.learner.batch import collate
from grpo.learner.optimization import TrainingError
from grpo.perf import allocator
from grpo.rewards.calling import copy_state
from grpo.rollout.fast import own_generator
from grpo.rounds.groups import GenerationBatch
from grpo.rounds.producer import Produced, Producer
from grpo.rounds.sequential import Rounds, Sequential

logger = logging.getLogger("grpo")
POLL_S = 0.05
OWN_RANDOMNESS = ("fast", "vllm-server")  # engines whose sampling never draws from torch's global generator


@dataclass(frozen=True)
class Learner:
    """What async generation reads of the learner hosting it: its settings and processes, its sequential producer
    (rollouts, rewards, dataset and ranks, which the thread's producer copies; evaluation's, whose engine version is
    reset around pauses), the policy as prepared, the training pass (the behaviour policy's log-probs), the pad id,
    the loop position a checkpoint saves from, and a builder of an engine on another model (the snapshot)."""

    args: ResolvedConfig
    accelerator: Any
    producer: Producer
    policy: torch.nn.Module  # as prepared (DDP, FSDP2, DeepSpeed); unwrapped by the accelerator
    training_pass: Any  # `grpo.learner.forward.TrainingPass`
    pad_id: int
    loop: Any  # `grpo.learner.loop.LoopState`
    engine_on: Callable[[torch.nn.Module, ResolvedConfig], Any]  # (model, settings) -> an engine of the configured kind


def round_seed(seed: int, kind: str, position: int) -> int:
    """A 63-bit seed for (the run's seed, what draws, its position): independent streams per round and step."""
    return zlib.crc32(f"{kind}:{position}".encode()) << 31 ^ seed


class AsyncRounds(Rounds):
    """The producer thread and the learner's side of it (see the module docstring); a checkpoint component."""

    name = "in-flight rounds"

    def __init__(self, producer: Producer, model: torch.nn.Module, snapshot: torch.nn.Module, learner: Learner) -> None:
        a = learner.args
        super().__init__(producer, learner.accelerator)
        self.model, self.snapshot = model, snapshot
        self.shared_engine = producer.own_engine is None  # vLLM: the trainer's engine, also evaluation's
        self.outer = learner.producer  # evaluation's producer (its engine version is reset around pauses)
        self.training_pass = learner.training_pass.for_copy(snapshot)  # torch_compile: the snapshot's own
        self.pad_id, self.loop = learner.pad_id, learner.loop
        rank = learner.accelerator.process_index  # each process samples its own rows from its own streams (seed + rank)
        self.s, self.seed, self.sync_steps = a.max_staleness, a.seed + rank, a.weight_sync_steps
        self.stale_after, self.chunk = a.heartbeat_stale_after_s, a.per_device_train_batch_size
        self.pad_multiple, self.sampler_logps = a.pad_to_multiple_of, a.async_behaviour_logps == "sampler"
        # engines drawing from this process's global generator generate under the lock the learner's micro-steps take
        self.lock_rng = getattr(producer.engine, "name", "") not in OWN_RANDOMNESS
        self.file = f"inflight_{rank}"
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]  # what training changes
        self.cond = threading.Condition()
        self.rng_lock, self.engine_lock = threading.Lock(), threading.RLock()
        self.pubs: dict[int, Publication] = {}
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.rounds: dict[int, Produced] = {}
        self.next_weights, self.floor = 0, 0
        self.loaded: int | None = None  # the publication weights the snapshot holds (None: the policy's own)
        self.step: int | None = None  # the optimizer step whose first round was asked for last (`next`)
        self.error: BaseException | None = None
        self.doing, self.heartbeat = "starting", time.monotonic()
        self.stop, self.idle = threading.Event(), False
        self.voted = False  # this thread's producer took part in its group's decision to stop (`_lockstep`)
        self.thread: threading.Thread | None = None
        self.cores = torch.get_num_threads()
        # several processes on one server, which holds one weight version: the producers go in lockstep over a
        # group of their own (the default one is the learner's), and stop between rounds together
        several = learner.accelerator.num_processes > 1 and getattr(producer.engine, "name", "") == "vllm-server"
        self.group = torch.distributed.new_group(backend="gloo") if several else None

    # ---- the learner's side ----------------------------------------------------------------------------------

    def next(self, position: int, model: torch.nn.Module, version: int, state: Any) -> GenerationBatch:
        """`Rounds.next`; the first call of an optimizer step drops the rounds before `position` and the
        publications no round from it samples (a step preempted midway saves from the position it started at)."""
        if self.step != state.global_step:
            self.step = state.global_step
            self._drop_before(position)
        return super().next(position, model, version, state)

    def _take(self, position: int, model: torch.nn.Module, version: int, state: Any) -> Produced:
        """Publish the learner's policy for round `position`, then wait for the round (see the module docstring)."""
        self._publish(position, version, state)
        start = time.perf_counter()
        with self.cond:
            while position not in self.rounds:
                self._check(position)
                self.cond.wait(POLL_S)
            produced = self.rounds[position]
            pub = self.pubs[self._source(position)]
        waited = time.perf_counter() - start
        staleness = float(state.global_step - pub.step)  # optimizer steps between the sampling and trained policy
        timing = (
            ("sample/staleness_mean", staleness),
            ("sample/staleness_max", staleness),
            ("timing/learner_wait_s", waited),
            ("timing/producer_wait_s", produced.producer_wait_s),
        )
        return dataclasses.replace(produced, logged=produced.logged + timing)

    def _drop_before(self, position: int) -> None:
        with self.cond:
            needed = self._source(position)
            for p in [p for p in self.pubs if p < needed]:
                del self.pubs[p]
            for q in [q for q in self.rounds if q < position]:
                del self.rounds[q]
            used = {pub.weights for pub in self.pubs.values()}
            for key in [k for k in self.weights if k not in used]:
                del self.weights[key]

    @contextmanager
    def running(self, position: int) -> Iterator[None]:
        """The producer thread, from round `position`, for the block; the cores split between it and the learner
        (CPU); stopped at the next token on exit."""
        self.floor = position
        with sharding.full_parameters(self.model), torch.no_grad():  # what a resume loaded, frozen parts included
            mine = dict(self.snapshot.named_parameters()) | dict(self.snapshot.named_buffers())
            for name, value in [*self.model.named_parameters(), *self.model.named_buffers()]:
                if self.loaded is None:
                    mine[name].copy_(value)
                else:  # its parameters hold a publication's tensors (`_load`), which stay as they are
                    mine[name].data = value.detach().clone()
        self.loaded = None
        self.stop.clear()
        self.voted = False
        self._beat()
        learner = max(self.cores // 2, 1)
        thread = threading.Thread(target=self._run, args=(position, max(self.cores - learner, 1)), daemon=True)
        thread.name, self.thread = "grpo-producer", thread
        torch.set_num_threads(learner)
        thread.start()
        try:
            yield
            self._drain()  # several processes on one server: every producer ends after the same round
        finally:
            self.halt()
            torch.set_num_threads(self.cores)

    def halt(self) -> None:
        """Stop the producer thread and wait for it (it stops at its next token or check; one stuck in user code
        past 10 s is left as a daemon, said in a warning): no thread of it runs Python while the processes settle
        and the process group is torn down (gloo's teardown needs the GIL free: `settle_processes`)."""
        self.stop.set()
        with self.cond:
            self.cond.notify_all()
        thread = self.thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout=10)
        if thread.is_alive():
            logger.warning("The rollout producer did not stop within 10 s (%s); leaving it as a daemon.", self.doing)

    @contextmanager
    def paused(self, step: int) -> Iterator[None]:
        """Evaluation: the producer after every round the publications allow (so the reward functions are called
        in the same order whatever the timing: a stateful one gives the same run), the global generator seeded
        from the step."""
        if self._drain(always=True):  # and every process's: none generates any more when evaluation pushes
            torch.distributed.barrier()
        with self.engine_lock, self.rng_lock:
            if self.shared_engine:
                self.outer.version = None  # the engine holds the producer's snapshot now
            torch.manual_seed(round_seed(self.seed, "eval", step))
            try:
                yield
            finally:
                if self.shared_engine:
                    self.producer.version = None  # evaluation pushed the learner's weights
                self._beat()  # the producer waited for the evaluation: not a stall

    @contextmanager
    def learning(self, micro_step: int) -> Iterator[None]:
        """A micro-step's forward and backward: the global generator seeded from its position (dropout); never while
        the producer captures a CUDA graph (`allocator.DEVICE_WIDE`: a compiled pass's autotuning synchronizes the
        device, and an allocation's retry frees cached blocks, either of which a capture under way forbids)."""
        with self.rng_lock, allocator.DEVICE_WIDE:
            torch.manual_seed(round_seed(self.seed, "learn", micro_step))
            yield

    def _drain(self, always: bool = False) -> bool:
        """Wait until this process's producer has made every round the publications allow and waits for the next
        one: with producers in lockstep (`self.group`) every process's then does, so none is in a generation or a
        push, and an evaluation may push the learner's weights, and training may end, without a process's producer
        left in a collective the others never join; `always` (an evaluation) waits without lockstep too. Returns
        whether the producers are in lockstep (the caller then waits for every process)."""
        if self.thread is None or (self.group is None and not always):
            return False
        with self.cond:
            while not self.idle and self.thread.is_alive():
                self._check(None)  # its error, SIGTERM or stall
                self.cond.wait(POLL_S)
        return self.group is not None

    def _publish(self, position: int, version: int, state: Any) -> None:
        with self.cond:
            if position in self.pubs:
                return
            last = self.pubs[max(self.pubs)] if self.pubs else None
        k = self.sync_steps  # weight_sync_steps > 1: the weights of the first round asked for in each k steps
        same = last is not None and (last.version == version or (k > 1 and last.step // k == state.global_step // k))
        if last is not None and same:
            key = last.weights
        else:
            with sharding.full_parameters(self.model):  # a sharded learner: gathered whole (every process)
                params = dict(self.model.named_parameters())
                weights = {name: params[name].detach().clone() for name in self.names}
            if weights and next(iter(weights.values())).is_cuda:  # the producer reads them on its own stream
                torch.cuda.current_stream().synchronize()
            with self.cond:
                key, self.next_weights = self.next_weights, self.next_weights + 1
                self.weights[key] = weights
        with self.cond:
            self.pubs[position] = Publication(key, version, state.global_step, copy_state(state))
            self.idle = False  # until the producer has looked: it may now have a round to make
            self.cond.notify_all()

    def _check(self, position: int | None) -> None:
        """While the learner waits for round `position`: the producer's error, death or stall is the run's."""
        if self.error is not None:
            raise TrainingError(
                f"The rollout producer failed while {self.doing}: {type(self.error).__name__}: {self.error}"
            ) from self.error
        sigterm.check()
        if self.thread is None or not self.thread.is_alive():
            what = f"producing round {position}" if position is not None else "its last round"
            raise TrainingError(f"The rollout producer stopped before {what} ({self.doing}).")
        idle = time.monotonic() - self.heartbeat
        if idle > self.stale_after:
            self.stop.set()
            raise TrainingError(
                f"The rollout producer made no progress for {idle:.0f} s while {self.doing} (heartbeat_stale_after_s="
                f"{self.stale_after:g}): a generation, reward function or tool that hangs. Fix it, or raise "
                "heartbeat_stale_after_s if it is only slow."
            )

    def _source(self, q: int) -> int:
        """The publication round q samples (the first this process made, for rounds whose one came before it and
        was not restored)."""
        p = max(q - self.s, 0)
        return p if p >= self.floor or p in self.pubs else self.floor

    # ---- the producer thread ---------------------------------------------------------------------------------

    def _run(self, first: int, threads: int) -> None:
        torch.set_num_threads(threads)
        sigterm.watch(self.stop, self._beat)
        device = next(self.snapshot.parameters()).device
        # on a GPU the producer's kernels go to a stream of their own, so they can overlap the learner's
        stream = torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else nullcontext()
        try:
            with stream:
                self._rounds_from(first)
        except (sigterm.Cancelled, sigterm.Preempted):
            pass
        except BaseException as error:  # noqa: BLE001 (the learner raises it, naming the round)
            with self.cond:
                self.error = error
                self.cond.notify_all()
        finally:
            if self.group is not None and not self.voted:  # the others' producers stop at their lockstep point too
                try:
                    self._lockstep(stop=True)
                except sigterm.Cancelled:
                    pass

    def _rounds_from(self, q: int) -> None:
        while True:
            pub = self._wait_publication(q)
            self.doing = f"generating round {q} (data position {q})"
            produced = self._produce(q, pub)
            with self.cond:
                self.rounds[q] = produced
                self.cond.notify_all()
            q += 1

    def _beat(self) -> None:
        self.heartbeat = time.monotonic()

    def _lockstep(self, stop: bool) -> None:
        """Producers in lockstep (one server for all, `self.group`) meet here before each weight change, and a
        producer that ends for any reason (stopped mid-round, an error) comes here once more on its way out: each
        says whether it stops, and all stop (`sigterm.Cancelled`) if one does. So no producer is ever left waiting in
        a collective that another process's producer will not join (the process group could not be torn down)."""
        flag = torch.tensor([int(stop or self.stop.is_set())])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group)
        if flag.item():
            self.voted = True
            raise sigterm.Cancelled("stopped")

    def _wait_publication(self, q: int) -> Publication:
        start = time.perf_counter()
        self.doing = f"waiting for the learner's weights for round {q}"
        with self.cond:
            while self._source(q) not in self.pubs:
                if self.stop.is_set():
                    raise sigterm.Cancelled("stopped")
                self.idle = True
                self.cond.notify_all()
                self.cond.wait(POLL_S)
                self._beat()  # waiting for the learner is not a stall
            self.idle = False
            pub = self.pubs[self._source(q)]
        self.waited = time.perf_counter() - start
        return pub

    def _produce(self, q: int, pub: Publication) -> Produced:
        self._beat()
        with self.engine_lock:
            self._load(pub.weights)
            device = next(self.snapshot.parameters()).device
            generator = torch.Generator(device=device).manual_seed(round_seed(self.seed, "round", q))
            with own_generator(generator), self.rng_lock if self.lock_rng else nullcontext():
                if self.lock_rng:
                    torch.manual_seed(round_seed(self.seed, "round", q))
                # async_behaviour_logps: the training pass's, or the sampler's; rewards see the publication's state
                produced = self.producer.produce(q, pub.state, self._behaviour)
                if device.type == "cuda":  # the round's tensors complete before the learner's stream reads them
                    torch.cuda.current_stream(device).synchronize()
        return dataclasses.replace(produced, version=pub.version, producer_wait_s=self.waited)

    def _load(self, key: int) -> None:
        """The snapshot holds weights `key` (and the engine samples them): its parameters take the publication's
        tensors themselves, not a copy (never written to: a publication's weights are its own clone), so the
        snapshot costs no memory of its own beside the publications."""
        if self.loaded != key:
            with self.cond:
                weights = self.weights[key]
            params = dict(self.snapshot.named_parameters())
            for name, value in weights.items():
                params[name].data = value
            self.loaded = key
        if self.group is not None and self.producer.version != key:  # every process done with the server's weights
            self._lockstep(stop=False)
        self.producer.sync(self.snapshot, key, self.group)  # vLLM: pushed; grpo's own engines sample the snapshot

    def _behaviour(self, rollout: Any) -> list[torch.Tensor | None]:
        """The sampling policy's log-probs of each row (the learner's old_logps): by the training pass on the
        snapshot, or the engine's own (0 where it scored no token: masked positions, never trained). A tensor per
        row, its own copy (a row sent to another process carries no more than itself)."""
        if self.sampler_logps:
            return [torch.tensor(row, dtype=torch.float32).nan_to_num(0.0) for row in rollout.sampling_logps]
        if not len(rollout):
            return []
        batch = collate(rollout, torch.zeros(len(rollout)), self.pad_id, False, pad_to_multiple_of=self.pad_multiple)
        device = next(self.snapshot.parameters()).device
        logps = self.training_pass.logps(self.snapshot, batch.to(device), self.chunk).float().cpu()
        return [logps[i, : len(ids)].clone() for i, ids in enumerate(rollout.completion_ids)]

    # ---- checkpoints (a StateComponent) ----------------------------------------------------------------------

    def save(self, directory: str) -> None:
        """The publications the rounds after the checkpoint sample from (regenerated from them on resume)."""
        position = self.loop.data_position
        with self.cond:
            wanted = {self._source(q) for q in range(position, position + self.s)}
            pubs = {p: self.pubs[p] for p in sorted(wanted) if p in self.pubs}
            weights = {k: self.weights[k] for k in {pub.weights for pub in pubs.values()}}
        inflight.write(directory, self.file, self.s, position, pubs, weights)

    def read(self, checkpoint: str, state: dict[str, Any]) -> Any:
        params = dict(self.snapshot.named_parameters())  # whole, where the learner's may be sharded
        named = {name: params[name] for name in self.names}
        return inflight.read(checkpoint, self.file, self.s, named, state["data_position"])

    def restore(self, value: Any) -> None:
        if value is None:
            return
        pubs, weights = value
        with self.cond:
            renumber = {}
            for key, tensors in weights.items():
                renumber[key], self.next_weights = self.next_weights, self.next_weights + 1
                self.weights[renumber[key]] = tensors
            for p, pub in pubs.items():  # versions are the saving process's numbers: never this one's
                self.pubs[p] = dataclasses.replace(pub, weights=renumber[pub.weights], version=None)


def refuse(learner: Learner) -> None:
    """What async generation does not do yet, as one error naming the setting."""
    a, acc = learner.args, learner.accelerator
    reasons = []
    tp = a.vllm_tensor_parallel_size
    if acc.num_processes > 1 and a.use_vllm and a.vllm_mode == "colocate" and tp > 1:
        reasons.append(  # the engine's shards generate together: collectives a producer thread cannot join
            f"vllm_tensor_parallel_size={tp} with {acc.num_processes} processes (an engine split across processes; "
            "an engine per process, or a vLLM server, runs async on several)"
        )
    if any(isinstance(m, FSDP1) for m in learner.policy.modules()):
        reasons.append("FSDP1 (its wrappers rename the parameters; fsdp_version 2, or DeepSpeed, runs async)")
    if reasons:
        raise ValueError(f"async_generation=True does not support {' and '.join(reasons)}: set async_generation=False.")


def local(rollouts: Rollouts) -> Rollouts:
    """The rollouts for a producer thread: a tool loop that goes on while this process has rows with tool calls
    (the trainer's asks every process, a collective that only the learner's thread may make)."""
    if rollouts.loop is None:
        return rollouts
    mine = copy.copy(rollouts)
    mine.loop = copy.copy(rollouts.loop)
    mine.loop.any_process = bool
    return mine


def rounds_of(learner: Learner, snapshot: torch.nn.Module | None = None) -> Rounds:
    """The learner's source of rounds: the sequential one, or a producer thread with its own snapshot of the policy
    (`snapshot`, a whole copy made before FSDP or DeepSpeed sharded the policy; None: a copy of the policy) and its
    own engine, except vLLM's, which it shares with evaluation."""
    a, p = learner.args, learner.producer
    if not a.async_generation:
        return Sequential(p, learner.accelerator)
    refuse(learner)
    model = learner.accelerator.unwrap_model(learner.policy)
    if snapshot is None:
        snapshot = copy.deepcopy(model).eval().requires_grad_(False)
    engine = None if a.use_vllm else learner.engine_on(snapshot, a)
    ranks = p.process_index, p.num_processes
    producer = Producer(local(p.rollouts), p.rewards, p.dataset, p.args, *ranks, p.trainer_state, engine)
    return AsyncRounds(producer, model, snapshot, learner)
