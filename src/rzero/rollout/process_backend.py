"""`ProcessBackend`: each rollout worker in a process of its own, on this machine.

Why not threads: the engine and the trainer both spend much of a step in Python (op dispatch), and
in one process they take turns on the GIL. On two cores a worker thread made the default job's
training step 1.7x slower than the same step alone; a worker process leaves it unslowed
(docs/benchmarks.md). The driver side (a proxy thread per worker, faults) is `RemoteBackend`'s,
as for Ray actors; here a call is one message each way on a pipe to `_main`, which runs a
`RolloutWorker`.

Weights travel once per version: `publish` copies the state dict into a slot of shared-memory
buffers (`SharedWeights`, one buffer per dtype) and every worker reads that slot when its load is
due. Slots are reused: each worker maps a slot's buffers once, and a later version in the same slot
is one copy on the driver and a slot number in the message (`_WeightSlots`). A worker whose
process dies (`kill -9`, out of memory) is started again; its groups are sampled again from
scratch. A worker exits when the driver says so or when its end of the pipe closes (the driver
died).

A worker is a fresh interpreter (`python -c`, running `_main`), not a multiprocessing child: spawn
would run the caller's main script again in the child, which breaks any script without an
`if __name__ == "__main__"` guard, and fork is unsafe beside OpenMP and Python threads. The child
takes the driver's sys.path (so an environment class from the caller's modules unpickles) and its
multiprocessing authkey (so shared-memory tensors can be handed over).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import pickle
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers the shared-memory pickling of tensors)

from rzero.rollout.remote import RemoteBackend, WorkerLost
from rzero.rollout.worker import RolloutWorker

_STARTUP_TIMEOUT_S = 120.0  # import and engine build of a new worker


class SharedWeights:
    """A state dict as one shared-memory buffer per dtype: pickled, it is a handle to the buffers,
    so a worker maps them instead of copying them through the pipe."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in weights.items():
            by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
        self.buffers: list[tuple[torch.Tensor, list[tuple[str, tuple[int, ...], int]]]] = []
        for dtype, items in by_dtype.items():
            buffer = torch.empty(sum(t.numel() for _, t in items), dtype=dtype).share_memory_()
            index, offset = [], 0
            for name, tensor in items:
                buffer[offset : offset + tensor.numel()].copy_(tensor.reshape(-1))
                index.append((name, tuple(tensor.shape), offset))
                offset += tensor.numel()
            self.buffers.append((buffer, index))

    def fits(self, weights: dict[str, torch.Tensor]) -> bool:
        """Whether `weights` has exactly this state dict's names, shapes and dtypes."""
        layout = {name: (shape, buffer.dtype) for buffer, index in self.buffers for name, shape, _ in index}
        return layout == {name: (tuple(t.shape), t.dtype) for name, t in weights.items()}

    def copy_from(self, weights: dict[str, torch.Tensor]) -> None:
        """Overwrite the buffers with `weights` (of this layout: `fits`)."""
        views = self.tensors()
        with torch.no_grad():
            for name, tensor in weights.items():
                views[name].copy_(tensor)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state dict again, as views of the shared buffers."""
        return {
            name: buffer[offset : offset + torch.Size(shape).numel()].view(shape)
            for buffer, index in self.buffers
            for name, shape, offset in index
        }


class _WeightSlots:
    """The shared-memory slots published versions take turns in (driver side).

    A fresh shared segment per version cost more than the copy into it: creating it, then handing
    its file descriptor to each worker through the resource sharer, ~9 ms per version for the tiny
    model on one thread, on the synchronous step's critical path (docs/benchmarks.md). A slot is
    written again only when no worker can read it any more: it is not the newest version, no worker
    thread has taken it to send, and no worker keeps it, that is, it holds none of the versions a
    worker loaded that its scorer may still read (its loaded version and the keep - 1 before it).
    Each worker life is sent a slot's buffers once; after that a load names the slot."""

    def __init__(self, keep_versions: int):
        self.keep = keep_versions
        self.slots: list[SharedWeights] = []
        self.taken: dict[int, int] = {}  # worker thread -> slot it is sending
        self.kept: dict[int, list[tuple[int, int]]] = {}  # worker -> (version, slot) it may read
        self.mapped: dict[int, set[int]] = {}  # worker -> slots its current life has the buffers of

    def free_slot(self, weights: dict[str, torch.Tensor], newest: int | None) -> int | None:
        """A slot `weights` may be written into now (None: none is free). `newest`: the slot of the
        newest published version. Called under the backend's lock; the write itself need not be:
        no worker takes a slot before it is published, and only the trainer's thread publishes."""
        busy = {newest, *self.taken.values()} | {slot for kept in self.kept.values() for _, slot in kept}
        return next((i for i, slot in enumerate(self.slots) if i not in busy and slot.fits(weights)), None)

    def message(self, worker: int, slot: int) -> tuple[int, SharedWeights | None]:
        """What a load of `slot` sends worker `worker`: the slot, and its buffers the first time."""
        mapped = self.mapped.setdefault(worker, set())
        first = slot not in mapped
        mapped.add(slot)
        return slot, (self.slots[slot] if first else None)

    def loaded(self, worker: int, version: int, slot: int) -> None:
        kept = [(v, s) for v, s in self.kept.get(worker, []) if v > version - self.keep]
        self.kept[worker] = [*kept, (version, slot)]

    def new_life(self, worker: int) -> None:
        """Worker `worker` was started again: it keeps and has mapped nothing."""
        self.kept.pop(worker, None)
        self.mapped.pop(worker, None)


