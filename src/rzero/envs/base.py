"""The environment interface: what a task looks like and how an episode goes.

An episode is a prompt, then model turns alternating with environment responses (tool results,
feedback), then a reward:

    prompt -> model turn -> env.respond(...) -> model turn -> ... -> env.respond(...) is None
           -> env.reward(task, completion)

Everything is text. The model turns and the responses are appended to one growing request, so
the engine reuses the cached prefix on every turn, and the trainer sees one sequence per sample
whose environment tokens are masked out of the loss.

A single-turn environment implements `task` and `reward`; a multi-turn one also `respond` (and
sets `max_turns`). `respond` is a coroutine: it may wait on I/O (a slow tool, a remote service)
for as long as it likes without holding up the generation of other rollouts. `reward` may be a
plain function (it runs on a worker thread) or a coroutine. A reward that gives up on an answer
too costly to grade raises `GraderTimeout`: the episode scores 0 and is counted as a grader
timeout, not as a failure. See docs/environments.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from rzero.model.tokenizer import IM_END, IM_START


@dataclass(frozen=True)
class Task:
    index: int
    prompt: str  # the text the model continues, chat markup included
    answer: str  # the reference answer the reward compares against
    info: dict[str, Any] = field(default_factory=dict, compare=False)  # anything else the env needs


class GraderTimeout(Exception):
    """Raised by `reward` when grading was cut off (too slow, too big): reward 0, counted."""


# A supervised warm-start target: plain text (all of it trained on), or segments of
# (text, trained?) where environment text is shown to the model but not trained on.
Reference = str | list[tuple[str, bool]]


class Env(ABC):
    """Base class for environments (subclassing is optional: the orchestrator duck-types)."""

    max_turns: int = 1  # model turns per episode
    # The episode runner calls a synchronous reward in a worker thread, so that a slow grader never
    # blocks the event loop the episodes share. An env whose reward is a cheap pure function sets
    # this False: it is then called on the loop (a thread hand-off costs ~50 us a sample, 3 ms for
    # a step of 64 arithmetic samples, more than the rewards themselves).
    reward_in_thread: bool = True

    @abstractmethod
    def task(self, index: int) -> Task:
        """Task `index`; a pure function of the index (and the env's seed), so runs can resume."""

    async def respond(self, task: Task, completion: str) -> str | None:
        """The environment's answer to the model's latest turn, or None to end the episode.

        `completion` is everything generated after the prompt so far (model turns and earlier
        responses). The returned text is appended verbatim, so it carries the chat markup that
        closes this exchange and opens the next assistant turn.
        """
        return None

    @abstractmethod
    def reward(self, task: Task, completion: str) -> float:
        """The episode's reward (may also be a coroutine)."""

    def reference(self, task: Task) -> Reference:
        """The supervised target for a warm start (optional)."""
        raise NotImplementedError(f"{type(self).__name__} has no reference answers for a warm start")


def final_turn(completion: str) -> str:
    """The text of the model's last turn: after the last tool response, before end of turn."""
    last_turn = completion.rsplit(IM_START + "assistant\n", 1)[-1]
    return last_turn.split(IM_END)[0]
