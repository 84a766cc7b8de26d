"""Run untrusted Python in a subprocess fenced in by the operating system.

``run_python(code)`` runs *code* with ``python -I -S`` in a child process. How it is fenced in
depends on what the machine allows: ``SandboxResult.mechanism`` says what a run got, and
``mechanism()`` says what this machine gives (it runs one probe, once).

Isolation (``Mechanism.isolation``):

* ``"namespaces"`` -- the caller is root and may ``unshare``. The code runs as a fresh, otherwise
  unused uid/gid (one per run, no supplementary groups, ``PR_SET_NO_NEW_PRIVS``) in new PID,
  mount and network namespaces:

  - Filesystem: the root is a small read-only tmpfs that holds only the runtime, bind-mounted
    read-only: ``/usr``, ``/bin``, ``/sbin``, ``/lib*`` (as symlinks where the host has
    symlinks), ``/etc/ld.so.cache``, the Python installation at its own path, and
    ``/dev/{null,zero,full,random,urandom}``. It also holds a fresh ``/proc``, the script, and
    the working directory: a private, size-capped tmpfs at the same path as on the host, the
    only writable place, gone with the run. The host's root is detached (``pivot_root``), so
    nothing else is reachable: not ``/tmp``, ``/etc``, ``/home``, ``/sys``, or other runs.
  - Processes: ``/proc`` belongs to the new PID namespace and is mounted ``hidepid=2``, so it
    lists only the code's own processes. The namespace's init is a root supervisor. When the
    code's main process exits, the supervisor exits too, and the kernel kills whatever is left
    in the namespace. So the result comes when the main process exits, and nothing outlives it.
  - Network: the namespace has only a downed loopback device. ``bind`` succeeds (even to
    ``127.0.0.1``) but is harmless: every ``connect``/``sendto`` fails with "Network is
    unreachable", and nothing outside the namespace can reach in (abstract Unix sockets are
    per namespace too).

* ``"uid"`` -- root, but ``unshare`` is refused (e.g. a container without ``CAP_SYS_ADMIN``):
  the fresh uid only. Files are protected only by their permissions, so world-readable files
  stay readable (including other runs' files in ``/tmp`` and ``/proc/*/cmdline``), and the
  network is reachable. The root supervisor kills every process of the uid when the main one
  exits.
* ``"none"`` -- the caller is not root: resource limits only, with the caller's uid and
  rights. What the main process leaves in its process group is killed when it exits.

Limits, in every mode: ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address space per
process), ``RLIMIT_NPROC`` (process count), ``RLIMIT_FSIZE`` (largest file),
``RLIMIT_NOFILE``, ``RLIMIT_CORE = 0``, plus a wall-clock limit and an output cap that the
parent enforces. Memory of the run as a whole (``Mechanism.memory``):

* ``"cgroup v2"`` / ``"cgroup v1"``: the code runs in a fresh memory cgroup below the caller's
  own, capped at ``total_memory_bytes``. The cap covers RAM, tmpfs files, and swap where the
  kernel accounts it. Over the cap, the kernel OOM-kills inside that cgroup only. v2 needs the
  ``memory`` controller delegated to the caller's cgroup (in its ``cgroup.subtree_control``,
  or enabled there by this module); v1 needs a writable memory hierarchy.
* ``"nproc"`` (no usable cgroup): ``RLIMIT_AS`` is lowered to at most ``total_memory_bytes``
  and ``RLIMIT_NPROC`` to ``total_memory_bytes // RLIMIT_AS``, so that processes x address
  space stays within the total. This bounds
  virtual memory, so it is stricter than the cgroup: fewer processes and threads can run.

Each gap is also listed in ``SandboxResult.warnings``. Not isolated in any mode:

* CPU time is per process: a program may use up to ``max_processes * cpu_seconds`` CPU
  seconds in total, but never more than ``wall_seconds`` of wall time.
* No seccomp filter: the kernel's syscall surface is the one any unprivileged user has.
"""

from __future__ import annotations

import functools
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

# The cgroup module, not its names: `_cgroup_parent` is looked up at each call (tests replace it).
from rzero.envs.sandbox import cgroup as _memcg
from rzero.envs.sandbox.child import (
    _NO_NAMESPACES,
    _NOTE,
    _SETUP_FAILED,
    _kill_uid,
    _make_preexec,
    _pids_of_uid,
    _runtime_paths,
)

__all__ = ["Mechanism", "SandboxResult", "mechanism", "run_python"]