def _main() -> None:
    """A worker process's body (`python -c ... _main() FD`): take the driver's sys.path, authkey
    and thread count, build the RolloutWorker from the next message, then answer each `work`
    message until the driver says stop (None) or its end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle: it stops us
    conn = multiprocessing.connection.Connection(int(sys.argv[1]))
    try:
        path, authkey, threads = conn.recv()
        sys.path[:] = path
        multiprocessing.current_process().authkey = authkey
        torch.set_num_threads(threads)
        args, kwargs = conn.recv()
        worker = RolloutWorker(*args, **kwargs)
    except EOFError:
        return
    except BaseException:  # noqa: BLE001 (sent to the driver, which stops the run)
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", None))
    slots: dict[int, dict[str, torch.Tensor]] = {}  # the weight slots' buffers (see _WeightSlots)
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        load, version, starts, wait = message
        try:
            if load is not None and load[1] is not None:
                slots[load[0]] = load[1].tensors()
            reply = ("ok", worker.work(None if load is None else slots[load[0]], version, starts, wait))
        except BaseException:  # noqa: BLE001
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except (BrokenPipeError, ConnectionResetError):
            return


class ProcessBackend(RemoteBackend):
    def __init__(
        self,
        make_engine: Callable[[], Any],
        make_env: Callable[[], Any],
        *,
        threads: int = 1,
        rollout_delay_s: float = 0.0,
        score=None,
        **kwargs,
    ):
        """`make_engine` and `make_env` are called inside each worker process, so they must
        pickle; `threads`: each worker's torch intra-op threads; `score`: the trainer's scoring
        function, for the workers to fill each rollout's `version_logprobs` (rzero.rollout.scoring)."""
        super().__init__(**kwargs)
        try:
            pickle.dumps(make_env)
        except Exception as err:  # noqa: BLE001 (reported in one line)
            raise ValueError(
                f"the environment cannot be sent to rollout worker processes ({type(err).__name__}: {err}); "
                "pass a picklable environment or use rollout.backend = 'local'"
            ) from None
        self.make_engine, self.make_env = make_engine, make_env
        self.threads, self.rollout_delay_s, self.score = threads, rollout_delay_s, score
        self.workers: list[tuple[subprocess.Popen, Any]] = []  # (process, driver's end of its pipe) per worker
        self.slots = _WeightSlots(keep_versions=self.max_lag + 1)

    def _share(self, weights):
        with self.cond:  # the worker threads take and release slots under this lock
            free = self.slots.free_slot(weights, newest=self.weights)
        if free is not None:
            self.slots.slots[free].copy_from(weights)
            return free
        fresh = SharedWeights(weights)
        with self.cond:
            self.slots.slots.append(fresh)
            return len(self.slots.slots) - 1

    def _next_work(self, local_version):
        weights, version, starts = super()._next_work(local_version)
        if weights is not None:  # this worker thread sends that slot: it stays unwritten until the load ends
            self.slots.taken[threading.get_ident()] = weights
        return weights, version, starts

    def start(self, weights, version: int) -> None:
        # All processes start at once; each then imports and builds its engine in parallel.
        self.workers = [self._launch(i) for i in range(self.num_workers)]
        for i in range(self.num_workers):
            self._await_ready(i)
        super().start(weights, version)

    def _launch(self, i: int) -> tuple[subprocess.Popen, Any]:
        process, conn = _take_spare(self.threads) or _spawn(self.threads)
        args = (self.make_engine, self.make_env, self.sampling, self.group_size, self.seed)
        # The newest max_lag + 1 versions' weights are kept for scoring: older tokens are stale.
        conn.send((args, dict(delay_s=self.rollout_delay_s, score=self.score, keep_versions=self.max_lag + 1)))
        return process, conn

    def _await_ready(self, i: int) -> None:
        process, conn = self.workers[i]
        if not conn.poll(_STARTUP_TIMEOUT_S):
            raise RuntimeError(f"rollout worker process {i} did not start within {_STARTUP_TIMEOUT_S:.0f} s")
        try:
            kind, payload = conn.recv()
        except EOFError:
            raise RuntimeError(f"rollout worker process {i} died while starting (exit code {_reap(process)})") from None
        if kind == "failed":  # the engine or environment could not be built: a restart cannot help
            raise RuntimeError(f"rollout worker process {i} could not start:\n{payload}")

    def _call(self, i, weights, version, starts, wait):
        process, conn = self.workers[i]
        try:
            with self.cond:
                load = None if weights is None else self.slots.message(i, weights)
            conn.send((load, version, starts, wait))
            kind, payload = conn.recv()
        except (EOFError, OSError) as err:
            code = _reap(process)
            conn.close()
            with self.cond:
                self.slots.taken.pop(threading.get_ident(), None)
                self.slots.new_life(i)
            self.workers[i] = self._launch(i)  # a new life; it loads weights on its first call
            self._await_ready(i)
            raise WorkerLost(f"rollout worker process {i} (pid {process.pid}) died (exit code {code})") from err
        with self.cond:
            self.slots.taken.pop(threading.get_ident(), None)
            if weights is not None and kind == "ok":
                self.slots.loaded(i, version, weights)
        if kind != "ok":
            raise RuntimeError(f"rollout worker process {i} raised:\n{payload}")
        return payload

    def _close(self) -> None:
        for process, conn in self.workers:
            try:
                conn.send(None)
            except OSError:
                pass  # already gone
            conn.close()
        for process, _ in self.workers:
            _reap(process, timeout=10)
        self.workers = []


