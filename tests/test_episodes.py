"""Multi-turn episodes: environment tokens are masked context, model tokens keep exact behaviour
logprobs, slow environment steps overlap, and a failing environment never kills a worker."""

import asyncio
import json
import threading

import pytest
import torch

from rzero.engine import Engine, SamplingParams
from rzero.envs.arithmetic import ArithmeticEnv
from rzero.model.io import load_model
from rzero.rollout.episodes import AsyncLoop, EpisodeRunner
from rzero.rollout.record import Rollout
from rzero.train.trainer import Trainer, TrainerSettings

RESPONSE = "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


class ScriptedEnv(ArithmeticEnv):
    """Answers every model turn with the same tool response, for `max_turns` turns."""

    def __init__(self, max_turns=3, delay=0.0, fail_on_turn=None):
        super().__init__(digits=2, seed=0)
        self.max_turns, self.delay, self.fail_on_turn = max_turns, delay, fail_on_turn
        self.active = self.peak = 0
        self.lock = threading.Lock()

    async def respond(self, task, completion):
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(self.delay)
            if self.fail_on_turn is not None and completion.count(RESPONSE) + 1 == self.fail_on_turn:
                raise ConnectionError("tool backend down")
            return RESPONSE
        finally:
            with self.lock:
                self.active -= 1

    def reward(self, task, completion):
        return float(completion.count("<tool_response>"))


def run_episodes(engine, env, tasks, params):
    """Drive a runner until every episode of `tasks` has finished."""
    loop, done = AsyncLoop(), []
    runner = EpisodeRunner(engine, env, loop, done.append)
    for i, task in enumerate(tasks):
        runner.add(i, task, params)
    try:
        runner.run_until(lambda: len(done) == len(tasks) * params.n)
    finally:
        loop.close()
    return sorted(done, key=lambda e: (e.key, e.sample))


@pytest.fixture
def engine(tiny_dense_dir):
    return Engine(tiny_dense_dir, dtype="bf16", seed=0)


def test_multi_turn_episode_masks_env_tokens_and_keeps_exact_logprobs(engine, tiny_dense_dir):
    env = ScriptedEnv(max_turns=3)
    tasks = [env.task(i) for i in range(4)]
    episodes = run_episodes(engine, env, tasks, SamplingParams(max_tokens=5, n=2, seed=11))
    response_ids = engine.tokenizer.encode(RESPONSE, add_special_tokens=False).ids
    assert len(episodes) == 8
    for ep in episodes:
        assert ep.turns == 3 and ep.reward == 2.0 and not ep.failed
        assert len(ep.token_ids) == len(ep.logprobs) == len(ep.versions) == len(ep.mask)
        # The env's tokens sit between the model's turns, masked out, exactly as tokenized.
        env_runs = [i for i, m in enumerate(ep.mask) if m == 0]
        assert len(env_runs) == 2 * len(response_ids)
        assert [ep.token_ids[i] for i in env_runs] == response_ids * 2
        assert ep.mask[0] == 1 and ep.mask[-1] == 1
    # The trainer, scoring the whole sequence with env tokens as context, gets the engine's μ
    # bit for bit on every model token.
    rollouts = [
        Rollout(ep.prompt_ids, ep.token_ids, ep.logprobs, ep.versions, ep.reward, SamplingParams().transform, mask=ep.mask)
        for ep in episodes
    ]
    trainer = Trainer(load_model(tiny_dense_dir, "fp32"), torch.bfloat16, TrainerSettings())
    for r, pi in zip(rollouts, trainer.token_logprobs(trainer.compute, rollouts)):
        assert pi.tolist() == r.policy_logprobs()
        assert len(pi) == sum(r.mask) and r.num_turns() == 3
    # Samples of one task differ (own seeds per sample and per turn), and reruns are identical.
    assert episodes[0].token_ids != episodes[1].token_ids
    again = run_episodes(Engine(tiny_dense_dir, dtype="bf16", seed=0), env, tasks, SamplingParams(max_tokens=5, n=2, seed=11))
    assert [e.token_ids for e in again] == [e.token_ids for e in episodes]