@dataclass(frozen=True)
class Mechanism:
    """What fenced a run in; see the module docstring for what each value guarantees."""

    isolation: str  # "namespaces" | "uid" | "none"
    memory: str  # "cgroup v2" | "cgroup v1" | "nproc"

    def __str__(self) -> str:
        return f"isolation={self.isolation}, memory={self.memory}"


@dataclass(frozen=True)
class SandboxResult:
    ok: bool
    stdout: str
    stderr: str
    error: str | None
    exit_code: int | None
    wall_time: float
    uid: int | None = None  # uid the code ran as (None: the caller's own)
    warnings: tuple[str, ...] = field(default_factory=tuple)
    mechanism: Mechanism | None = None  # None when the sandbox did not start


class _CappedReader(threading.Thread):
    def __init__(self, stream, budget: "_Budget"):
        super().__init__(daemon=True)
        self.stream, self.budget, self.data = stream, budget, bytearray()

    def run(self) -> None:
        while True:
            try:
                chunk = os.read(self.stream.fileno(), 65536)
            except OSError:
                break
            if not chunk:
                break
            take = self.budget.take(len(chunk))
            self.data += chunk[:take]
            if take < len(chunk):
                self.budget.overflow()
        self.stream.close()


class _Budget:
    def __init__(self, total: int, on_overflow):
        self.left, self.lock, self.overflowed, self._on_overflow = total, threading.Lock(), False, on_overflow

    def take(self, n: int) -> int:
        with self.lock:
            k = min(n, self.left)
            self.left -= k
            return k

    def overflow(self) -> None:
        with self.lock:
            first = not self.overflowed
            self.overflowed = True
        if first:
            self._on_overflow()


def _classify(rc: int, stderr: str, cpu_seconds: float) -> str:
    if rc < 0:
        sig = -rc
        if sig == signal.SIGXCPU or sig == signal.SIGKILL:
            # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one.
            return f"cpu time limit exceeded ({cpu_seconds}s)" if sig == signal.SIGXCPU else "killed (SIGKILL)"
        if sig == signal.SIGXFSZ:
            return "file size limit exceeded"
        if sig == signal.SIGSEGV:
            return "crashed (SIGSEGV; possibly memory limit)"
        return f"killed by signal {signal.Signals(sig).name}"
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    last = lines[-1].strip() if lines else ""
    if "MemoryError" in last or "Cannot allocate memory" in last:
        return "memory limit exceeded"
    if "Resource temporarily unavailable" in last and ("BlockingIOError" in last or "fork" in stderr):
        return f"process limit exceeded: {last}"
    if "Errno 101" in last or "Network is unreachable" in last or "Errno 99" in last or "Cannot assign requested" in last:
        return f"network unavailable: {last}"
    if "ConnectionRefusedError" in last:
        return f"network error: {last}"
    if "PermissionError" in last or "Read-only file system" in last:
        return f"permission denied: {last}"
    if "File too large" in last:
        return "file size limit exceeded"
    return f"exit code {rc}: {last}" if last else f"exit code {rc}"