def _spawn(threads: int) -> tuple[subprocess.Popen, Any]:
    """A worker interpreter, given this process's sys.path, authkey and the thread count; it
    imports torch and rzero, then waits for its worker's arguments."""
    ours, theirs = socket.socketpair()
    code = "from rzero.rollout.process_backend import _main; _main()"
    process = subprocess.Popen(
        [sys.executable, "-c", code, str(theirs.fileno())], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL
    )
    theirs.close()  # the child holds its end: when it dies, our recv sees EOF
    conn = multiprocessing.connection.Connection(ours.detach())
    conn.send((sys.path, bytes(multiprocessing.current_process().authkey), threads))
    return process, conn


# Interpreters started before their backend exists (`prespawn`), with their thread counts.
_SPARES: list[tuple[subprocess.Popen, Any, int]] = []


def prespawn(count: int, threads: int) -> None:
    """Start `count` worker interpreters now, for a ProcessBackend this process makes later with
    this many threads: their imports (~1.5 s each) then overlap the caller's work (a run's warm
    start) instead of delaying the backend's start. Spares never taken are stopped by
    `discard_spares`, or end with this process (their pipe closes)."""
    while len(_SPARES) < count:
        _SPARES.append((*_spawn(threads), threads))


def _take_spare(threads: int) -> tuple[subprocess.Popen, Any] | None:
    while _SPARES:
        process, conn, spare_threads = _SPARES.pop(0)
        if spare_threads == threads and process.poll() is None:
            return process, conn
        conn.close()
        _reap(process)
    return None


def discard_spares() -> None:
    """Stop the pre-started interpreters no backend took (their pipe closes, they exit)."""
    while _SPARES:
        process, conn, _ = _SPARES.pop()
        conn.close()
        _reap(process)


def _reap(process: subprocess.Popen, timeout: float = 5.0) -> int:
    """Wait for a worker process to end (killing it after `timeout`); its exit code."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()
