"""Tool calling: Hermes parsing, every malformed-call kind, latency and faults, the calculator,
and the tool_calc environment's text (checked against the model's own chat template)."""

import asyncio
import json
import random
import statistics

import pytest

from rzero.config import load_config
from rzero.envs import make_env
from rzero.envs.tool_calc import ToolCalcEnv
from rzero.envs.tools import (
    Latency,
    Tool,
    ToolBox,
    ToolCall,
    ToolCallError,
    calculator,
    evaluate_expression,
    parse_tool_calls,
    render_tool_responses,
)
from rzero.model.tokenizer import IM_END


def call_text(obj) -> str:
    body = obj if isinstance(obj, str) else json.dumps(obj)
    return f"<tool_call>\n{body}\n</tool_call>"


def run(coro):
    return asyncio.run(coro)


def test_parse_valid_calls_in_order():
    text = call_text({"name": "calculator", "arguments": {"expression": "2*3"}}) + call_text(
        {"name": "python", "arguments": '{"code": "print(1)"}'}  # arguments as a JSON string
    )
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "2*3"}), ToolCall("python", {"code": "print(1)"})]
    assert parse_tool_calls("no calls here") == []


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"name": "calculator", "arguments": {"expression": "1+1"}', "invalid JSON"),
        ('["calculator"]', "must be an object"),
        ('{"arguments": {}}', "must be an object"),
        ('{"name": "calculator", "arguments": [1, 2]}', "arguments must be a JSON object"),
    ],
)
def test_malformed_call_is_parsed_into_an_error(body, message):
    (err,) = parse_tool_calls(call_text(body))
    assert isinstance(err, ToolCallError) and message in str(err)


def test_unterminated_call_is_an_error():
    calls = parse_tool_calls('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}')
    assert len(calls) == 1 and "unterminated" in str(calls[0])


@pytest.mark.parametrize(
    "call, message",
    [
        (ToolCallError("invalid JSON in tool call (x)"), "error: invalid JSON"),
        (ToolCall("weather", {"city": "Oslo"}), "error: unknown tool 'weather' (available: calculator)"),
        (ToolCall("calculator", {}), "missing argument(s) expression"),
        (ToolCall("calculator", {"expression": "1", "precision": 3}), "unknown argument(s) precision"),
        (ToolCall("calculator", {"expression": 12}), "argument 'expression' must be a string"),
        (ToolCall("calculator", {"expression": "import os"}), "error: tool 'calculator' raised ValueError"),
    ],
)
def test_every_malformed_call_kind_gets_an_error_response(call, message):
    response = run(ToolBox([calculator()]).call(call, random.Random(0)))
    assert response.startswith("error:") and message in response


def test_boolean_is_not_a_number():
    tool = Tool("t", "", {"type": "object", "properties": {"n": {"type": "integer"}}}, lambda n: n)
    assert "must be a integer" in run(ToolBox([tool]).call(ToolCall("t", {"n": True}), random.Random(0)))
    assert run(ToolBox([tool]).call(ToolCall("t", {"n": 3}), random.Random(0))) == "3"


def test_injected_failures_follow_the_rate():
    box = ToolBox([calculator(failure_rate=0.3)])
    rng = random.Random(1)
    responses = [run(box.call(ToolCall("calculator", {"expression": "6*7"}), rng)) for _ in range(400)]
    failed = sum(r.startswith("error: tool 'calculator' failed") for r in responses)
    assert 80 <= failed <= 160  # 120 expected; binomial sd ~9
    assert all(r == "42" for r in responses if not r.startswith("error"))
    always = ToolBox([calculator(failure_rate=1.0)])
    assert "failed" in run(always.call(ToolCall("calculator", {"expression": "1"}), rng))


def test_slow_tool_times_out_with_an_error_response():
    box = ToolBox([calculator(latency=Latency("fixed", 5.0), timeout_s=0.05)])
    assert run(box.call(ToolCall("calculator", {"expression": "1"}), random.Random(0))) == (
        "error: tool 'calculator' timed out after 0.05 s"
    )


def test_async_tool_functions_and_concurrent_calls_in_one_turn():
    active, peak = 0, 0

    async def slow_echo(text: str) -> str:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.05)
        active -= 1
        return text.upper()

    tool = Tool("echo", "", {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}, slow_echo)
    turn = "".join(call_text({"name": "echo", "arguments": {"text": w}}) for w in ("a", "b", "c"))
    response = run(ToolBox([tool]).respond(turn, seed="s"))
    assert response == render_tool_responses(["A", "B", "C"])
    assert peak == 3  # the three calls of one turn ran at the same time


def test_latency_distributions():
    rng = random.Random(0)
    assert Latency("fixed", 0.25).sample(rng) == 0.25
    assert Latency().sample(rng) == 0.0
    uniform = [Latency("uniform", low=0.1, high=0.3).sample(rng) for _ in range(2000)]
    assert 0.1 <= min(uniform) and max(uniform) <= 0.3
    heavy = [Latency("lognormal", 0.2, sigma=1.0).sample(rng) for _ in range(4000)]
    assert 0.18 < statistics.median(heavy) < 0.22
    assert max(heavy) > 10 * statistics.median(heavy)  # a heavy right tail
    with pytest.raises(ValueError, match="low <= high"):
        Latency("uniform", low=2, high=1)
    with pytest.raises(ValueError, match="failure_rate"):
        calculator(failure_rate=1.5)


