"""`environment_factory` (TRL 1.16, shared spec §6.3): one environment instance per rollout, whose public methods
are the rollout's tools and whose `get_reward()` scores it.

    class Game:
        def reset(self, **row) -> str | None: ...      # required: start a rollout from its dataset row
        def guess(self, word: str) -> str: ...        # public methods are tools (type hints + docstring)
        def get_reward(self) -> float: ...            # optional: an extra reward function, named "Game"

`environment_factory` is a zero-argument callable, or a dict name -> callable with the row's `environment` column
choosing. Instances are pooled: each generation round hands every rollout (the G samples of a prompt included) an
instance of its environment, creating more only when a round needs more at once, and `reset(**row)` starts it; a
string (or content blocks) it returns is appended to the prompt's last message.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from grpo.agent.tools import Tool, ToolSet, make_tool
from grpo.config import ResolvedConfig

EMPTY_PROMPT = ({"role": "user", "content": ""},)


class Environments:
    def __init__(self, factory: Callable | dict[str, Callable]) -> None:
        self.routed = isinstance(factory, dict)
        self.factories: dict[Any, Callable] = dict(factory) if isinstance(factory, dict) else {None: factory}
        if not self.factories or not all(callable(f) for f in self.factories.values()):
            raise ValueError(
                "environment_factory must be a zero-argument callable that returns an environment, or a dict "
                "{name: callable} (the dataset's 'environment' column picks one per row)."
            )
        self.pool: dict[Any, list] = {}
        self.latest: list[Any] = []  # the latest rollouts' environments, one per row: TRL's trainer.environments[i]
        self.methods: dict[type, list[Tool]] = {}  # each class's tools, described once
        for name, make in self.factories.items():
            probe = make()
            cls = type(probe)
            if not callable(getattr(probe, "reset", None)):
                raise ValueError(
                    f"The environment {cls.__name__} (from environment_factory) has no reset method: an environment "
                    "defines reset(**row), called with the dataset row at the start of each rollout."
                )
            if cls not in self.methods:
                self.methods[cls] = [
                    make_tool(getattr(probe, member), f"environment {cls.__name__}")
                    for member, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
                    if not member.startswith("_") and member not in ("reset", "get_reward")
                ]
            self.pool[name] = [probe]

    def reward_functions(self) -> list[Callable]:
        """One reward function per environment class with get_reward, named after the class: the rollouts of that
        class get its get_reward(), the others None."""
        return [_reward_of(cls) for cls in self.methods if callable(getattr(cls, "get_reward", None))]

    def tools_of(self, environment: Any) -> ToolSet:
        """The environment's methods as tools bound to this instance."""
        return ToolSet(
            [Tool(t.name, getattr(environment, t.name), t.schema, t.is_async) for t in self.methods[type(environment)]]
        )

    @property
    def has_tools(self) -> bool:
        return any(self.methods.values())

    @property
    def tool_names(self) -> list[str]:
        """Every environment class's tool names, once each."""
        return list(dict.fromkeys(t.name for tools in self.methods.values() for t in tools))

    def start(self, examples: Sequence[dict]) -> tuple[list[Any], list[Any]]:
        """(instances, prompts): one reset instance per row, and each row's prompt with what reset returned."""
        names = [example.get("environment") if self.routed else None for example in examples]
        unknown = sorted({str(n) for n in names if n not in self.factories})
        if unknown:
            raise ValueError(
                f"A dataset row has environment={unknown[0]!r}, which is not among the environments passed to "
                f"environment_factory: {list(self.factories)}."
            )
        handed: dict[Any, int] = {}
        instances, prompts = [], []
        for name, example in zip(names, examples):
            pool = self.pool[name]
            index = handed.get(name, 0)
            if index == len(pool):
                pool.append(self.factories[name]())
            handed[name] = index + 1
            environment = pool[index]
            row = {k: v for k, v in example.items() if not (self.routed and k == "environment")}
            try:
                observation = environment.reset(**copy.deepcopy(row))
            except Exception as err:
                raise RuntimeError(
                    f"The environment {type(environment).__name__}'s reset(**row) raised {type(err).__name__}: {err} "
                    f"(row keys: {sorted(row)}). reset receives every column of the dataset row as a keyword."
                ) from err
            instances.append(environment)
            prompts.append(with_observation(list(example.get("prompt") or EMPTY_PROMPT), observation))
        self.latest = instances
        return instances, prompts

    def __getitem__(self, index: int) -> Any:
        return self.latest[index]

    def __len__(self) -> int:
        return len(self.latest)

    def __bool__(self) -> bool:  # an Environments is there (truthy) whether or not a rollout has run yet
        return True


def with_observation(prompt: list[dict], observation: Any) -> list[dict]:
    """The prompt with reset's return value appended to its last message (plain concatenation); None: as it is."""
    if observation is None:
        return prompt
    content = prompt[-1].get("content") or ""
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}] if content else []
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    if not isinstance(observation, (str, list)):
        observation = str(observation)
    return [*prompt[:-1], {**prompt[-1], "content": content + observation}]


def _reward_of(cls: Any) -> Callable:  # an environment class: its get_reward method, sync or async
    reward: Callable[..., Any]
    if inspect.iscoroutinefunction(cls.get_reward):

        async def reward(environments: list, **kwargs: Any) -> list:
            return [await e.get_reward() if type(e) is cls else None for e in environments]

    else:

        def reward(environments: list, **kwargs: Any) -> list:
            return [e.get_reward() if type(e) is cls else None for e in environments]

    reward.__name__ = cls.__name__
    return reward


def placeholder_dataset(dataset: Any, args: ResolvedConfig, environment_factory: Any) -> Any:
    """The dataset; without one, an environment that makes its own prompts (a single environment_factory, with
    max_steps) trains on generation_batch_size / num_generations empty user prompts, as TRL 1.16."""
    if dataset is not None:
        return dataset
    if environment_factory is None:
        raise ValueError(
            "`train_dataset` is required unless an `environment_factory` is provided (environments that make their "
            "own prompts): pass GRPOTrainer(train_dataset=...)."
        )
    if isinstance(environment_factory, dict):
        raise ValueError(
            "A dict environment_factory (several environments) requires a `train_dataset` whose `environment` column "
            "chooses each row's environment: pass one, or a single environment factory."
        )
    if args.max_steps <= 0:
        raise ValueError(
            "train_dataset is None, so the environment makes the prompts and there are no epochs: set max_steps "
            "to the number of optimizer steps to train."
        )
    return [{"prompt": list(EMPTY_PROMPT)}] * (args.generation_batch_size // args.num_generations)
