"""Episodes on one engine: model turns on the engine, environment steps on an asyncio loop.

The thread that owns the engine calls `EpisodeRunner.step()`. When a sample finishes a model turn
its environment step (`env.respond`, then `env.reward` once the episode is over) is scheduled on
an `AsyncLoop` thread, so any number of slow tool calls wait concurrently while the engine keeps
generating other rollouts. A response comes back as a continuation: a new engine request with
the whole token list so far, which hits the prefix cache, so only the new tokens are computed.

New tasks wait in the runner's backlog and enter the engine only while it has room for them
(max_num_seqs), so a continuation never queues behind thousands of fresh prompts: an episode's
later turns are sampled right after its tool answers, with nearly the weights of its first turn.

Every token keeps its behaviour logprob and weight version; environment tokens are marked with
mask 0 (they are context for the trainer, not actions).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

from rzero.engine import Engine, SamplingParams
from rzero.envs.base import GraderTimeout, Task

log = logging.getLogger(__name__)


class AsyncLoop:
    """An asyncio event loop on a daemon thread, for environment steps."""

    def __init__(self, name: str = "env-loop"):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout=30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
        self.loop.close()


def turn_seed(task_seed: int, sample: int, turn: int) -> int:
    """The request seed of a sample's later turn (turn >= 1): each gets its own, derived from the task's."""
    return (task_seed * 1009 + sample) * 7919 + turn


@dataclass
class Episode:
    """One sample of a task: its tokens after the prompt, turn by turn, and its reward."""

    key: Any  # the caller's id for the task (a group index, a benchmark row)
    sample: int  # which of the task's n samples
    task: Task
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # model and environment tokens after the prompt
    logprobs: list[float] = field(default_factory=list)  # μ_t for model tokens, 0.0 for env tokens
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1: sampled by the model, 0: written by the env
    turn_starts: list[int] = field(default_factory=list)  # index in token_ids where each model turn starts
    text: str = ""  # decoded completion (model turns and env responses)
    turns: int = 0
    finish_reason: str | None = None  # the engine's reason for the last turn, or "context" / "env_error"
    reward: float = 0.0
    failed: bool = False  # env.respond or env.reward raised: reward 0, counted by the caller
    grader_timeout: bool = False  # env.reward gave up grading (GraderTimeout): reward 0, counted
    error: str | None = None


async def _concurrently(steps: list[Coroutine]) -> None:
    """The environment steps of the turns one engine step finished, run at once on the loop thread:
    one cross-thread hand-off per engine step instead of one per turn (64 turns finishing together
    cost the worker ~2 ms a step in hand-offs; docs/benchmarks.md, thirteenth session)."""
    await asyncio.gather(*steps, return_exceptions=True)  # each step handles its own failures


class EpisodeRunner:
    def __init__(
        self,
        engine: Engine,
        env,
        loop: AsyncLoop,
        on_finished: Callable[[Episode], None],
        *,
        wake: Callable[[], None] = lambda: None,
        delay_s: float = 0.0,
    ):
        """`on_finished` and `wake` are called on the loop thread: the first with each finished
        episode (reward set), the second whenever a continuation is ready for `step()` (callers
        that drive the engine with `run_until` need neither to wake them)."""
        if engine.tokenizer is None:
            raise ValueError("episodes need an engine with a tokenizer (environments speak text)")
        self.engine, self.env, self.loop = engine, env, loop
        self.on_finished, self.wake, self.delay_s = on_finished, wake, delay_s
        self.max_turns = getattr(env, "max_turns", 1)
        self._reward_is_async = inspect.iscoroutinefunction(getattr(env, "reward", None))
        self._reward_in_thread = getattr(env, "reward_in_thread", True)  # envs need not subclass Env
        # engine request id -> (episode, the task's sampling params with n = 1)
        self._live: dict[str, tuple[Episode, SamplingParams]] = {}
        self._ready: deque[tuple[Episode, SamplingParams]] = deque()  # episodes due for their next turn
        # Tasks not yet in the engine, with their prompt's token ids.
        self._backlog: deque[tuple[Any, Task, list[int], SamplingParams]] = deque()
        self._lock = threading.Lock()
        self._changed = threading.Condition()  # notified when an episode finishes or a continuation is ready
        self._logged: set[str] = set()  # env failures already logged with a traceback

    # ------------------------------------------------------------ engine thread

    def add(self, key: Any, task: Task, params: SamplingParams) -> None:
        """Start params.n episodes of `task` (their first turn shares the prompt's KV blocks).
        Bad input (a prompt too long for the context) raises ValueError here."""
        self._backlog.append((key, task, self.engine.validate_prompt(task.prompt), params))

    def _start(self, key: Any, task: Task, prompt_ids: list[int], params: SamplingParams) -> None:
        ids = self.engine.add_request(prompt_ids, params, request_id=f"ep{key}")
        single = replace(params, n=1)
        for j, rid in enumerate(ids):
            self._live[rid] = (Episode(key, j, task, prompt_ids), single)

    def has_engine_work(self) -> bool:
        return self.engine.has_unfinished() or bool(self._ready) or bool(self._backlog)

    def run_until(self, done: Callable[[], bool]) -> None:
        """Drive the engine until `done()`, which is checked whenever an episode finishes; while
        every live episode waits on its environment, sleep instead of spinning."""
        while True:
            with self._changed:
                if done():
                    return
                if not self.has_engine_work():
                    self._changed.wait(timeout=0.5)
                    continue
            self.step()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()
        self.wake()

    def step(self) -> None:
        """Queue ready continuations, run one engine step, hand finished turns to the env."""
        with self._lock:
            ready = list(self._ready)
            self._ready.clear()
        for episode, params in ready:
            self._continue(episode, params)
        while self._backlog and self.engine.num_unfinished() < self.engine.max_num_seqs:
            self._start(*self._backlog.popleft())
        if not self.engine.has_unfinished():
            return
        turns = []
        for out in self.engine.step():
            if out.finished:
                episode, params = self._live.pop(out.request_id)
                result = self.engine.pop_output(out.request_id)
                self._record_turn(episode, result)
                turns.append(self._env_step(episode, params, result.finish_reason))
        if turns:  # one hand-off to the loop thread per engine step, not one per finished turn
            self.loop.submit(_concurrently(turns))

    def _continue(self, episode: Episode, params: SamplingParams) -> None:
        rid = f"ep{episode.key}/{episode.sample}/t{episode.turns}"
        seed = None if params.seed is None else turn_seed(params.seed, episode.sample, episode.turns)
        try:
            self.engine.add_request(episode.prompt_ids + episode.token_ids, replace(params, seed=seed), request_id=rid)
        except ValueError as err:  # the conversation outgrew the context: the episode ends here
            episode.finish_reason, episode.error = "context", str(err)
            self.loop.submit(self._score(episode))
            return
        self._live[rid] = (episode, params)

    def _record_turn(self, episode: Episode, result) -> None:
        episode.turn_starts.append(len(episode.token_ids))
        episode.token_ids += result.token_ids
        episode.logprobs += result.logprobs
        episode.versions += result.versions
        episode.mask += [1] * len(result.token_ids)
        episode.text += result.text or ""
        episode.turns += 1
        episode.finish_reason = result.finish_reason

    # -------------------------------------------------------------- loop thread

    async def _env_step(self, episode: Episode, params: SamplingParams, finish_reason: str | None) -> None:
        response = None
        # A turn cut at max_tokens still goes to the env: it decides what an unfinished turn means.
        if episode.turns < self.max_turns and finish_reason != "abort":
            try:
                response = await self.env.respond(episode.task, episode.text)
            except Exception as err:
                self._fail(episode, "env.respond", err)
        if response is None:
            await self._score(episode)
            return
        tokens = self.engine.tokenizer.encode(response, add_special_tokens=False).ids
        last_version = episode.versions[-1] if episode.versions else self.engine.version
        episode.token_ids += tokens
        episode.logprobs += [0.0] * len(tokens)
        episode.versions += [last_version] * len(tokens)
        episode.mask += [0] * len(tokens)
        episode.text += response
        with self._lock:
            self._ready.append((episode, params))
        self._notify()

    async def _score(self, episode: Episode) -> None:
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if not episode.failed:
                if self._reward_is_async:
                    episode.reward = float(await self.env.reward(episode.task, episode.text))
                elif not self._reward_in_thread:
                    episode.reward = float(self.env.reward(episode.task, episode.text))
                else:
                    episode.reward = float(await asyncio.to_thread(self.env.reward, episode.task, episode.text))
        except GraderTimeout:
            episode.reward, episode.grader_timeout = 0.0, True
        except Exception as err:
            self._fail(episode, "env.reward", err)
        self.on_finished(episode)
        self._notify()

    def _fail(self, episode: Episode, where: str, err: Exception) -> None:
        # One traceback per kind of failure: a broken env must not flood the log.
        if where not in self._logged:
            self._logged.add(where)
            log.warning("%s raised on task %s (later failures are only counted)", where, episode.task.index, exc_info=err)
        episode.failed, episode.reward, episode.error = True, 0.0, f"{where}: {type(err).__name__}: {err}"
