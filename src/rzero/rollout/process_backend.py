"""`ProcessBackend`: each rollout worker in a process of its own, on this machine.

Why not threads: the engine and the trainer both spend much of a step in Python (op dispatch), and
in one process they take turns on the GIL. On two cores a worker thread made the default job's
training step 1.7x slower than the same step alone; a worker process leaves it unslowed
(docs/benchmarks.md). The driver side (a proxy thread per worker, faults) is `RemoteBackend`'s,
as for Ray actors; here a call is one message each way on a pipe to `_main`, which runs a
`RolloutWorker`.

Weights travel once per version: `publish` copies the state dict into one shared-memory buffer per
dtype (`SharedWeights`) and every worker maps the same buffers when its load is due. A worker whose
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

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state dict again, as views of the shared buffers."""
        return {
            name: buffer[offset : offset + torch.Size(shape).numel()].view(shape)
            for buffer, index in self.buffers
            for name, shape, offset in index
        }


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
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        weights, version, starts, wait = message
        try:
            reply = ("ok", worker.work(None if weights is None else weights.tensors(), version, starts, wait))
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

    def _share(self, weights):
        return SharedWeights(weights)

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
            conn.send((weights, version, starts, wait))
            kind, payload = conn.recv()
        except (EOFError, OSError) as err:
            code = _reap(process)
            conn.close()
            self.workers[i] = self._launch(i)  # a new life; it loads weights on its first call
            self._await_ready(i)
            raise WorkerLost(f"rollout worker process {i} (pid {process.pid}) died (exit code {code})") from err
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
