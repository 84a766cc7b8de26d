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

import ctypes
import functools
import os
import platform
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

__all__ = ["Mechanism", "SandboxResult", "mechanism", "run_python"]

# Linux constants (sched.h / mount.h / prctl.h).
_CLONE_NEWNS = 0x00020000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_MNT_DETACH = 2
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_CHILD_SUBREAPER = 36
# glibc has no pivot_root() wrapper: the syscall number per architecture.
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(platform.machine())

# Lines the child writes to its stderr, before exec, to tell the parent what did not work.
_NOTE = b"\x00rzero-sandbox-note: "
_NO_NAMESPACES = "no namespaces"
_SETUP_FAILED = "setup failed"

# What the private root shows besides the Python installation (absent paths are skipped).
_RUNTIME = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")
_DEVICES = ("null", "zero", "full", "random", "urandom")

_libc = ctypes.CDLL(None, use_errno=True)


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


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _note(msg: str) -> None:
    try:
        os.write(2, _NOTE + msg.encode("utf-8", "replace") + b"\n")
    except OSError:
        pass


# --- memory cgroup (parent side) ---------------------------------------------------------


def _own_cgroup(fstype: str, controller: str | None) -> str | None:
    """Directory of this process's cgroup in the hierarchy mounted as *fstype* (v1: the one
    holding *controller*), or None if that hierarchy is not mounted here."""
    with open("/proc/self/cgroup") as f:
        own = [line.rstrip("\n").split(":", 2) for line in f]
    path = next((p for hid, ctl, p in own if (hid == "0" if controller is None else controller in ctl.split(","))), None)
    if path is None:
        return None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            kind, options = fields[fields.index("-") + 1], fields[fields.index("-") + 3]
            if kind == fstype and (controller is None or controller in options.split(",")):
                rel = os.path.relpath(path, fields[3])  # fields[3]: the part of the hierarchy mounted
                if not rel.startswith(".."):
                    return os.path.normpath(os.path.join(fields[4], rel))
    return None


def _memory_delegated(path: str) -> bool:
    """Whether cgroup v2 children of *path* get the memory controller. Enabling it is refused
    while *path* itself holds processes (v2's "no internal processes" rule)."""
    with open(os.path.join(path, "cgroup.subtree_control")) as f:
        if "memory" in f.read().split():
            return True
    try:
        with open(os.path.join(path, "cgroup.subtree_control"), "w") as f:
            f.write("+memory")
        return True
    except OSError:
        return False


@functools.cache
def _cgroup_parent() -> tuple[str, int] | None:
    """(directory, version) under which runs get their memory cgroups: the caller's own cgroup,
    v2 preferred; None if neither hierarchy lets us make a capped child there."""
    try:
        v2 = _own_cgroup("cgroup2", None)
        if v2 is not None and _memory_delegated(v2):
            return v2, 2
        v1 = _own_cgroup("cgroup", "memory")
        if v1 is not None and os.access(v1, os.W_OK):
            return v1, 1
    except (OSError, ValueError, IndexError):
        pass
    return None


