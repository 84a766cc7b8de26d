"""The child's side of a run: what runs between fork and exec, and the supervisors around the code.

The preexec function enters fresh namespaces and builds the private root (or, where ``unshare``
is refused, keeps a root supervisor), joins the memory cgroup, drops to the run's uid and sets
the limits. Also here: killing and listing a uid's processes, which the parent uses to leave
nothing behind, the lines the child writes to tell the parent what did not work, and the libc
calls and Linux constants all this needs.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import resource
import signal
import subprocess
import sys
import time

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
