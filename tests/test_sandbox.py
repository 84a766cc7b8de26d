"""The sandbox ends hostile code with an error string, within its limits, leaving nothing behind.

Timing asserts are generous upper bounds ("ends within its limits"), not benchmarks.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
import tempfile
import threading
import time

import pytest

from rzero.envs.sandbox import cgroup, child, run_python
from rzero.envs.sandbox.child import _pids_of_uid

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux-only sandbox")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="uid drop and namespaces need root")

WALL = 5


def _hostile(code: str, **kw):
    kw.setdefault("wall_seconds", WALL)
    res = run_python(code, **kw)
    assert not res.ok
    assert isinstance(res.error, str) and res.error
    assert res.wall_time < kw["wall_seconds"] + 2
    if res.uid is not None:
        assert _pids_of_uid(res.uid) == [], "sandbox processes outlived the call"
    return res


def test_normal_code_returns_stdout():
    res = run_python("import math\nprint(math.factorial(5))\nprint('ok')")
    assert res.ok and res.error is None and res.exit_code == 0
    assert res.stdout == "120\nok\n"
    assert res.stderr == ""


def test_exception_is_reported():
    res = run_python("raise ValueError('boom')")
    assert not res.ok and "ValueError: boom" in res.error


def test_own_directory_is_writable():
    res = run_python("open('f.txt', 'w').write('hi')\nprint(open('f.txt').read())")
    assert res.ok, res
    assert res.stdout == "hi\n"


def test_infinite_loop_hits_cpu_limit():
    res = _hostile("while True:\n    pass", cpu_seconds=1)
    assert "cpu time limit" in res.error


def test_sleeping_loop_hits_wall_limit():
    res = _hostile("import time\nwhile True:\n    time.sleep(0.1)", wall_seconds=1.5)
    assert res.error == "timeout: wall time 1.5s exceeded"


@needs_root
def test_fork_bomb_hits_process_limit():
    res = _hostile("import os\nwhile True:\n    os.fork()", max_processes=8)
    assert "process limit" in res.error or "timeout" in res.error
    assert res.uid is not None and _pids_of_uid(res.uid) == []


def test_huge_allocation_hits_memory_limit():
    res = _hostile("x = bytearray(20 * 1024**3)")
    assert res.error == "memory limit exceeded"


@needs_root
def test_reading_protected_files_is_denied():
    res = _hostile("print(open('/etc/shadow').read())")
    # Namespaces: not in the sandbox's root at all; uid only: unreadable by permission.
    assert res.error.startswith("permission denied") or "No such file" in res.error, res.error
    assert res.stdout == ""


@needs_root
def test_private_directories_are_hidden():
    # /root holds this machine's Python; only the interpreter's own tree is in the sandbox's root.
    res = run_python("import os\nprint(sorted(os.listdir('/root')))")
    assert res.ok, res
    assert res.stdout.strip() in ("[]", "['.pyenv']")


@needs_root
@pytest.mark.parametrize(
    "code",
    [
        "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
        # bind() itself succeeds in the private namespace, but nothing can be reached:
        "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ns.sendto(b'x', ('8.8.8.8', 53))",
        "import socket\nsocket.create_connection(('8.8.8.8', 53), timeout=1)",
    ],
)
def test_network_is_unavailable(code):
    res = _hostile(code)
    assert res.error.startswith("network"), res.error
    assert not any("network not isolated" in w for w in res.warnings)


def test_huge_output_is_truncated():
    res = _hostile("print('x' * 10**8)", max_output_bytes=1000)
    assert res.error == "output truncated at 1000 bytes"
    assert len(res.stdout.encode()) + len(res.stderr.encode()) <= 1000


@needs_root
def test_write_outside_is_denied(tmp_path):
    target = "/tmp/owned_by_sandbox"
    assert not os.path.exists(target)
    res = _hostile(f"open({target!r}, 'w').write('pwned')")
    assert res.error.startswith("permission denied")
    assert not os.path.exists(target)
    res = _hostile(f"open({str(tmp_path / 'x')!r}, 'w')")
    assert not os.path.exists(tmp_path / "x")


def test_huge_file_in_own_directory_is_stopped():
    res = _hostile("f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 2**20)", max_file_bytes=4 << 20)
    assert "file size limit" in res.error or "No space left" in res.error


def test_temporary_directory_is_removed():
    res = run_python("import os\nprint(os.path.dirname(os.getcwd()))")
    assert res.ok
    assert not os.path.exists(res.stdout.strip())


class _RssByUid:
    """Samples, from outside the sandbox, the summed resident memory of each sandbox uid."""

    def __init__(self):
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            total: dict[int, int] = {}
            for pid in os.listdir("/proc"):
                try:
                    with open(f"/proc/{pid}/status") as f:
                        fields = dict(line.split(":", 1) for line in f if ":" in line)
                    uid = int(fields["Uid"].split()[0])
                    if uid >= 1_000_000:
                        total[uid] = total.get(uid, 0) + int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
                except (OSError, ValueError, KeyError):
                    pass
            for uid, rss in total.items():
                self.peak[uid] = max(self.peak.get(uid, 0), rss)
            time.sleep(0.02)


def _usable_by_any_uid(path: str) -> bool:
    parts = os.path.realpath(path).split("/")
    dirs = ["/".join(parts[:i]) or "/" for i in range(1, len(parts))]
    return all(os.stat(d).st_mode & stat.S_IXOTH for d in dirs) and bool(os.stat(path).st_mode & stat.S_IXOTH)


@pytest.fixture
def no_namespaces(monkeypatch):
    """As on a machine where unshare() is refused (EPERM: no CAP_SYS_ADMIN)."""

    class Refusing:
        def __getattr__(self, name):
            return getattr(libc, name)

        def unshare(self, flags):
            ctypes.set_errno(errno.EPERM)
            return -1

    libc = child._libc
    monkeypatch.setattr(child, "_libc", Refusing())
    # Without a mount namespace the fresh uid must reach the interpreter by file permissions;
    # this machine's may live under a private /root.
    python = next((p for p in (sys.executable, "/usr/bin/python3") if os.path.exists(p) and _usable_by_any_uid(p)), None)
    if python is None:
        pytest.skip("no Python interpreter that another uid may execute")
    monkeypatch.setattr(sys, "executable", python)


@pytest.fixture
def no_cgroup(monkeypatch):
    monkeypatch.setattr(cgroup, "_cgroup_parent", lambda: None)


@needs_root
@pytest.mark.parametrize("memory", ["cgroup", "nproc"])
def test_memory_is_capped_for_the_sandbox_as_a_whole(memory, request):
    if memory == "nproc":
        request.getfixturevalue("no_cgroup")
    # 15 children x 200 MB each fit the per-process limit (256 MB); together they must stay
    # near the 512 MB total instead of reaching 3 GB. Summed RSS counts the pages that forked
    # children share once per process, hence the margin.
    code = (
        "import os, time\n"
        "kids = 0\n"
        "for _ in range(15):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        try:\n"
        "            x = bytearray(b'x') * (200 << 20)\n"
        "            time.sleep(1.5)\n"
        "        finally:\n"
        "            os._exit(0)\n"
        "    kids += 1\n"
        "time.sleep(0.5)\n"
        "for _ in range(kids):\n"
        "    os.wait()\n"
        "print(kids)\n"
    )
    with _RssByUid() as rss:
        res = run_python(code, max_processes=32, wall_seconds=20)
    assert res.uid is not None and _pids_of_uid(res.uid) == []
    assert 0 < rss.peak.get(res.uid, 0) < 1 << 30, (rss.peak.get(res.uid), res)
    if memory == "nproc":
        assert res.mechanism.memory == "nproc"
        assert res.stdout == "1\n", res  # 512 MB // 256 MB = 2 processes: the main one and one child
    elif cgroup._cgroup_parent() is not None:
        assert res.mechanism.memory.startswith("cgroup"), res
        assert res.stdout == "15\n", res


@needs_root
@pytest.mark.parametrize("memory", ["cgroup", "nproc"])
def test_one_process_within_its_own_limit_hits_the_total(memory, request):
    if memory == "nproc":
        request.getfixturevalue("no_cgroup")
    res = _hostile("x = bytearray(b'x') * (700 << 20)", memory_bytes=1 << 30)
    assert res.error == "memory limit exceeded", res


@needs_root
def test_code_does_not_run_when_the_private_root_cannot_be_built(monkeypatch):
    monkeypatch.setattr(child, "_SYS_PIVOT_ROOT", None)
    res = _hostile("print('ran')")
    assert res.error.startswith("sandbox failed to start: setup failed: pivot_root"), res.error
    assert res.stdout == ""


@needs_root
def test_other_runs_files_in_tmp_are_not_readable():
    # World-readable, directly in /tmp: only the filesystem view can keep it out of reach.
    fd, secret = tempfile.mkstemp(prefix="rzero-test-secret-", dir="/tmp")
    try:
        os.write(fd, b"top secret")
        os.fchmod(fd, 0o644)
        res = run_python(f"print(open({secret!r}).read())")
        assert not res.ok and "top secret" not in res.stdout, res
        res = run_python("import os\nprint(sorted(os.listdir('/tmp')))")
        assert res.ok, res
        assert os.path.basename(secret) not in res.stdout and "rzero-sandbox-" in res.stdout, res.stdout
    finally:
        os.close(fd)
        os.unlink(secret)


@needs_root
def test_proc_shows_only_the_sandbox():
    code = (
        "import os, time\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    time.sleep(60)\n"
        "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
        "print(pids == sorted([os.getpid(), child]), pids)\n"
        "print(all(b'main.py' in open(f'/proc/{p}/cmdline', 'rb').read() for p in pids))\n"
    )
    res = run_python(code)
    assert res.ok, res
    assert res.stdout.splitlines()[0].startswith("True"), res.stdout
    assert res.stdout.splitlines()[1] == "True", res.stdout


@needs_root
@pytest.mark.parametrize("isolation", ["namespaces", "uid"])
@pytest.mark.parametrize("detach", ["", "    os.setsid()\n"])
def test_exit_with_background_child_reports_at_once(detach, isolation, request):
    if isolation == "uid":
        request.getfixturevalue("no_namespaces")
    code = f"import os, time\nif os.fork() == 0:\n{detach}    time.sleep(60)\nelse:\n    print('done')\n"
    res = run_python(code, wall_seconds=WALL)
    assert res.ok, res
    assert res.stdout == "done\n"
    assert res.wall_time < 2, res.wall_time
    assert _pids_of_uid(res.uid) == []
    assert res.mechanism.isolation == isolation
