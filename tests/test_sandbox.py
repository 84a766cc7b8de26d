"""The sandbox ends hostile code with an error string, within its limits, leaving nothing behind.

Timing asserts are generous upper bounds ("ends within its limits"), not benchmarks.
"""

from __future__ import annotations

import os
import sys

import pytest

from rzero.envs.sandbox import _pids_of_uid, run_python

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
    assert res.error.startswith("permission denied")
    assert res.stdout == ""


@needs_root
def test_private_directories_are_hidden():
    # /root holds this machine's Python; only the interpreter's own tree is mounted back in.
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
