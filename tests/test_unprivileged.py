"""The runtime as a plain user on the host, outside any container (issue 13).

``setpriv --reuid 65532 --regid 65532 --clear-groups --inh-caps=-all --no-new-privs`` (no
capabilities, no supplementary groups, no HOME, no passwd entry) runs ``vmsidecar-runtime serve``
from a virtualenv that UID can reach. It must boot the tiny guest to Ready, with QEMU running as
the same UID under its seccomp sandbox; a SIGKILLed runtime takes its QEMU along; a directory the
UID cannot write is refused at start with the directory and the fix.
"""

from __future__ import annotations

import ast
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.source import parse_python
from fixtures.waiting import wait_until_async
from vmsidecar_contract.process import RuntimeProcess, child_pids
from vmsidecar_contract.state import Phase

ROOT = Path(__file__).parents[1]
UID = GID = 65532

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="switching to UID 65532 needs root (CAP_SETUID)"),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv is not installed (apt-get install util-linux)"),
]


def _as_user(*argv: str) -> list[str]:
    return ["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", "--inh-caps=-all", "--no-new-privs",
            *argv]


#: what the runtime gets: no HOME, no XDG dirs, nothing of root's environment
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


def _python_for_user() -> str:
    """A Python 3.11+ interpreter UID 65532 can run (a pyenv or uv Python under /root is not one)."""
    candidates = [os.path.realpath(sys._base_executable), shutil.which("python3.11"), shutil.which("python3")]
    for python in filter(None, candidates):
        probe = subprocess.run(_as_user(python, "-c", "import sys; assert sys.version_info >= (3, 11)"), env=ENV,
                               capture_output=True)
        if probe.returncode == 0:
            return python
    pytest.fail(f"no Python >= 3.11 that UID {UID} can run among {candidates}; apt-get install python3")


@pytest.fixture(scope="module")
def user_dir() -> Iterator[Path]:
    """A directory UID 65532 can reach (pytest's tmp_path is under root's 0700 dir), with a
    virtualenv of the runtime: the locked dependencies, the runtime from this working tree."""
    top = Path(tempfile.mkdtemp(prefix="vmsidecar-unpriv-", dir="/tmp"))
    top.chmod(0o755)
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        pytest.fail("uv is not on PATH (run the tests with `uv run pytest`)")
    started = time.monotonic()
    subprocess.run([uv, "venv", "--quiet", "--python", _python_for_user(), str(top / "venv")], check=True,
                   cwd=ROOT, capture_output=True)
    synced = subprocess.run([uv, "sync", "--quiet", "--frozen", "--no-dev", "--package", "vmsidecar-runtime"],
                            cwd=ROOT, env={**os.environ, "UV_PROJECT_ENVIRONMENT": str(top / "venv")},
                            capture_output=True, text=True)
    assert synced.returncode == 0, synced.stderr[-3000:]
    print(f"\nvirtualenv for UID {UID}: {time.monotonic() - started:.1f} s")
    yield top
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def layout(user_dir: Path, tiny_image: Any) -> Iterator[dict[str, Path]]:
    """The tiny disk where the UID may read it, and a runtime directory the UID owns."""
    work = Path(tempfile.mkdtemp(prefix="run-", dir=user_dir))
    work.chmod(0o755)
    disk = work / "disk.qcow2"
    shutil.copyfile(tiny_image.disk, disk)
    disk.chmod(0o444)  # root-owned and read-only: the UID reads it, never writes it
    rt = work / "rt"
    rt.mkdir()
    os.chown(rt, UID, GID)
    yield {"work": work, "disk": disk, "rt": rt, "runtime": user_dir / "venv" / "bin" / "vmsidecar-runtime"}
    shutil.rmtree(work, ignore_errors=True)


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def _qemu_children(pid: int) -> list[int]:
    """QEMUs started by ``pid`` (by any of its threads: each child's forking thread waits for it)."""
    found = []
    for child in child_pids(pid):
        with_args = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        if os.path.basename(with_args[0]).startswith(b"qemu-system"):
            found.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


