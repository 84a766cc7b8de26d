"""The Ray cluster a distributed run uses, and the resources it reserves there.

`open_cluster(section, cpus_needed)` is a context: with `cluster.address` empty it starts a private
local Ray instance for the run and shuts it down after; with "auto" or "ray://host:port" it joins
an existing cluster (and leaves it running). `reserve(bundles)` reserves every actor's resources in
one placement group, so a run starts whole or not at all: a request the cluster can never hold
fails at once, naming what is missing, and one it cannot hold now fails after the connect timeout.
Ray is the optional `distributed` extra; without it a Ray run fails before anything starts.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from types import ModuleType

EXTRA_HINT = "pip install -e '.[distributed]'"


def needs_ray(config) -> bool:
    """Whether a run config asks for Ray (rollout actors or data-parallel trainer ranks)."""
    return config.rollout.backend == "ray" or config.train.world_size > 1


def cpus_needed(config) -> float:
    """CPUs the run's actors ask Ray for (the driver, trainer rank 0, takes none)."""
    r = config.rollout
    return (r.workers * r.cpus_per_worker if r.backend == "ray" else 0) + (config.train.world_size - 1)


def require_ray(what: str) -> ModuleType:
    """The `ray` module, or a one-line ValueError naming the extra that provides it."""
    try:
        import ray
    except ImportError:
        raise ValueError(f"{what} needs Ray, which is not installed: {EXTRA_HINT}") from None
    return ray


@contextlib.contextmanager
def open_cluster(section, cpus_needed: float, what: str = "a Ray run") -> Iterator[ModuleType]:
    """Connect to (or start) the run's Ray cluster for the duration of the block.

    `section` is the config's [cluster] section; `cpus_needed` the CPUs the run's actors ask for
    (a private instance declares at least that many, so it always fits, even on a small machine).
    """
    ray = require_ray(what)
    if ray.is_initialized():  # a caller (a test, a notebook) already connected: use its cluster
        yield ray
        return
    kwargs = dict(include_dashboard=False, log_to_driver=True, namespace="rzero", configure_logging=False)
    if not section.address:
        ray.init(num_cpus=max(os.cpu_count() or 1, int(-(-cpus_needed // 1))), **kwargs)
    else:
        _connect(ray, section.address, section.connect_timeout_s, kwargs)
    try:
        yield ray
    finally:
        ray.shutdown()


def _connect(ray: ModuleType, address: str, timeout_s: float, kwargs: dict) -> None:
    """ray.init(address) with a deadline: an unreachable address fails in timeout_s, not minutes."""
    done: dict = {}

    def connect() -> None:
        try:
            ray.init(address=address, **kwargs)
            done["ok"] = True
        except Exception as err:  # noqa: BLE001 (reported below, in one line)
            done["error"] = err

    thread = threading.Thread(target=connect, name="ray-connect", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "ok" in done:
        return
    if thread.is_alive():
        raise ValueError(f"cannot reach the Ray cluster at {address!r} within {timeout_s:g} s (cluster.address)")
    err = done["error"]
    raise ValueError(f"cannot connect to the Ray cluster at {address!r}: {type(err).__name__}: {err}".splitlines()[0])


def reserve(ray: ModuleType, bundles: list[dict[str, float]], timeout_s: float, name: str = "rzero-run"):
    """One placement group holding every bundle ({"CPU": 1, "GPU": 0, ...} per actor), ready.

    Raises ValueError naming the missing resources when the cluster's totals cannot hold the
    request, or when the group is not placed within timeout_s (resources held by other jobs).
    """
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = [{k: v for k, v in b.items() if v} or {"CPU": 0.001} for b in bundles]
    wanted: dict[str, float] = {}
    for b in bundles:
        for key, value in b.items():
            wanted[key] = wanted.get(key, 0.0) + value
    have = ray.cluster_resources()
    missing = [f"{v:g} {k} (the cluster has {have.get(k, 0):g})" for k, v in sorted(wanted.items()) if v > have.get(k, 0) + 1e-9]
    if missing:
        raise ValueError(f"the run asks Ray for more than the cluster has: {', '.join(missing)}")
    group = placement_group(bundles, strategy="PACK", name=name)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise ValueError(
            f"Ray could not place the run's actors within {timeout_s:g} s ({wanted} asked, "
            f"{ray.available_resources()} free): other jobs hold the resources"
        )
    return group
