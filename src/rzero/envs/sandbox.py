"""Run untrusted Python in a subprocess fenced in by the operating system.

``run_python(code)`` writes *code* to a fresh temporary directory and runs it with
``python -I -S`` in a child process that, before ``exec``:

* gets resource limits: ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address space),
  ``RLIMIT_NPROC`` (process count), ``RLIMIT_FSIZE`` (largest file), ``RLIMIT_NOFILE``,
  ``RLIMIT_CORE = 0``;
* when the caller is root (or otherwise may): enters new network and mount namespaces.
  The network namespace has only a downed loopback device, so every connect/bind to
  anything fails. In the mount namespace every mount is remounted read-only, the
  directories in ``hidden_paths`` (by default ``/root``, ``/home``, ``/work``) are covered
  by empty tmpfs mounts (the Python installation is mounted back in if it lives under one),
  and the working directory is a private, size-capped tmpfs -- the only writable place;
  what is written there disappears with the process;
* when the caller is root: drops to a fresh, otherwise unused uid/gid (one per run, no
  supplementary groups, ``PR_SET_NO_NEW_PRIVS``) so that ``RLIMIT_NPROC`` is enforced
  (the kernel does not enforce it for root) and ordinary file permissions apply.

The parent reads stdout/stderr with a byte cap, enforces a wall-clock limit, and at the
end kills every process of the run's uid (``kill(-1, SIGKILL)`` from that uid), so a fork
bomb's orphans or a daemonised child cannot outlive the call.

Not isolated (documented, not pretended):

* Without root (or ``CAP_SYS_ADMIN``) there are no namespaces and no uid drop: the network
  is reachable, files are readable/writable with the caller's rights, and ``RLIMIT_NPROC``
  counts all of the caller's processes. Each such gap is listed in ``SandboxResult.warnings``.
* World-readable files outside ``hidden_paths`` (e.g. ``/etc/passwd``, the stdlib, ``/proc``
  entries such as other processes' command lines) stay readable.
* CPU time is per process: a program may use up to ``max_processes * cpu_seconds`` CPU
  seconds in total, but never more than ``wall_seconds`` of wall time.
* No seccomp filter: the kernel's syscall surface is the one any unprivileged user has.
"""

from __future__ import annotations

import ctypes
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

__all__ = ["SandboxResult", "run_python"]

# Linux constants (sched.h / mount.h / prctl.h).
_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_MOVE = 8192
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_CHILD_SUBREAPER = 36

# Lines the child writes to its stderr, before exec, to tell the parent what did not work.
_NOTE = b"\x00rzero-sandbox-note: "

_DEFAULT_HIDDEN = ("/root", "/home", "/work")

_libc = ctypes.CDLL(None, use_errno=True)


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


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _mountpoints() -> list[str]:
    out = []
    with open("/proc/self/mounts", "rb") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2:
                mp = parts[1].decode("utf-8", "surrogateescape")
                for esc, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
                    mp = mp.replace(esc, ch)
                out.append(mp)
    return out


def _note(msg: str) -> None:
    try:
        os.write(2, _NOTE + msg.encode("utf-8", "replace") + b"\n")
    except OSError:
        pass


