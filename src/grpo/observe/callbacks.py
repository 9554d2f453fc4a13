"""transformers `TrainerCallback`s, fired where and in the order the HF Trainer fires them, through transformers' own
`CallbackHandler` (so a callback gets the same `(args, state, control)` and keywords: model, processing_class,
optimizer, lr_scheduler, train_dataloader=None, eval_dataloader=None, plus logs / metrics where the event has them).

    init end
    train begin -> [evaluate: eval_on_start]
      epoch begin
        step begin -> substep end (each micro-step but the last) -> pre-optimizer step -> optimizer step -> step end
        -> log -> evaluate -> save
      epoch end
    train end

What callbacks set in `control` is honoured: `should_training_stop` ends the run after the step; `should_log`,
`should_evaluate` and `should_save` log, evaluate and save at that step whatever the strategies say. Stateful
callbacks (`ExportableState`) are saved in checkpoints and restored with restore_callback_states_from_checkpoint.
The HF Trainer's own default callbacks (progress bars, tracker integrations, the flow callback that turns
logging_steps etc. into control flags) are not added: grpo's loop does those itself, and `report_to` trackers are
logged through accelerate.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler, ExportableState, TrainerControl
from transformers.utils import logging as hf_logging

from grpo.config import ResolvedConfig


class Callbacks:
    def __init__(self, callbacks: Any, model: Any, processing_class: Any, optimizer: Any, lr_scheduler: Any) -> None:
        callbacks = list(callbacks or [])
        for callback in callbacks:
            check(callback)
        quiet = hf_logging.get_logger("transformers.trainer_callback")
        level = quiet.level
        quiet.setLevel(hf_logging.ERROR)  # its warning that the HF Trainer's DefaultFlowCallback is missing
        try:
            self.handler = CallbackHandler(callbacks, model, processing_class, optimizer, lr_scheduler)
        finally:
            quiet.setLevel(level)
        self.control = TrainerControl()

    def fire(self, event: str, args: ResolvedConfig, state: Any, **kwargs: Any) -> TrainerControl:
        """Call every callback's `on_<event>`; returns the control, updated."""
        self.control = getattr(self.handler, f"on_{event}")(args, state, self.control, **kwargs)
        return self.control

    def add(self, callback: Any) -> None:
        check(callback)
        self.handler.add_callback(callback)

    def pop(self, callback: Any) -> Any:
        return self.handler.pop_callback(callback)

    def remove(self, callback: Any) -> None:
        self.handler.remove_callback(callback)

    @property
    def callbacks(self) -> list:
        return self.handler.callbacks

    def states(self) -> dict[str, dict]:
        """The stateful callbacks' states (transformers' ExportableState, e.g. EarlyStoppingCallback's patience
        counter), by class name, for checkpoints (trainer_state.json "stateful_callbacks", as the HF Trainer)."""
        return {type(cb).__name__: cb.state() for cb in self.callbacks if isinstance(cb, ExportableState)}

    def restore(self, saved: dict[str, Any]) -> None:
        """restore_callback_states_from_checkpoint: each stateful callback rebuilt from its saved arguments and
        attributes (a callback the checkpoint has no state for keeps its own)."""
        for i, callback in enumerate(self.callbacks):
            state = saved.get(type(callback).__name__) if isinstance(callback, ExportableState) else None
            if isinstance(state, dict) and isinstance(state.get("args"), dict):
                fresh = type(callback)(**state["args"])
                for name, value in (state.get("attributes") or {}).items():
                    setattr(fresh, name, value)
                self.handler.callbacks[i] = fresh


def check(callback: Any) -> None:
    """A TrainerCallback instance or class (as transformers takes); anything else is one clear error."""
    is_class = isinstance(callback, type) and issubclass(callback, TrainerCallback)
    if not (is_class or isinstance(callback, TrainerCallback)):
        raise TypeError(
            f"callbacks: {callback!r:.80} is not a transformers.TrainerCallback (or subclass); callbacks subclass "
            "TrainerCallback and override its on_<event> methods."
        )
