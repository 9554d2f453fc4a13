"""Agent training: tool calls, multi-turn rollouts and environments (shared spec §6), above the rollout interface.

- `tools`: Python functions as tools (schemas, execution under a time limit);
- `parsing`: an assistant turn as a message with its tool calls;
- `template`: what a chat template must do for tools, and a tool turn's tokens (`CHATML_TOOLS`: a ChatML template
  with tools, for models whose template has none);
- `loop`: the multi-turn tool loop;
- `budget`: how many characters one token can stand for (a tool result too long to fit is refused untokenized);
- `environments`: `environment_factory`;
- `rollouts`: rows in, completions out, the one call the trainer makes per round (with `rollout_func` too).
"""

from grpo.agent.environments import Environments
from grpo.agent.rollouts import Generated, Rollouts
from grpo.agent.template import CHATML_TOOLS

__all__ = ["CHATML_TOOLS", "Environments", "Generated", "Rollouts"]