def _setup_filesystem(tmpdir: str, workdir: str, hidden: list[str], keep: list[str], disk_bytes: int, uid: int) -> None:
    """In a fresh mount namespace: hide, make read-only, and give a private tmpfs workdir."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    # Park what must stay visible (the Python installation) before covering its parents.
    staged = []
    for i, path in enumerate(keep):
        stage = os.path.join(tmpdir, f".keep{i}")
        _mount(path, stage, None, _MS_BIND | _MS_REC)
        staged.append((stage, path))
    for path in hidden:
        _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=64k")
    for stage, path in staged:
        os.makedirs(path, exist_ok=True)
        _mount(stage, path, None, _MS_MOVE)
    for mp in reversed(_mountpoints()):
        try:
            st = os.statvfs(mp)
            keep_flags = st.f_flag & (_MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
            _mount(None, mp, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | keep_flags)
        except OSError:
            pass  # shadowed or special mounts; the checks below catch what matters
    if os.statvfs("/").f_flag & _MS_RDONLY == 0:
        raise OSError("root filesystem still writable")
    _mount("tmpfs", workdir, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={disk_bytes},mode=0700,uid={uid},gid={uid}")


def _make_preexec(*, tmpdir, workdir, uid, hidden, keep, cpu_seconds, memory_bytes, max_processes, max_file_bytes, disk_bytes):
    def preexec() -> None:  # runs in the child between fork and exec
        if uid is not None:
            _become_reaper()  # returns only in the grandchild that execs the code
        try:
            _check(_libc.unshare(_CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        except OSError as e:
            _note(f"network not isolated ({e})")
        fs_ok = False
        try:
            _check(_libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
            _setup_filesystem(tmpdir, workdir, hidden, keep, disk_bytes, uid if uid is not None else os.getuid())
            fs_ok = True
        except OSError as e:
            _note(f"filesystem not isolated ({e})")
        if not fs_ok and uid is not None:
            os.chown(workdir, uid, uid)
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        # Limits last: the forked child still has the parent's (maybe huge) address space.
        ncpu = max(1, int(-(-cpu_seconds // 1)))
        limits = [
            (resource.RLIMIT_CPU, ncpu, ncpu + 1),
            (resource.RLIMIT_AS, memory_bytes, memory_bytes),
            (resource.RLIMIT_FSIZE, max_file_bytes, max_file_bytes),
            (resource.RLIMIT_NOFILE, 64, 64),
            (resource.RLIMIT_CORE, 0, 0),
            (resource.RLIMIT_NPROC, max_processes, max_processes),
        ]
        for which, soft, hard in limits:
            resource.setrlimit(which, (soft, hard))
        os.chdir(workdir)  # after the mounts: the old cwd points below the new tmpfs

    return preexec


def _become_reaper() -> None:
    """Split into a root reaper (stays here) and the sandboxed child (returns, then execs).

    Orphans of the sandboxed code are reparented to the reaper (``PR_SET_CHILD_SUBREAPER``),
    not to PID 1 -- which in containers often never reaps them, leaving zombies. The reaper
    waits until every descendant is gone (the parent kills them all by uid), then exits with
    the sandboxed child's status, so ``Popen.returncode`` is the code's own.
    """
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    child = os.fork()
    if child == 0:
        return
    status = 0
    try:
        # Drop every inherited fd: the pipes (so readers see EOF when the code's side closes)
        # and Popen's close-on-exec error pipe (held open, it would block Popen until we exit).
        os.closerange(0, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        while True:
            try:
                pid, st = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            except InterruptedError:
                continue
            if pid == child:
                status = st
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            signal.signal(sig, signal.SIG_DFL) if sig not in (signal.SIGKILL, signal.SIGSTOP) else None
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.kill(os.getpid(), sig)
            time.sleep(1)
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 255)
    finally:
        os._exit(255)


def _kill_uid(uid: int) -> None:
    """SIGKILL every process owned by *uid* (``kill(-1)`` from that uid spares only itself)."""

    def become_and_kill() -> None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
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
    max_output_bytes: int = 64 << 10,
    max_processes: int = 16,
    max_file_bytes: int = 16 << 20,
    disk_bytes: int = 32 << 20,
    hidden_paths: tuple[str, ...] = _DEFAULT_HIDDEN,
) -> SandboxResult:
    """Run *code* under the limits above; never raises for anything the code does.

    ``error`` is ``None`` on a clean exit with status 0, else a short human-readable reason
    ("timeout: wall time 5s exceeded", "memory limit exceeded", "output truncated at N
    bytes", "cpu time limit exceeded (2s)", "process limit exceeded: ...", "permission
    denied: ...", "network unavailable: ...", "exit code 1: <last stderr line>").
    ``max_output_bytes`` caps stdout and stderr together.
    """
    start = time.monotonic()
    is_root = os.geteuid() == 0
    uid = 1_000_000 + secrets.randbelow(1_000_000_000) if is_root else None
    warnings: list[str] = []
    if not is_root:
        warnings.append("not root: no uid drop; RLIMIT_NPROC counts all of the caller's processes")

    prefixes = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, os.path.dirname(sys.executable))}
    tmpdir = tempfile.mkdtemp(prefix="rzero-sandbox-")
    hidden = []
    for h in hidden_paths:
        rh = os.path.realpath(h)
        if os.path.isdir(rh) and not (tmpdir + "/").startswith(rh.rstrip("/") + "/") and rh != "/":
            hidden.append(rh)
    keep = sorted({p for p in prefixes if any((p + "/").startswith(h + "/") for h in hidden)})
    proc = None
    try:
        os.chmod(tmpdir, 0o755)
        workdir = os.path.join(tmpdir, "work")
        os.mkdir(workdir, 0o700)
        for i in range(len(keep)):
            os.mkdir(os.path.join(tmpdir, f".keep{i}"))
        script = os.path.join(tmpdir, "main.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(code)
        os.chmod(script, 0o644)

        preexec = _make_preexec(tmpdir=tmpdir, workdir=workdir, uid=uid, hidden=hidden, keep=keep,
                                cpu_seconds=cpu_seconds, memory_bytes=memory_bytes, max_processes=max_processes,
                                max_file_bytes=max_file_bytes, disk_bytes=disk_bytes)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "HOME": workdir}
        killed = threading.Event()

        def kill_all() -> None:
            killed.set()
            if uid is None and proc is not None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            if uid is not None:
                _kill_uid(uid)

        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", script], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, preexec_fn=preexec,
                close_fds=True,
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
        # The main process is gone; make sure nothing it started survives, then drain pipes.
        # (With a uid drop, ``proc`` is the root reaper: it exits once all of uid's processes
        # are dead and reaped; killing its group instead would orphan them to PID 1.)
        if uid is not None:
            _kill_uid(uid)
        else:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for r in readers:
            r.join(timeout=5)
        wall = time.monotonic() - start

        stdout = bytes(readers[0].data).decode("utf-8", "replace")
        raw_err = bytes(readers[1].data)
        err_lines = []
        for line in raw_err.split(b"\n"):
            if line.startswith(_NOTE):
                warnings.append(line[len(_NOTE):].decode("utf-8", "replace"))
            else:
                err_lines.append(line)
        stderr = b"\n".join(err_lines).decode("utf-8", "replace")
        rc = proc.returncode

        if budget.overflowed:
            error = f"output truncated at {max_output_bytes} bytes"
        elif timed_out:
            error = f"timeout: wall time {wall_seconds}s exceeded"
        elif rc == 0:
            error = None
        else:
            error = _classify(rc, stderr, cpu_seconds)
        return SandboxResult(error is None, stdout, stderr, error, rc, wall, uid, tuple(warnings))
    finally:
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        shutil.rmtree(tmpdir, ignore_errors=True)