def test_fault_draws_are_reproducible_from_the_episode_text():
    box = ToolBox([calculator(failure_rate=0.5)])
    turn = "".join(call_text({"name": "calculator", "arguments": {"expression": f"{i}+1"}}) for i in range(8))
    first = run(box.respond(turn, seed="episode-1"))
    assert run(box.respond(turn, seed="episode-1")) == first
    assert any(run(box.respond(turn, seed=f"episode-{i}")) != first for i in range(2, 6))


@pytest.mark.parametrize(
    "expression, value",
    [("347*129", "44763"), ("(2+3)*4", "20"), ("7/2", "3.5"), ("8/2", "4"), ("-3**2", "-9"), ("10 % 4", "2")],
)
def test_calculator_is_exact(expression, value):
    assert evaluate_expression(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os')", "x+1", "2**10000", "1" * 300, "1+"])
def test_calculator_rejects_what_is_not_plain_arithmetic(expression):
    with pytest.raises(ValueError):
        evaluate_expression(expression)


# ---------------------------------------------------------------- tool_calc env


def test_tool_calc_episode_text():
    env = ToolCalcEnv((3, 3), seed=5)
    task = env.task(7)
    assert task == env.task(7) and task != env.task(8)
    a, b = task.info["expression"].split("*")
    assert len(a) == len(b) == 3 and task.answer == str(int(a) * int(b))
    turn = call_text({"name": "calculator", "arguments": {"expression": task.info["expression"]}}) + IM_END
    response = run(env.respond(task, turn))
    assert response == render_tool_responses([task.answer])
    assert run(env.respond(task, "12345" + IM_END)) is None  # no call: the episode ends
    assert env.reward(task, turn + response + task.answer + IM_END) == 1.0
    assert env.reward(task, turn + response + "1" + IM_END) == 0.0
    assert env.reward(task, task.answer + IM_END) == 1.0  # a direct answer counts if it is right


def test_tool_calc_reference_mixes_tool_and_direct_answers():
    env = ToolCalcEnv((3, 3), tool_fraction=0.25, seed=0)
    refs = [env.reference(env.task(i)) for i in range(400)]
    with_tool = [r for r in refs if isinstance(r, list)]
    assert 60 <= len(with_tool) <= 140
    for segments in with_tool:
        assert [trained for _, trained in segments] == [True, False, True]
    direct = next(r for r in refs if isinstance(r, str))
    assert direct.endswith(IM_END)


def test_tool_calc_text_matches_the_chat_template(tiny_dense_dir):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dense_dir)
    env = ToolCalcEnv((2, 2), show_tools=True, seed=0)
    task = env.task(0)
    call = {"name": "calculator", "arguments": {"expression": task.info["expression"]}}
    messages = [
        {"role": "user", "content": f"{task.info['expression']}=?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
        {"role": "tool", "content": task.answer},
    ]
    tools = [t.schema() for t in env.toolbox.tools.values()]
    rendered = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    turn = f"<tool_call>\n{json.dumps(call)}\n</tool_call>{IM_END}"
    assert rendered == task.prompt + turn + run(env.respond(task, turn))


def test_config_builds_tool_calc_with_tool_settings():
    config = load_config(
        None,
        [
            "env.name=tool_calc",
            "env.digits=2",
            'env.tools={calculator={latency="lognormal", latency_s=0.5, failure_rate=0.1, timeout_s=3}}',
        ],
    )
    env = make_env(config.env, seed=0)
    tool = env.toolbox.tools["calculator"]
    assert tool.latency == Latency("lognormal", 0.5) and tool.failure_rate == 0.1 and tool.timeout_s == 3
    assert len(env.task(0).info["expression"]) == 5


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["env.name=tool_calc", 'env.operations=["*"]'], "operations not used by env.name = 'tool_calc'"),
        (["env.data=x.jsonl"], "data not used by env.name = 'arithmetic'"),
        (["env.name=math"], "needs env.data"),
        (["env.name=tool_calc", "env.tools={}"], "at least one tool"),
        (["env.name=tool_calc", "env.tools={shell={}}"], "env.tools.shell"),
        (["env.name=tool_calc", 'env.tools={calculator={latency="uniform", latency_low_s=2, latency_high_s=1}}'], "latency_low_s"),
    ],
)
def test_env_config_errors_name_the_problem(overrides, message):
    from rzero.config import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_config(None, overrides)


def test_python_tool_runs_code_in_the_sandbox():
    from rzero.envs.tools import python_tool

    box = ToolBox([python_tool(timeout_s=20)])
    assert run(box.call(ToolCall("python", {"code": "print(6 * 7)"}), random.Random(0))) == "42\n"
    looping = run(box.call(ToolCall("python", {"code": "while True: pass"}), random.Random(0)))
    assert looping.startswith("error: ") and "time" in looping
