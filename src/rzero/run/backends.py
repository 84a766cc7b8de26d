"""The rollout backend a run uses: worker processes, worker threads in this process, or Ray actors.

`check_backend(config)` fails before anything starts when the backend cannot run (Ray missing);
`make_backend(...)` builds the backend, and for Ray also connects to (or starts) the cluster and
reserves one placement-group bundle per rollout actor, releasing both when `resources` closes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import sys
from dataclasses import dataclass
from typing import Any

import torch

from rzero.config import RunConfig
from rzero.engine import Engine, SamplingParams
from rzero.envs import make_env as build_env
from rzero.model.io import parse_dtype
from rzero.ops import resolve_device
from rzero.rollout.orchestrator import LocalBackend, Orchestrator
from rzero.run.cluster import open_cluster, require_ray, reserve
from rzero.train.trainer import Trainer


@dataclass
class EngineFactory:
    """Builds a rollout engine; picklable, so worker processes and Ray actors build their own from it."""

    model: Any  # the engine template (the trainer's compute model at the start); each engine copies it
    numerics: Any
    dtype: Any
    tokenizer: Any
    recompute_on_update: bool
    seed: int
    version: int
    decode_steps_per_call: int = 16

    def __call__(self) -> Engine:
        return Engine(
            self.model,
            numerics=self.numerics,
            dtype=self.dtype,
            tokenizer=self.tokenizer,
            recompute_on_update=self.recompute_on_update,
            seed=self.seed,
            version=self.version,
            decode_steps_per_call=self.decode_steps_per_call,
        )


@dataclass
class GivenEnv:
    """The environment a caller passed to train(), rebuilt in each worker process or actor from its pickle."""

    env: Any

    def __call__(self):
        return self.env


def check_backend(config: RunConfig) -> None:
    """Fail at once, in one line, when the configured backend cannot run here."""
    if config.rollout.backend == "ray":
        require_ray("rollout.backend = 'ray'")


def resolved_backend(config: RunConfig, env=None) -> str:
    """rollout.backend with "auto" decided: worker processes for a model on the CPU, threads for
    one on a GPU (its engines share the trainer's device), and threads for an environment given to
    train() that cannot be pickled to another process (and off POSIX, where a worker process
    cannot inherit its pipe)."""
    backend = config.rollout.backend
    if backend != "auto":
        return backend
    if resolve_device(config.model.device).type != "cpu" or os.name != "posix":
        return "local"
    if env is not None:
        try:
            pickle.dumps(env)
        except Exception:  # noqa: BLE001 (any pickling failure: keep it in this process)
            return "local"
    return "process"


def _env_factory(ray, config: RunConfig, env):
    if env is None:
        return functools.partial(build_env, config.env, seed=config.run.seed)
    module = sys.modules.get(type(env).__module__)
    if module is not None and not module.__name__.startswith("rzero"):
        # A class from a script or a test module: the actors cannot import it, so send it whole.
        ray.cloudpickle.register_pickle_by_value(module)
    try:
        ray.cloudpickle.dumps(env)
    except Exception as err:  # noqa: BLE001 (reported in one line)
        raise ValueError(
            f"the environment given to train() cannot be sent to Ray actors ({type(err).__name__}: {err}); "
            "pass a picklable environment or use rollout.backend = 'local'"
        ) from None
    return GivenEnv(env)


def make_backend(
    config: RunConfig,
    engine: EngineFactory,
    env,
    state: dict | None,
    resources: contextlib.ExitStack,
) -> Orchestrator:
    """The run's rollout backend. `env` overrides the configured environment (None: build it from
    config.env); cluster connections and reservations are closed with `resources`."""
    r = config.rollout
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens)
    common = dict(
        prompts_per_step=r.prompts_per_step,
        group_size=r.group_size,
        max_lag=r.max_lag,
        sampling=sampling,
        seed=config.run.seed,
        workers=r.workers,
        weight_update_interval=r.weight_update_interval,
        rollout_delay_s=config.env.rollout_delay_s,
        state=state,
    )
    backend = resolved_backend(config, env)
    if backend == "local":
        return LocalBackend(engine, env if env is not None else build_env(config.env, seed=config.run.seed), **common)
    if backend == "process":
        from rzero.rollout.process_backend import ProcessBackend

        make_env = functools.partial(build_env, config.env, seed=config.run.seed) if env is None else GivenEnv(env)
        # The workers score each token under its own version for the decomposition, off the
        # trainer's critical path, when they hold what the trainer would score with (its dtype)
        # and there is lag to split (at max_lag 0 the trainer's own π is π_θv: nothing to do).
        scores = config.diagnostics.decompose and r.max_lag > 0 and engine.dtype == parse_dtype(config.model.dtype)
        score = Trainer.token_logprobs if scores else None
        return ProcessBackend(engine, make_env, threads=torch.get_num_threads(), score=score, **common)
    if backend != "ray":  # the config rejects other names; this guards direct callers
        raise ValueError(f"unknown rollout.backend {backend!r}: 'auto', 'process', 'local' or 'ray'")
    from rzero.rollout.ray_backend import RayBackend

    ray = resources.enter_context(open_cluster(config.cluster, r.workers * r.cpus_per_worker, "rollout.backend = 'ray'"))
    make_env = _env_factory(ray, config, env)
    bundles = [{"CPU": r.cpus_per_worker, "GPU": r.gpus_per_worker} for _ in range(r.workers)]
    group = reserve(ray, bundles, config.cluster.connect_timeout_s, name="rzero-rollout")
    resources.callback(_remove_group, ray, group)
    return RayBackend(
        ray,
        engine,
        make_env,
        placement_group=group,
        cpus_per_worker=r.cpus_per_worker,
        gpus_per_worker=r.gpus_per_worker,
        **common,
    )


def _remove_group(ray, group) -> None:
    from ray.util.placement_group import remove_placement_group

    if ray.is_initialized():
        remove_placement_group(group)