class _Cgroup:
    """A fresh memory cgroup for one run, capped at *limit* bytes of RAM (+ swap)."""

    def __init__(self, parent: str, version: int, limit: int):
        self.version = version
        self.path = os.path.join(parent, f"rzero-sandbox-{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(self.path)
        try:
            if version == 2:
                self._write("memory.max", limit)
                self._write("memory.swap.max", 0, optional=True)
            else:
                self._write("memory.limit_in_bytes", limit)
                self._write("memory.memsw.limit_in_bytes", limit, optional=True)  # RAM + swap; after RAM
            # Opened here; the sandboxed child writes ``0`` (itself) once the host filesystem is out
            # of its view. Moving a whole process (cgroup.procs) waits for an RCU grace period
            # (~10 ms); v1's per-thread ``tasks`` file moving its writer does not, and the child
            # is single-threaded then. v2 has no such file for a memory (domain) cgroup.
            self.join_fd = os.open(os.path.join(self.path, "cgroup.procs" if version == 2 else "tasks"),
                                   os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            os.rmdir(self.path)
            raise

    def _write(self, name: str, value: int, optional: bool = False) -> None:
        path = os.path.join(self.path, name)
        if optional and not os.path.exists(path):
            return  # the swap files exist only where the kernel accounts swap
        with open(path, "w") as f:
            f.write(str(value))

    def oom_kills(self) -> int:
        with open(os.path.join(self.path, "memory.events" if self.version == 2 else "memory.oom_control")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def remove(self) -> None:
        os.close(self.join_fd)
        try:
            os.rmdir(self.path)
        except OSError:
            pass  # only if a process of the run survived every kill: the cgroup, and its cap, stay


# --- the child, between fork and exec ----------------------------------------------------


@functools.cache
def _runtime_paths() -> tuple[str, ...]:
    """Host paths the private root shows: ``_RUNTIME`` and the Python installation (unless it
    lies below one of those). Computed in the parent, once."""
    paths = list(_RUNTIME)
    for p in sorted({os.path.realpath(sys.base_prefix), os.path.dirname(os.path.realpath(sys.executable))}):
        if not any((p + "/").startswith(q + "/") for q in paths if os.path.isdir(q) and not os.path.islink(q)):
            paths.append(p)
    return tuple(paths)


def _bind_ro(src: str, target: str, devices: bool = False) -> None:
    if os.path.isdir(src):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    _mount(src, target, None, _MS_BIND)
    # A bind mount takes its own flags only on a second, remount call.
    _mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | (0 if devices else _MS_NODEV))


def _private_root(tmpdir: str, workdir: str, script: str, runtime: tuple[str, ...], disk_bytes: int, uid: int) -> None:
    """In fresh mount and PID namespaces: build a root with only the runtime, and enter it."""
    if _SYS_PIVOT_ROOT is None:
        raise OSError(f"pivot_root: unknown syscall number on {platform.machine()}")
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing mounted below propagates to the host
    new = os.path.join(tmpdir, "root")
    _mount("tmpfs", new, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
    for path in runtime:
        if os.path.islink(path):
            os.makedirs(os.path.dirname(new + path), exist_ok=True)
            os.symlink(os.readlink(path), new + path)
        elif os.path.exists(path):
            _bind_ro(path, new + path)
    for name in _DEVICES:
        _bind_ro(f"/dev/{name}", f"{new}/dev/{name}", devices=True)
    _bind_ro(script, new + script)
    os.makedirs(new + workdir)
    _mount("tmpfs", new + workdir, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={disk_bytes},mode=0700,uid={uid},gid={uid}")
    os.mkdir(new + "/proc")
    # Mounted from inside the new PID namespace, so it lists only the sandbox's processes;
    # hidepid=2 also hides its root-owned init, a fork of the caller with the caller's cmdline.
    _mount("proc", new + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "hidepid=2")
    _mount(None, new, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.chdir(new)
    # pivot_root(".", ".") stacks the old root on top of the new one; detaching it leaves no
    # path back to the host's files.
    _check(_libc.syscall(ctypes.c_long(_SYS_PIVOT_ROOT), b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", _MNT_DETACH), "umount old root")
    os.chdir("/")


def _become(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _close_fds(keep: int = -1) -> None:
    """Drop every inherited fd but *keep*: the pipes (so readers see EOF when the code's side
    closes) and Popen's close-on-exec error pipe (held open, it would block Popen until we exit)."""
    top = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    os.closerange(0, max(keep, 0))
    os.closerange(keep + 1, top)


def _wait_main(main: int) -> int:
    """Reap children (orphans are reparented here) until *main* exits; return its wait status."""
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == main:
            return status


def _exit_like(status: int) -> None:
    """Exit with *status*, a wait status, so that ``Popen.returncode`` is the code's own."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.kill(os.getpid(), sig)
        time.sleep(1)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 255)


def _enter_namespaces(tmpdir: str, workdir: str, script: str, runtime: tuple[str, ...], disk_bytes: int, uid: int) -> None:
    """Fork the new PID namespace's init; return only in its child, the code's main process.

    The init (PID 1, root) builds the private root, then reaps until the main process exits and
    exits itself, which makes the kernel kill every other process in the namespace. This process
    stays outside and exits with the main process's status, which the init passes over a pipe:
    a namespace's init cannot die of a signal sent from inside, so it cannot re-raise one.
    """
    r, w = os.pipe()
    init = os.fork()
    if init:
        try:
            _close_fds(keep=r)
            os.waitpid(init, 0)
            data = os.read(r, 4)
            _exit_like(int.from_bytes(data, "little") if len(data) == 4 else 255 << 8)
        finally:
            os._exit(255)
    os.close(r)
    try:
        _private_root(tmpdir, workdir, script, runtime, disk_bytes, uid)
    except OSError as e:
        _note(f"{_SETUP_FAILED}: {e}")
        os._exit(255)
    main = os.fork()
    if main == 0:
        os.close(w)
        return
    try:
        _close_fds(keep=w)
        os.write(w, _wait_main(main).to_bytes(4, "little"))
    finally:
        os._exit(0)


def _supervise_uid(uid: int) -> None:
    """Without namespaces: fork; return only in the child, the code's main process.

    This root process stays as the supervisor. Orphans of the code are reparented to it
    (``PR_SET_CHILD_SUBREAPER``), not to PID 1, which in containers often never reaps them.
    When the main process exits, the supervisor kills every other process of *uid*, reaps
    them, and exits with the main process's status.
    """
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    main = os.fork()
    if main == 0:
        return
    try:
        _close_fds()
        status = _wait_main(main)
        if os.fork() == 0:
            try:  # kill(-1) from the uid reaches exactly the uid's other processes
                _become(uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
        _exit_like(status)
    finally:
        os._exit(255)


def _make_preexec(*, tmpdir, workdir, script, runtime, uid, cgroup_join, limits, disk_bytes):
    def preexec() -> None:  # runs in the child between fork and exec
        if uid is not None:
            try:
                _check(_libc.unshare(_CLONE_NEWPID | _CLONE_NEWNS | _CLONE_NEWNET), "unshare")
            except OSError as e:
                _note(f"{_NO_NAMESPACES} ({e}): host files (by permission), /proc and network are visible")
                _supervise_uid(uid)
            else:
                _enter_namespaces(tmpdir, workdir, script, runtime, disk_bytes, uid)
        # Only the code's own processes go into the cgroup: the supervisors are forks of the
        # caller, whose large resident memory would make them the OOM killer's first pick.
        if cgroup_join is not None:
            os.write(cgroup_join, b"0")
            os.close(cgroup_join)
        if uid is not None:
            _become(uid)
        _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        # Limits last: the forked child still has the parent's (maybe huge) address space.
        for which, soft, hard in limits:
            resource.setrlimit(which, (soft, hard))
        os.chdir(workdir)  # after the mounts: the old cwd is on the detached host root

    return preexec


def _kill_uid(uid: int) -> None:
    """SIGKILL every process owned by *uid* (``kill(-1)`` from that uid spares only itself)."""

    def become_and_kill() -> None:
        _become(uid)
        try:
            os.kill(-1, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    for _ in range(3):
        try:
            subprocess.run(["/bin/true"], preexec_fn=become_and_kill, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=5, check=False)
        except (OSError, subprocess.SubprocessError):
            pass
        if not _pids_of_uid(uid):
            return


def _pids_of_uid(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    pids.append(int(name))
            except OSError:
                pass
    return pids


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
    parent = _cgroup_parent()
    if parent is not None:
        try:
            cgroup = _Cgroup(*parent, total_memory_bytes)
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