def test_slow_env_steps_overlap(engine):
    env = ScriptedEnv(max_turns=2, delay=0.3)
    episodes = run_episodes(engine, env, [env.task(i) for i in range(6)], SamplingParams(max_tokens=3, n=2, seed=1))
    assert all(ep.turns == 2 for ep in episodes)
    assert env.peak >= 6  # the twelve slow responses were awaited together, not one by one


def test_failing_env_ends_the_episode_with_zero_reward(engine):
    env = ScriptedEnv(max_turns=3, fail_on_turn=2)
    episodes = run_episodes(engine, env, [env.task(i) for i in range(2)], SamplingParams(max_tokens=3, n=2, seed=1))
    for ep in episodes:
        assert ep.failed and ep.reward == 0.0 and ep.turns == 2
        assert "env.respond: ConnectionError: tool backend down" in ep.error


class RewardThreadEnv(ArithmeticEnv):
    """Records the thread each reward runs on; rewards of task 1 raise."""

    def __init__(self, in_thread):
        super().__init__(digits=1, seed=0)
        self.reward_in_thread, self.threads = in_thread, set()

    def reward(self, task, completion):
        self.threads.add(threading.current_thread().name)
        if task.index == 1:
            raise ValueError("grader broke")
        return 0.5


@pytest.mark.parametrize("in_thread", [True, False])
def test_a_cheap_reward_runs_on_the_loop_a_slow_one_in_a_thread(engine, in_thread):
    env = RewardThreadEnv(in_thread)
    episodes = run_episodes(engine, env, [env.task(i) for i in range(2)], SamplingParams(max_tokens=3, n=2, seed=1))
    assert (env.threads == {"env-loop"}) is (not in_thread)  # AsyncLoop's thread, or pool threads
    assert [ep.reward for ep in episodes] == [0.5, 0.5, 0.0, 0.0]
    assert [ep.failed for ep in episodes] == [False, False, True, True]  # raising on the loop is caught too
    assert all("env.reward: ValueError: grader broke" in ep.error for ep in episodes[2:])


def test_conversation_that_outgrows_the_context_ends_cleanly(tiny_dense_dir):
    engine = Engine(tiny_dense_dir, dtype="bf16", max_model_len=48)
    env = ScriptedEnv(max_turns=10)
    (ep,) = run_episodes(engine, env, [env.task(0)], SamplingParams(max_tokens=4, seed=3))
    assert ep.finish_reason == "context" and "max_model_len" in ep.error and not ep.failed
    # The last response is in the transcript; the next model turn had no room.
    assert 1 < ep.turns < 10 and ep.reward == ep.turns and ep.mask[-1] == 0


def test_multi_turn_sync_training_has_unit_ratios(tmp_path):
    from rzero.config import load_config
    from rzero.run.loop import train

    config = load_config(
        None,
        ["warm_start.steps=0", "rollout.max_lag=0", "rollout.prompts_per_step=3",
         "rollout.group_size=4", "rollout.max_tokens=4", "train.steps=3", "train.lr=0.01", "run.tensorboard=false"],
    )

    class TurnsEnv(ScriptedEnv):
        def reward(self, task, completion):  # mixed rewards, so the weights really change
            return 1.0 if len(completion.split(RESPONSE)[-1]) % 2 == 0 else 0.0

    run_dir = train(config, tmp_path / "run", progress=False, env=TurnsEnv(max_turns=2), log=lambda *a: None)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    record = {e["step"]: e for e in map(json.loads, (run_dir / "rollouts.jsonl").read_text().splitlines())}
    assert len(rows) == 3
    for m in rows:
        assert m["rollout/turns_mean"] == 2.0
        assert m["is/peak_over_median"] == 1.0 and m["mismatch/kernel_max_abs"] == 0.0
        # Model tokens only, env tokens masked: at most 4 per turn (fewer where a turn drew EOS).
        samples = [r for group in record[m["step"]]["rollouts"] for r in group]
        model_tokens = sum(sum(r["mask"]) for r in samples)
        env_tokens = sum(len(r["mask"]) - sum(r["mask"]) for r in samples)
        assert m["train/completion_tokens"] == model_tokens <= 3 * 4 * 2 * 4 and env_tokens > 0