async def test_runtime_as_uid_65532_boots_to_ready(layout: dict[str, Path]) -> None:
    rt = layout["rt"]
    started = time.monotonic()
    launched = RuntimeProcess.start(rt, cache=rt / "cache", env=ENV, command=_as_user(str(layout["runtime"])),
                                    cwd=layout["work"], args=["--image", f"file:{layout['disk']}", "--memory", "256M",
                                                              "--grace", "20"])
    proc, socket = launched.proc, launched.socket
    try:
        state = await launched.wait_ready(210)
        assert state.phase is Phase.READY
        print(f"\nas UID {UID}: serve -> Ready {time.monotonic() - started:.1f} s ({state.accel}: {state.accel_reason})")

        runtime = _status(proc.pid)  # setpriv exec'd into the runtime: same pid
        assert runtime["Uid"].split() == [str(UID)] * 4 and runtime["Gid"].split() == [str(GID)] * 4
        assert runtime["CapEff"] == runtime["CapPrm"] == "0000000000000000" and runtime["Groups"] == ""
        [qemu] = _qemu_children(proc.pid)
        status = _status(qemu)
        assert status["Uid"].split() == [str(UID)] * 4 and status["Gid"].split() == [str(GID)] * 4
        assert status["CapEff"] == "0000000000000000"
        assert status["Seccomp"] == "2", status  # -sandbox on: a seccomp filter (mode 2) on every QEMU thread
        assert status["NoNewPrivs"] == "1"
        owned = {p.stat().st_uid for p in (rt / "state").rglob("*")} | {p.stat().st_uid for p in socket.parent.iterdir()}
        assert owned == {UID}, owned

        proc.send_signal(signal.SIGKILL)  # no cleanup code runs: PDEATHSIG works for a plain user too
        proc.wait(10)
        await wait_until_async(lambda: not _alive(qemu), 10, "QEMU to end with its SIGKILLed unprivileged runtime")
    finally:
        launched.stop(signal.SIGKILL)
        # what a SIGKILL leaves: its QEMU's socket directory, which only a runtime of the same UID
        # would remove at its start (serve.private_run_dir)
        for left in Path(tempfile.gettempdir()).glob(f"vmsidecar-{proc.pid}-*"):
            shutil.rmtree(left, ignore_errors=True)


@pytest.mark.parametrize("flag", ["--cache-dir", "--state-dir", "--shared-dir"])
def test_a_directory_the_user_cannot_write_is_named_with_the_fix(layout: dict[str, Path], flag: str) -> None:
    root_owned = layout["work"] / "root-owned"
    root_owned.mkdir(mode=0o755)
    dirs = {"--shared-dir": layout["rt"] / "shared", "--cache-dir": layout["rt"] / "cache",
            "--state-dir": layout["rt"] / "state"}
    dirs[flag] = root_owned
    argv = _as_user(str(layout["runtime"]), "serve", *[a for kv in dirs.items() for a in kv],
                    "--image", f"file:{layout['disk']}")
    result = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    message = result.stderr.strip()
    assert message.startswith("error: ") and "Traceback" not in message, message
    assert f"{root_owned} is not writable for uid {UID}" in message and f"chown {UID}:{GID} {root_owned}" in message
    assert flag in message


def test_no_home_and_no_directories_says_what_to_pass(layout: dict[str, Path]) -> None:
    # /var/lib/vmsidecar is root's (or absent and /var/lib not writable): the UID falls back to a home
    argv = _as_user(str(layout["runtime"]), "serve", "--shared-dir", str(layout["rt"] / "shared"))
    result = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "no home directory" in result.stderr and "--cache-dir and --state-dir" in result.stderr, result.stderr


def test_the_umask_is_set_once_at_start() -> None:
    """The umask is per process: changed around a bind, it also applied to a worker thread's mkdir at
    that instant (the image cache came out 0660, untraversable for a UID without root's override)."""
    calls = []
    for path in (ROOT / "runtime" / "src").rglob("*.py"):
        for node in ast.walk(parse_python(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "umask":
                calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert calls and all(c.startswith("runtime/src/vmsidecar_runtime/perms.py:") for c in calls), calls
