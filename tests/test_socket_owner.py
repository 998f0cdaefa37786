"""Upstream's pool-pod shape: the runtime runs as root, the exporter as UID 65532, no fsGroup.

With ``VMSIDECAR_SOCKET_OWNER=65532:65532`` every socket of the shared directory — the API, the
consoles, the CAN buses, the channels and ``gpio.sock`` — must belong to the exporter's user, mode
0660, and work for a client process that really runs as that user.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv (util-linux) to act as the exporter's UID")

EXPORTER = 65532
SPEC = {  # no image: nothing boots, but every socket of the spec is listening
    "channels": [{"name": "agent"}],
    "can": [{"name": "can0"}],
    "gpio": [{"name": "reset-button", "direction": "in"}, {"name": "led", "direction": "out"}],
}

#: what the exporter's GPIO child does: one connection, one JSON request, one reply line
GPIO_CLIENT = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
f = s.makefile("rwb")
for req in sys.argv[2:]:
    f.write(req.encode() + b"\\n"); f.flush()
    print(f.readline().decode().strip())
"""

CONNECT = "import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])"


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A scratch directory another UID can traverse (pytest's own base directory is 0700)."""
    root = Path(tempfile.mkdtemp(prefix="vmsidecar-owner-", dir="/tmp"))
    root.chmod(0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _as_user(uid: int, gid: int, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run the system Python as ``uid:gid`` with no supplementary groups (an exporter container)."""
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "python3"
    return subprocess.run(["setpriv", "--reuid", str(uid), "--regid", str(gid), "--clear-groups", python, *argv],
                          capture_output=True, text=True, timeout=30)


async def test_every_shared_socket_is_handed_to_the_exporter(start_runtime: Any) -> None:
    rt = await start_runtime(SPEC, env={"VMSIDECAR_SOCKET_OWNER": f"{EXPORTER}:{EXPORTER}"})
    sockets = sorted(p for p in rt.shared.rglob("*") if stat.S_ISSOCK(p.lstat().st_mode))
    names = {str(p.relative_to(rt.shared)) for p in sockets}
    assert {"api.sock", "console.sock", "hvc0.sock", "gpio.sock", "can/can0.sock", "channels/agent.sock"} <= names
    for path in sockets:
        st = path.lstat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (EXPORTER, EXPORTER, 0o660), (
            f"{path.relative_to(rt.shared)}: uid {st.st_uid} gid {st.st_gid} mode {stat.S_IMODE(st.st_mode):o}")

    # The exporter's GPIO child as UID 65532: drive a line and read it back. Its primary group is
    # not always 65532 (runAsUser without runAsGroup or fsGroup may leave it at 0), so the UID alone
    # must be enough; the setgid directory's group alone would hide a socket still owned by root.
    for gid in (EXPORTER, 0):
        done = _as_user(EXPORTER, gid, "-c", GPIO_CLIENT, str(rt.shared / "gpio.sock"),
                        json.dumps({"op": "set", "line": "reset-button", "value": 1}),
                        json.dumps({"op": "get", "line": "reset-button"}))
        assert done.returncode == 0, f"gid {gid}: {done.stderr}"
        replies = [json.loads(line) for line in done.stdout.splitlines()]
        assert replies == [{"ok": True, "value": 1}, {"ok": True, "value": 1}], done.stdout
    for path in sockets:  # and every other socket accepts the exporter's connection
        done = _as_user(EXPORTER, 0, "-c", CONNECT, str(path))
        assert done.returncode == 0, f"{path}: {done.stderr}"

    # anyone else is refused (not world-accessible)
    done = _as_user(EXPORTER + 1, EXPORTER + 1, "-c", CONNECT, str(rt.shared / "gpio.sock"))
    assert done.returncode != 0 and "PermissionError" in done.stderr, done.stderr

    # ... and the directory stays root's: the exporter's user connects, but adds, renames and
    # removes nothing there (a link it planted was followed by the root runtime)
    st = rt.shared.lstat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o755), f"uid {st.st_uid} mode {stat.S_IMODE(st.st_mode):o}"
    for sub in [rt.shared, *(p for p in rt.shared.rglob("*") if p.is_dir())]:
        done = _as_user(EXPORTER, 0, "-c", "import os, sys; os.symlink('/etc/shadow', sys.argv[1])", str(sub / "x"))
        assert done.returncode != 0 and "PermissionError" in done.stderr, f"{sub}: {done.stderr}"


async def test_a_lock_file_the_exporter_planted_as_a_link_is_refused_not_followed(
        start_runtime: Any, tmp_path: Path) -> None:
    """The exporter's user made the shared directory first (its emptyDir is everyone's) and left
    ``.runtime.lock`` as a link to a root-owned file: the root runtime opened it, truncated it and
    wrote its pid there (an auditor's run: 29 bytes became 4)."""
    shared = tmp_path / "rt" / "shared"
    shared.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("root's file, not the runtime's\n")
    (shared / ".runtime.lock").symlink_to(victim)
    os.chown(shared, EXPORTER, EXPORTER)
    env = {"VMSIDECAR_SOCKET_OWNER": f"{EXPORTER}:{EXPORTER}"}
    with pytest.raises(Exception, match=r"runtime\.lock is a symbolic link"):
        await start_runtime(SPEC, env=env, name="rt")
    assert victim.read_text() == "root's file, not the runtime's\n"

