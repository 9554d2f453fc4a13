"""grpo's `gloo` weight-transfer engine for vLLM: weights from a trainer to a vLLM server over a torch.distributed
gloo group (`grpo.serve.gloo`), for servers and trainers on CPUs, where vLLM's own engines (NCCL, CUDA IPC) do
not run.

It is registered with vLLM's two registries (`WeightTransferEngineFactory` for the server's workers,
`WeightTransferTrainerFactory` for the trainer) by `register`, which vLLM calls in each of its processes through
the `vllm.general_plugins` entry point of grpo's package (installed with grpo), so a stock server takes it:

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model M \\
        --weight-transfer-config '{"backend": "gloo"}'           # grpo vllm-serve does this on a CPU

A push is vLLM's round trip (`/start_weight_update`, `/update_weights` while rank 0 broadcasts,
`/finish_weight_update`); on top of vLLM's contract:
- the connection belongs to one run: `/init_weight_transfer_engine` names it (`run`, and a random `session`), every
  update carries the session, and an update of another session (a run whose connection a later run took over) is
  refused before anything is received, naming the run that holds it;
- the server's model is checked against the trainer's (`model`: vocabulary, width, depth) when the run connects;
- after the load, what vLLM's CPU backend packs once is packed again from the new values (`vllm_reload.repack`).

vLLM is imported when an engine is built or registered, never by importing this module (a trainer that never
talks to a server does not import vLLM); the classes are built once, on first use (`engines`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
from types import SimpleNamespace
from typing import Any, ClassVar

import torch

from grpo.serve import gloo
from grpo.serve.vllm_reload import repack

logger = logging.getLogger("grpo")

BACKEND = "gloo"
# the model facts a run and a server must agree on (the trainer sends its policy's; the server compares its own)
MODEL_FACTS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")


def register() -> None:
    """vLLM's plugin entry point: register the `gloo` engines (worker and trainer side), once per process."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    classes = engines()
    for factory, cls in (
        (WeightTransferEngineFactory, classes.Worker),
        (WeightTransferTrainerFactory, classes.Trainer),
    ):
        try:
            factory.register_engine(BACKEND, cls)
        except ValueError:  # registered already (this process loaded the plugin before)
            pass


def model_facts(config: Any) -> dict:
    """The facts of a Hugging Face config (its text part) that `MODEL_FACTS` names."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {name: getattr(text, name, None) for name in MODEL_FACTS}


@functools.cache
def engines() -> SimpleNamespace:
    """The engine classes (built on first use, when vLLM is imported): `Worker` (a server's) with its init and
    update infos, `Trainer` (a run's) with its init info, and `Source` (a push's weights)."""
    return SimpleNamespace(**_worker_classes(), **_trainer_classes(), Source=_source_class())


def _worker_classes() -> dict:
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.logger import init_logger
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    worker_logger = init_logger("vllm.grpo")  # vLLM's handlers: the line reaches the server's log

    @dataclasses.dataclass
    class GlooInitInfo(WeightTransferInitInfo):
        """What a server's worker needs to join a run's group (rank 0: the run's sender)."""

        master_address: str
        master_port: int
        rank_offset: int
        world_size: int
        session: str
        run: str = ""
        timeout_s: float = 240.0
        model: dict = dataclasses.field(default_factory=dict)

    @dataclasses.dataclass
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        """One push: every tensor's name, wire dtype and shape, in the order rank 0 sends them."""

        names: list
        dtype_names: list
        shapes: list
        session: str = ""

        def __post_init__(self) -> None:
            if not len(self.names) == len(self.dtype_names) == len(self.shapes):
                raise ValueError("names, dtype_names and shapes must have one entry per tensor")

    class GlooWeightTransferEngine(WeightTransferEngine):
        """A server worker's side: joins the run's group, receives each push into the model."""

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model) -> None:
            super().__init__(config, vllm_config, device, model)
            self.link: Any = None  # gloo.Link
            self.session, self.run = "", ""

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            self._check_model(init_info)
            self.shutdown()  # a run connecting takes the connection over
            parallel = self.parallel_config
            rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
            self.link = gloo.connect(
                init_info.master_address,
                init_info.master_port,
                rank,
                init_info.world_size,
                init_info.session,
                init_info.timeout_s,
            )
            self.session, self.run = init_info.session, init_info.run
            worker_logger.info(
                "Weight transfer (gloo): connected to run %s as rank %d, weights through %s.",
                init_info.run,
                rank,
                self.link.transport,
            )

        def _check_model(self, init_info: GlooInitInfo) -> None:
            mine = model_facts(self.model_config.hf_config)
            theirs = {k: v for k, v in init_info.model.items() if k in mine and v is not None}
            differ = {k: (v, mine[k]) for k, v in theirs.items() if mine[k] is not None and mine[k] != v}
            if differ:
                detail = ", ".join(f"{k} {v[0]!r} (this server: {v[1]!r})" for k, v in differ.items())
                raise ValueError(
                    f"run {init_info.run!r} trains another model than this server serves "
                    f"({self.model_config.model}): {detail}. Start the server with the policy's model."
                )

        def start_weight_update(self) -> None:
            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            if self.link is None:
                raise RuntimeError("no run is connected: /init_weight_transfer_engine comes first")
            if update_info.session != self.session:
                raise ValueError(
                    f"this server's weight transfer belongs to run {self.run!r}, which connected after the run "
                    "pushing now: one server takes one run's weights at a time"
                )
            metadata = [
                (name, getattr(torch, dtype), tuple(shape))
                for name, dtype, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes)
            ]
            model: Any = self.model
            # vLLM's layerwise reload keeps a layer's tensors until the layer is whole: `load` keeps what it gets
            gloo.receive(self.link, metadata, model.load_weights, keep=True)

        def finish_weight_update(self) -> None:
            finalize_layerwise_reload(self.model, self.model_config)
            tied = bool(getattr(self.model_config.hf_text_config, "tie_word_embeddings", False))
            repack(self.model, tied)

        def shutdown(self) -> None:
            if self.link is not None:
                self.link.shutdown()
            self.link = None

    return dict(Worker=GlooWeightTransferEngine, InitInfo=GlooInitInfo, UpdateInfo=GlooUpdateInfo)


