"""Multi-digit multiplication with a calculator tool: the multi-turn tool-calling task.

A tiny model cannot multiply 3-digit numbers in its head, but it can copy them into a tool call
and copy the tool's answer back:

    <|im_start|>user\\n347*129=?<|im_end|>\\n<|im_start|>assistant\\n
    <tool_call>\\n{"name": "calculator", "arguments": {"expression": "347*129"}}\\n</tool_call><|im_end|>
    \\n<|im_start|>user\\n<tool_response>\\n44763\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n
    44763<|im_end|>

The reward is 1.0 when the final turn is exactly the product, so learning to call the tool is
what raises it. Tool latency and faults are configurable (rzero.envs.tools): with slow tools the
rollouts spend most of their time waiting, which is where asynchronous training pays off.

Warm start: a fraction `tool_fraction` of the reference answers go through the tool, the rest
answer directly (the model can only guess those); the warm-started model then uses the tool
that often and RL has to discover that it should always do so.
"""

from __future__ import annotations

import json
import random

from rzero.envs.base import Env, Reference, Task, final_turn
from rzero.envs.tools import Tool, ToolBox, calculator, render_tool_responses
from rzero.model.tokenizer import IM_END, IM_START, TOOL_CALL_END, TOOL_CALL_START


class ToolCalcEnv(Env):
    reward_in_thread = False  # an exact string match: called on the episodes' loop

    def __init__(
        self,
        digits: tuple[int, int] = (3, 3),
        tools: list[Tool] | None = None,
        *,
        max_turns: int = 3,
        tool_fraction: float = 0.25,
        show_tools: bool = False,
        seed: int = 0,
    ):
        if min(digits) < 1:
            raise ValueError(f"digits must be >= 1, got {digits}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if not 0 <= tool_fraction <= 1:
            raise ValueError(f"tool_fraction must be in [0, 1], got {tool_fraction}")
        self.digits, self.max_turns, self.tool_fraction, self.seed = tuple(digits), max_turns, tool_fraction, seed
        self.toolbox = ToolBox(tools if tools is not None else [calculator()])
        # The full Hermes system prompt lists every tool's JSON schema; it is long for a tiny
        # model, so it is optional (the task's format is learned in the warm start instead).
        self.system = _tools_system_prompt(list(self.toolbox.tools.values())) if show_tools else ""

    def task(self, index: int) -> Task:
        rng = random.Random(self.seed * 1_000_003 + index)
        a, b = (rng.randint(10 ** (d - 1), 10**d - 1) for d in self.digits)
        prompt = f"{self.system}{IM_START}user\n{a}*{b}=?{IM_END}\n{IM_START}assistant\n"
        return Task(index, prompt, str(a * b), {"expression": f"{a}*{b}"})

    async def respond(self, task: Task, completion: str) -> str | None:
        return await self.toolbox.respond(final_turn(completion), seed=f"{self.seed}:{task.index}:{completion}")

    def reward(self, task: Task, completion: str) -> float:
        return 1.0 if final_turn(completion).strip() == task.answer else 0.0

    def reference(self, task: Task) -> Reference:
        if random.Random(f"warm:{self.seed}:{task.index}").random() >= self.tool_fraction:
            return task.answer + IM_END
        call = json.dumps({"name": "calculator", "arguments": {"expression": task.info["expression"]}})
        return [
            (f"{TOOL_CALL_START}\n{call}\n{TOOL_CALL_END}{IM_END}", True),
            (render_tool_responses([task.answer]), False),
            (task.answer + IM_END, True),
        ]


def _tools_system_prompt(tools: list[Tool]) -> str:
    """The system turn the chat template writes when `tools` are given (no user system text)."""
    listing = "".join("\n" + json.dumps(t.schema()) for t in tools)
    return (
        f"{IM_START}system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        f"{listing}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        f'within <tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
        f"<args-json-object>}}\n</tool_call>{IM_END}\n"
    )
