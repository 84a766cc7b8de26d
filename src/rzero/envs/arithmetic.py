"""Multi-digit arithmetic: the synthetic task a tiny model can learn on a laptop CPU.

Task i is a pure function of (seed, i), so a resumed run regenerates exactly the same prompts
without carrying an RNG across the checkpoint.
"""

from __future__ import annotations

import random
import re

from rzero.envs.base import Env, Task
from rzero.model.tokenizer import IM_END


class ArithmeticEnv(Env):
    reward_in_thread = False  # an exact string match: called on the episodes' loop

    def __init__(self, digits: int = 2, operations: tuple[str, ...] = ("+",), seed: int = 0):
        if not operations:
            raise ValueError("arithmetic env needs at least one operation")
        self.digits, self.operations, self.seed = digits, tuple(operations), seed

    def task(self, index: int) -> Task:
        rng = random.Random(self.seed * 1_000_003 + index)
        hi = 10**self.digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        op = rng.choice(self.operations)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return Task(index, f"{a}{op}{b}=", str(value))

    def reference(self, task: Task) -> str:
        """The supervised target for the warm start: the answer, then end of turn."""
        return task.answer + IM_END

    def reward(self, task: Task, completion: str) -> float:
        """1.0 when the completion is exactly the answer (before the end-of-turn token)."""
        text = completion.split(IM_END)[0].strip()
        return 1.0 if re.fullmatch(r"-?\d+", text) and text == task.answer else 0.0
