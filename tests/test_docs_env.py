"""The environment example in docs/environments.md runs as documented."""

import re
from pathlib import Path

from rzero.engine import Engine, SamplingParams

from test_episodes import run_episodes

DOC = Path(__file__).resolve().parents[1] / "docs" / "environments.md"


def test_documented_guess_env_runs_multi_turn_episodes(tiny_dense_dir):
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if "class GuessEnv" in block]
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    env = namespace["GuessEnv"]()
    engine = Engine(tiny_dense_dir, dtype="bf16")
    episodes = run_episodes(engine, env, [env.task(i) for i in range(3)], SamplingParams(max_tokens=2, n=2, seed=0))
    assert len(episodes) == 6
    for ep in episodes:
        # A random model rarely guesses right: it gets hints until max_turns.
        solved = ep.reward == 1.0
        assert 1 <= ep.turns <= env.max_turns and (solved or ep.turns == env.max_turns)
        assert ep.text.count("higher") + ep.text.count("lower") == ep.turns - 1
