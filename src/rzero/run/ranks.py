"""Data-parallel trainer ranks (train.world_size = K > 1) as Ray actors around the driver.

Rank 0 is the driver process: it keeps the run's Trainer, publishes weights, writes metrics and
checkpoints. Ranks 1..K-1 are Ray actors (one placement-group bundle each: {"CPU": 1, "GPU":
train.gpus_per_rank}), each holding a Trainer replica built from the same fp32 master weights,
settings and trainer state (on resume: the checkpoint's). All K join one `torch.distributed`
process group (gloo on CPU, NCCL on GPU; rendezvous at a free TCP port on the driver's node).
Every step every rank runs the same `train_step(groups)`; rzero.train.data_parallel spreads the
micro-batches and reduces the gradients, so the replicas never need a weight broadcast.

The run loop uses `TrainerRanks` in four places: build it (checks Ray before anything starts),
`start(trainer)`, `train_step(trainer, groups)` each step, `close()` at the end (also on errors).
With world_size 1 it is a pass-through. A rank that dies stops the run with a clear message
naming the rank; collectives and Ray calls have deadlines, so it never hangs.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from rzero.run.cluster import open_cluster, require_ray, reserve
from rzero.train.data_parallel import backend_for, make_reducer
from rzero.train.trainer import Trainer

# Deadline of one collective (gloo/NCCL: it includes waiting for the slowest rank's micro-batches)
# and of one step's Ray calls. A killed rank shows at once (connection reset, ActorDiedError); this
# only bounds a rank that hangs or a lost node. Raise it (RZERO_RANK_TIMEOUT_S) for steps longer
# than this on large models.
DEFAULT_TIMEOUT_S = float(os.environ.get("RZERO_RANK_TIMEOUT_S", "600"))


class RankActor:
    """One trainer rank in its own process (wrapped with ray.remote by TrainerRanks.start)."""

    def pid(self) -> int:
        return os.getpid()

    def setup(self, init_method: str, rank: int, world_size: int, backend: str, timeout_s: float,
              master, dtype, settings, numerics, state: dict, grad_reduce: str, threads: int) -> int:
        torch.set_num_threads(threads)
        self.trainer = Trainer(master, dtype, settings, numerics=numerics)
        self.trainer.load_state_dict(state)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        self.trainer.reducer = make_reducer(grad_reduce)
        return os.getpid()

    def train_step(self, groups) -> int:
        self.trainer.train_step(groups)
        return self.trainer.version

    def master_state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.trainer.master.state_dict().items()}


class TrainerRanks:
    def __init__(self, config, run_dir: Path, log=print, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.world_size = config.train.world_size
        self.config, self.run_dir, self.log, self.timeout_s = config, run_dir, log, timeout_s
        self.actors: list = []
        self.pids: list[int] = []
        self._stack = contextlib.ExitStack()
        self._ray = None
        if self.world_size > 1:
            require_ray("train.world_size > 1")  # one line naming the extra, before anything starts

    def start(self, trainer: Trainer) -> None:
        """Start ranks 1..K-1 from `trainer`'s weights and state and join the process group."""
        if self.world_size == 1:
            return
        try:
            self._start(trainer)
        except BaseException:
            self.close(trainer)
            raise

    def _start(self, trainer: Trainer) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        c, t = self.config, self.config.train
        k = self.world_size
        # The cluster must hold the actor ranks (the driver is rank 0).
        ray = self._ray = self._stack.enter_context(open_cluster(c.cluster, k - 1, "train.world_size > 1"))
        bundles = [{"CPU": 1.0, "GPU": t.gpus_per_rank} for _ in range(k - 1)]
        group = reserve(ray, bundles, c.cluster.connect_timeout_s, name="rzero-trainer-ranks")
        self._stack.callback(_remove_group, group)
        remote = ray.remote(RankActor)
        self.actors = [
            remote.options(
                num_cpus=1, num_gpus=t.gpus_per_rank, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
            ).remote()
            for i in range(k - 1)
        ]
        device = next(trainer.compute.parameters()).device
        backend = backend_for(device)
        addr = ray.util.get_node_ip_address()
        init_method = f"tcp://{addr}:{_free_port()}"
        master_ref = ray.put(trainer.master)
        state_ref = ray.put(trainer.state_dict())
        dtype = next(trainer.compute.parameters()).dtype
        # Same torch thread count as the driver (the invariant kernels do not need it; stock
        # backward kernels may).
        threads = torch.get_num_threads()
        setups = [
            a.setup.remote(init_method, rank, k, backend, self.timeout_s, master_ref, dtype, trainer.settings,
                           c.model.numerics, state_ref, t.grad_reduce, threads)
            for rank, a in enumerate(self.actors, start=1)
        ]
        joined: dict = {}

        def join() -> None:
            try:
                dist.init_process_group(backend, init_method=init_method, rank=0, world_size=k,
                                        timeout=timedelta(seconds=self.timeout_s))
                joined["ok"] = True
            except Exception as err:  # noqa: BLE001 (reported below)
                joined["error"] = err

        thread = threading.Thread(target=join, name="rzero-rank0-join", daemon=True)
        thread.start()
        self.pids = self._get(setups, "starting")
        thread.join(self.timeout_s)
        if "ok" not in joined:
            raise RuntimeError(f"trainer rank 0 could not join the process group at {init_method}: {joined.get('error', 'timed out')}")
        self._stack.callback(_destroy_group)
        trainer.reducer = make_reducer(t.grad_reduce)
        for rank, pid in enumerate(self.pids, start=1):
            self.log(f"trainer rank {rank}: pid {pid} ({backend}, grad_reduce = {t.grad_reduce})")

    def train_step(self, trainer: Trainer, groups) -> dict[str, float]:
        """One SPMD step on every rank; the driver's metrics (rank 0 gathers the logprobs)."""
        if not self.actors:
            return trainer.train_step(groups)
        ref = self._ray.put(groups)
        futures = [a.train_step.remote(ref) for a in self.actors]
        step = trainer.version
        try:
            metrics = trainer.train_step(groups)
        except Exception:
            # A collective failed (gloo: connection reset by a dead peer) or timed out: say which
            # rank died when one did; otherwise the driver's own error stands.
            self._raise_if_dead(futures, f"step {step}")
            raise
        self._get(futures, f"step {step}")
        return metrics

    def master_states(self) -> list[dict[str, torch.Tensor]]:
        """Every actor rank's fp32 master weights (tests assert they equal the driver's)."""
        return self._get([a.master_state.remote() for a in self.actors], "reading weights")

    def close(self, trainer: Trainer | None = None) -> None:
        """Stop the ranks, leave the process group, release the placement group and the cluster."""
        ray, self._ray = self._ray, None
        if trainer is not None:
            trainer.reducer = None
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        self.actors = []
        self._stack.close()

    def _raise_if_dead(self, futures: list, doing: str, wait_s: float = 10.0) -> None:
        from ray.exceptions import RayActorError

        ready, _ = self._ray.wait(futures, num_returns=len(futures), timeout=wait_s)
        for rank, f in enumerate(futures, start=1):
            if f in ready:
                try:
                    self._ray.get(f, timeout=0)
                except RayActorError as err:
                    raise RuntimeError(self._died(rank, doing, err)) from None
                except Exception:  # noqa: BLE001 (the rank's own error: the driver's is raised)
                    pass

    def _died(self, rank: int, doing: str, err: BaseException) -> str:
        return (f"trainer rank {rank} died ({doing}: {type(err).__name__}); the run stopped; "
                f"resume with --resume {self.run_dir}")

    def _get(self, futures: list, doing: str, timeout_s: float | None = None) -> list:
        """ray.get with a deadline; a dead or failed rank becomes one clear RuntimeError."""
        ray = self._ray
        from ray.exceptions import GetTimeoutError, RayActorError

        out = []
        for rank, f in enumerate(futures, start=1):
            try:
                out.append(ray.get(f, timeout=timeout_s or self.timeout_s))
            except RayActorError as err:
                raise RuntimeError(self._died(rank, doing, err)) from None
            except GetTimeoutError:
                raise RuntimeError(
                    f"trainer rank {rank} did not answer within {timeout_s or self.timeout_s:g} s ({doing}); "
                    f"the run stopped; resume with --resume {self.run_dir}"
                ) from None
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _remove_group(group) -> None:
    from ray.util.placement_group import remove_placement_group

    with contextlib.suppress(Exception):
        remove_placement_group(group)