def _trainer_classes() -> dict:
    from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

    @dataclasses.dataclass
    class GlooTrainerInitInfo(TrainerInitInfo):
        """The trainer's side: its group's store (`master_address`: where the server's workers reach this
        process, `master_port`), the group's size (1 + the server's workers), the run and its model facts."""

        backend: ClassVar[str] = BACKEND

        master_address: str
        master_port: int
        world_size: int
        session: str
        run: str = ""
        timeout_s: float = 240.0
        model: dict = dataclasses.field(default_factory=dict)
        peer: str = ""  # the server's address (the interface this process's device binds to reaches it)

    class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine):
        """A run's side: opens the group with the server's workers, and broadcasts each push (rank 0).

        A push that the server refuses (another run took the connection over) or that fails midway is an error
        here as soon as the server answers, never a wait on a broadcast nobody receives: the broadcast runs on a
        thread of its own and the group is shut down when the server's answer is an error."""

        init_info_cls = GlooTrainerInitInfo

        def __init__(self, *, client, source, link, session) -> None:
            super().__init__(client=client, source=source, is_sender=True)
            self.link, self.session = link, session

        @classmethod
        def trainer_init(cls, init_info, *, client, source=None):
            worker_info = dict(
                master_address=init_info.master_address,
                master_port=init_info.master_port,
                rank_offset=1,
                world_size=init_info.world_size,
                session=init_info.session,
                run=init_info.run,
                timeout_s=init_info.timeout_s,
                model=init_info.model,
            )
            answered = _background(client.init_weight_transfer_engine, worker_info)
            link = _racing(
                answered,
                lambda cancelled: gloo.connect(
                    init_info.master_address,
                    init_info.master_port,
                    0,
                    init_info.world_size,
                    init_info.session,
                    init_info.timeout_s,
                    peer=init_info.peer or None,
                    cancelled=cancelled,
                ),
            )
            logger.info("Weight transfer (gloo): connected to the server, weights through %s.", link.transport)
            return cls(client=client, source=source, link=link, session=init_info.session)

        def send_weights(self) -> None:
            source: Any = self.source  # a PushSource (`uncast`)
            assert source is not None  # a full-resync engine: trainer_engine gives it its source
            meta = source.metadata()
            metadata = [(m.name, m.dtype, tuple(m.shape)) for m in meta]
            update = dict(
                names=[m.name for m in meta],
                dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                shapes=[list(m.shape) for m in meta],
                session=self.session,
            )
            self.client.start_weight_update()
            answered = _background(self.client.update_weights, update)
            try:
                # grpo's own source hands its tensors uncast (the wire casts each into its place); another casts them
                pairs = source.uncast() if hasattr(source, "uncast") else iter(source)
                _racing(answered, lambda cancelled: gloo.send(self.link, pairs, metadata))
            except BaseException:
                self.shutdown()  # the server gave up on this push (or the broadcast failed): no receiver
                raise
            self.client.finish_weight_update()

        def shutdown(self) -> None:
            if self.link is not None:
                self.link.shutdown()
            self.link = None

    return dict(Trainer=GlooTrainerWeightTransferEngine, TrainerInitInfo=GlooTrainerInitInfo)