def run_python(
    code: str,
    *,
    cpu_seconds: float = 2,
    wall_seconds: float = 5,
    memory_bytes: int = 256 << 20,
    total_memory_bytes: int = 512 << 20,
    max_output_bytes: int = 64 << 10,
    max_processes: int = 16,
    max_file_bytes: int = 16 << 20,
    disk_bytes: int = 32 << 20,
) -> SandboxResult:
    """Run *code* under the limits above; never raises for anything the code does.

    ``memory_bytes`` caps each process's address space, ``total_memory_bytes`` the memory of
    all of the run's processes together (see ``Mechanism.memory``). ``error`` is ``None`` on a
    clean exit with status 0, else a short human-readable reason ("timeout: wall time 5s
    exceeded", "memory limit exceeded", "output truncated at N bytes", "cpu time limit
    exceeded (2s)", "process limit exceeded: ...", "permission denied: ...", "network
    unavailable: ...", "exit code 1: <last stderr line>"). ``max_output_bytes`` caps stdout
    and stderr together. The result comes when the code's main process exits; processes it
    left behind are killed.
    """
    start = time.monotonic()
    is_root = os.geteuid() == 0
    uid = 1_000_000 + secrets.randbelow(1_000_000_000) if is_root else None
    warnings: list[str] = []
    if not is_root:
        warnings.append("not root: no namespaces and no uid drop; RLIMIT_NPROC counts all of the caller's processes")

    cgroup = None
    parent = _memcg._cgroup_parent()
    if parent is not None:
        try:
            cgroup = _memcg._Cgroup(*parent, total_memory_bytes)
        except OSError as e:
            warnings.append(f"memory cgroup not created ({e})")
    nproc = max_processes
    if cgroup is None:
        memory_bytes = min(memory_bytes, total_memory_bytes)
        nproc = max(1, min(max_processes, total_memory_bytes // memory_bytes))
        warnings.append(f"no memory cgroup: total memory bounded by {nproc} processes x {memory_bytes} bytes")
    memory = f"cgroup v{cgroup.version}" if cgroup is not None else "nproc"
    ncpu = max(1, int(-(-cpu_seconds // 1)))
    limits = [
        (resource.RLIMIT_CPU, ncpu, ncpu + 1),
        (resource.RLIMIT_AS, memory_bytes, memory_bytes),
        (resource.RLIMIT_FSIZE, max_file_bytes, max_file_bytes),
        (resource.RLIMIT_NOFILE, 64, 64),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_NPROC, nproc, nproc),
    ]

    tmpdir = tempfile.mkdtemp(prefix="rzero-sandbox-")
    proc = None
    try:
        os.chmod(tmpdir, 0o755)
        workdir = os.path.join(tmpdir, "work")
        os.mkdir(workdir, 0o700)
        if uid is not None:
            os.chown(workdir, uid, uid)  # without namespaces there is no tmpfs over it
        os.mkdir(os.path.join(tmpdir, "root"))
        script = os.path.join(tmpdir, "main.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(code)
        os.chmod(script, 0o644)

        preexec = _make_preexec(tmpdir=tmpdir, workdir=workdir, script=script, runtime=_runtime_paths(), uid=uid,
                                cgroup_join=None if cgroup is None else cgroup.join_fd, limits=limits,
                                disk_bytes=disk_bytes)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "HOME": workdir,
               "TMPDIR": workdir}

        def kill_all() -> None:
            if uid is not None:
                _kill_uid(uid)
            elif proc is not None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

        try:
            proc = subprocess.Popen(
                [os.path.realpath(sys.executable), "-I", "-S", "-B", script], cwd=workdir, env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                preexec_fn=preexec, close_fds=True,
            )
        except (OSError, subprocess.SubprocessError) as e:
            return SandboxResult(False, "", "", f"sandbox failed to start: {e}", None,
                                 time.monotonic() - start, uid, tuple(warnings))

        budget = _Budget(max_output_bytes, kill_all)
        readers = [_CappedReader(proc.stdout, budget), _CappedReader(proc.stderr, budget)]
        for r in readers:
            r.start()
        timed_out = False
        try:
            proc.wait(timeout=max(0.0, wall_seconds - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_all()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        # With a uid, ``proc`` is a root supervisor that exits only after every process of the
        # run is dead, unless it was itself killed from outside (say, by the host's OOM killer).
        if uid is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        elif _pids_of_uid(uid):
            _kill_uid(uid)
        for r in readers:
            r.join(timeout=5)
        wall = time.monotonic() - start

        stdout = bytes(readers[0].data).decode("utf-8", "replace")
        notes, err_lines = [], []
        for line in bytes(readers[1].data).split(b"\n"):
            if line.startswith(_NOTE):
                notes.append(line[len(_NOTE):].decode("utf-8", "replace"))
            else:
                err_lines.append(line)
        warnings += notes
        stderr = b"\n".join(err_lines).decode("utf-8", "replace")
        rc = proc.returncode
        isolation = "none" if uid is None else "uid" if any(n.startswith(_NO_NAMESPACES) for n in notes) else "namespaces"
        failed_setup = [n for n in notes if n.startswith(_SETUP_FAILED)]

        if failed_setup:
            error = f"sandbox failed to start: {failed_setup[0]}"
        elif budget.overflowed:
            error = f"output truncated at {max_output_bytes} bytes"
        elif timed_out:
            error = f"timeout: wall time {wall_seconds}s exceeded"
        elif rc == 0:
            error = None
        elif rc == -signal.SIGKILL and cgroup is not None and cgroup.oom_kills():
            error = "memory limit exceeded"
        else:
            error = _classify(rc, stderr, cpu_seconds)
        return SandboxResult(error is None, stdout, stderr, error, rc, wall, uid, tuple(warnings),
                             Mechanism(isolation, memory))
    finally:
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(tmpdir, ignore_errors=True)


@functools.cache
def mechanism() -> Mechanism | None:
    """What fences code in on this machine: the mechanism of one probe run (cached)."""
    return run_python("pass").mechanism
