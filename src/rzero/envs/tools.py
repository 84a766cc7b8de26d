"""Tools for multi-turn environments: Hermes tool-call parsing, execution with latency and faults.

The model calls tools the Qwen3/Hermes way, one JSON object per block:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "347*29"}}
    </tool_call>

and gets back one `<tool_response>` per call, in a user turn (exactly what the chat template
renders for `tool` messages). Whatever goes wrong — bad JSON, an unknown tool, wrong arguments,
an injected failure, a timeout, an exception inside the tool — becomes an `error: ...` response
the model can read; nothing is raised into the rollout worker or the trainer.

Latency is simulated with `asyncio.sleep`, so a thousand slow calls in flight cost nothing; the
delay and the fault draws come from an RNG seeded by the episode's text, so a rerun sees the same
faults.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import operator
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from rzero.model.tokenizer import IM_END, IM_START, TOOL_CALL_END, TOOL_CALL_START, TOOL_RESPONSE_END, TOOL_RESPONSE_START

TOOL_CALL_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


@dataclass(frozen=True)
class Latency:
    """How long a call takes: fixed, uniform in [low, high], or log-normal (heavy-tailed)."""

    kind: Literal["none", "fixed", "uniform", "lognormal"] = "none"
    seconds: float = 0.0  # fixed: the delay; lognormal: the median
    low: float = 0.0  # uniform bounds
    high: float = 0.0
    sigma: float = 1.0  # lognormal: std of log(delay); 1.0 puts the 99th percentile at ~10x the median

    def __post_init__(self) -> None:
        if min(self.seconds, self.low, self.high) < 0 or self.sigma < 0:
            raise ValueError(f"latency values must be >= 0: {self}")
        if self.kind == "uniform" and self.low > self.high:
            raise ValueError(f"uniform latency needs low <= high, got [{self.low}, {self.high}]")

    def sample(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            return self.seconds
        if self.kind == "uniform":
            return rng.uniform(self.low, self.high)
        if self.kind == "lognormal":
            return self.seconds * math.exp(self.sigma * rng.gauss(0.0, 1.0)) if self.seconds else 0.0
        return 0.0


@dataclass(frozen=True)
class Tool:
    """A function the model may call. `parameters` is the JSON schema shown to the model; calls are
    checked against its required keys, allowed keys and primitive types before `function` runs."""

    name: str
    description: str
    parameters: dict[str, Any]
    function: Callable[..., Any]  # sync (runs on a thread) or async; returns the response text
    latency: Latency = field(default_factory=Latency)
    failure_rate: float = 0.0  # probability that a call fails with an error response
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.failure_rate <= 1:
            raise ValueError(f"tool {self.name}: failure_rate must be in [0, 1], got {self.failure_rate}")
        if not self.timeout_s > 0:
            raise ValueError(f"tool {self.name}: timeout_s must be > 0, got {self.timeout_s}")

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function description (what the chat template renders for `tools`)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


class ToolCallError(ValueError):
    """A malformed call; its message is what the model reads."""


def parse_tool_call(body: str) -> ToolCall | ToolCallError:
    """One call from the JSON between `<tool_call>` and `</tool_call>`, or why it is malformed."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCallError(f"invalid JSON in tool call ({e.msg} at char {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCallError('a tool call must be an object {"name": ..., "arguments": {...}}')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCallError(f"tool call {obj['name']!r}: arguments must be a JSON object")
    return ToolCall(obj["name"], arguments)


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every `<tool_call>` block in `text`, parsed, or the reason it could not be."""
    calls = [parse_tool_call(block) for block in TOOL_CALL_BLOCK.findall(text)]
    if text.count(TOOL_CALL_START) > len(calls):
        calls.append(ToolCallError(f"unterminated tool call: {TOOL_CALL_START} without {TOOL_CALL_END}"))
    return calls


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


def check_arguments(tool: Tool, arguments: dict[str, Any]) -> None:
    props = tool.parameters.get("properties", {})
    missing = [k for k in tool.parameters.get("required", []) if k not in arguments]
    if missing:
        raise ToolCallError(f"tool {tool.name!r}: missing argument(s) {', '.join(missing)}")
    unknown = [k for k in arguments if k not in props]
    if unknown:
        raise ToolCallError(f"tool {tool.name!r}: unknown argument(s) {', '.join(unknown)} (takes {', '.join(props)})")
    for key, value in arguments.items():
        expected = _JSON_TYPES.get(props[key].get("type", ""))
        wrong_bool = isinstance(value, bool) and props[key].get("type") in ("integer", "number")
        if expected is not None and (not isinstance(value, expected) or wrong_bool):
            raise ToolCallError(f"tool {tool.name!r}: argument {key!r} must be a {props[key]['type']}, got {value!r}")


class ToolBox:
    """The tools of one environment, and how a model turn's calls become response text."""

    def __init__(self, tools: list[Tool]):
        self.tools = {t.name: t for t in tools}
        if len(self.tools) != len(tools):
            raise ValueError("tool names must be unique")

    async def call(self, call: ToolCall | ToolCallError, rng: random.Random) -> str:
        if isinstance(call, ToolCallError):
            return f"error: {call}"
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r} (available: {', '.join(self.tools)})"
        try:
            check_arguments(tool, call.arguments)
        except ToolCallError as e:
            return f"error: {e}"
        delay, fails = tool.latency.sample(rng), rng.random() < tool.failure_rate

        async def run() -> str:
            await asyncio.sleep(delay)
            if fails:
                return f"error: tool {tool.name!r} failed (service unavailable), try again"
            if inspect.iscoroutinefunction(tool.function):
                return str(await tool.function(**call.arguments))
            return str(await asyncio.to_thread(tool.function, **call.arguments))

        try:
            return await asyncio.wait_for(run(), timeout=tool.timeout_s)
        except TimeoutError:
            return f"error: tool {tool.name!r} timed out after {tool.timeout_s:g} s"
        except Exception as e:  # a tool's own bug is the model's problem to read, not the trainer's
            return f"error: tool {tool.name!r} raised {type(e).__name__}: {e}"

    async def respond(self, turn: str, seed: str) -> str | None:
        """Responses to all calls in a model turn (concurrently), as a chat user turn; None if
        the turn made no call."""
        calls = parse_tool_calls(turn)
        if not calls:
            return None
        rngs = [random.Random(f"{seed}:{i}") for i in range(len(calls))]
        results = await asyncio.gather(*(self.call(c, r) for c, r in zip(calls, rngs)))
        return render_tool_responses(results)


def render_tool_responses(results: list[str]) -> str:
    """What the chat template writes for consecutive `tool` messages, then the next assistant
    turn's header (the model's own turn ended with its end-of-turn token)."""
    body = "".join(f"\n{TOOL_RESPONSE_START}\n{r}\n{TOOL_RESPONSE_END}" for r in results)
    return f"\n{IM_START}user{body}{IM_END}\n{IM_START}assistant\n"


# ------------------------------------------------------------------ built-in tools

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200


def evaluate_expression(expression: str) -> str:
    """Exact arithmetic on numbers with + - * / // % ** and parentheses (no names, no calls)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")

    def ev(node: ast.AST):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
                raise ValueError("exponent too large")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported syntax: {ast.unparse(node)!r}")

    try:
        value = ev(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError as e:
        raise ValueError(f"cannot parse {expression!r}") from e
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def calculator(**options) -> Tool:
    return Tool(
        "calculator",
        "Evaluate an arithmetic expression exactly.",
        {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
        evaluate_expression,
        **options,
    )


def python_tool(**options) -> Tool:
    """Runs code in rzero.envs.sandbox (limits, memory cgroup, namespaces; see its docstring)."""
    from rzero.envs.sandbox import run_python

    def run(code: str) -> str:
        result = run_python(code)
        return result.stdout if result.error is None else f"{result.stdout}error: {result.error}"

    return Tool(
        "python",
        "Run Python code in a sandbox and return its output.",
        {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        run,
        **options,
    )