def _source_class() -> type:
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class PushSource(WeightSource):
        """The weights of one push: (name, tensor) pairs, floating-point ones sent in the server's dtype (cast one
        by one as they are sent)."""

        def __init__(self) -> None:
            self.pairs: list = []
            self.dtype: torch.dtype = torch.float32

        def fill(self, pairs: list, dtype: torch.dtype) -> None:
            self.pairs, self.dtype = pairs, dtype

        def _wire(self, tensor: torch.Tensor) -> torch.dtype:
            return self.dtype if tensor.is_floating_point() else tensor.dtype

        def metadata(self) -> list:
            return [ParamMeta(name, self._wire(t), tuple(t.shape)) for name, t in self.pairs]

        def __iter__(self):
            for name, tensor in self.pairs:
                yield name, tensor.detach().to(self._wire(tensor))

        def uncast(self):
            """The pairs as they are (grpo's wire casts each straight into its place: no copy in between)."""
            for name, tensor in self.pairs:
                yield name, tensor.detach()

    return PushSource


def _background(call: Any, *args: Any) -> concurrent.futures.Future:
    """`call(*args)` on a daemon thread (a request to a server that may never answer must not hold the process's
    exit, as an executor's thread would)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(call(*args))
        except BaseException as err:  # handed to the future's reader
            future.set_exception(err)

    threading.Thread(target=run, daemon=True, name="grpo-weight-transfer-request").start()
    return future


def _racing(answered: concurrent.futures.Future, work: Any) -> Any:
    """`work(cancelled)`'s result, run on a thread of its own while the server answers the request behind
    `answered`: the server's error is raised as soon as it comes, and so is the work's. Both must succeed. On the
    server's error `cancelled` (a threading.Event) is set: a connection ends at once (`gloo.connect`); a send,
    waiting on receivers that gave up, is left to the group's timeout (gloo's wait cannot be interrupted)."""
    outcome: dict[str, Any] = {}
    done, cancelled = threading.Event(), threading.Event()

    def run() -> None:
        try:
            outcome["value"] = work(cancelled)
        except BaseException as err:  # handed to the waiting thread
            outcome["error"] = err
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name="grpo-weight-transfer").start()
    while not done.wait(0.2):
        if answered.done() and answered.exception() is not None:
            cancelled.set()
            raise answered.exception()  # type: ignore[misc]
    if "error" in outcome:
        raise outcome["error"]
    answered.result()  # the server's answer (waits for it: the work is done on this side)
    return outcome["value"]


def trainer_engine(backend: str, client: Any, **info: Any) -> tuple[Any, Any]:
    """A run's trainer-side engine for a server whose weight-transfer backend is `backend` ("gloo": grpo's;
    "nccl": vLLM's own, packed, which needs this process's CUDA device), connected through `client` (a
    `VLLMWeightSyncClient`), and the source each push fills (`source.fill(pairs, dtype)` before `send_weights`).
    `info`: master_address, master_port, world_size, session, run, timeout_s, model, peer."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    register()
    classes = engines()
    if backend == BACKEND:
        init_info = classes.TrainerInitInfo(rank=0, **info)
    elif backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        keys = ("master_address", "master_port", "world_size")
        init_info = NCCLTrainerInitInfo(rank=0, packed=True, **{k: info[k] for k in keys})
    else:
        raise ValueError(f"weight-transfer backend {backend!r} is not one grpo drives (gloo, nccl)")
    source = classes.Source()
    return WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source), source


def completion_fields() -> set[str]:
    """The fields of vLLM's /v1/completions request (what server mode's generation_kwargs may set)."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return set(CompletionRequest.model_fields)
