"""A guest that escapes into the QEMU of a libvirt domain (``backend: libvirt`` on the runtime's own
libvirtd): what it holds and what it can open (docs/security.md rows 53 and 67, "the libvirt backend").

libvirt 9.0 started the private daemon's QEMU as root (qemu.conf ``user = "+0"``: docs/libvirt.md,
"the /dev/kvm trap") with every capability of the runtime's container (``CapEff 000001fffeffffff``:
CAP_SYS_ADMIN, CAP_DAC_OVERRIDE …) and outside any Landlock domain (the runtime's confinement is
entered by the thread that forks a QEMU of its own; libvirtd forks this one). So an escaped guest
could read the pool's registry auth file, write the cache's images, plant files, or connect to
libvirtd's socket and have it start a domain of the attacker's making (any emulator, any argv).
Carried out by the real QEMU libvirt starts for a boot plan, asked over its monitor
(``qemu-monitor-command``, the same ``open`` and ``connect`` an escaped guest's code makes in that
process). With ``VMSIDECAR_QEMU_CONFINEMENT=off`` every open succeeds, which shows the attack is real.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from fixtures.attack import Host, judge_escape
from fixtures.runtime import _libvirt_problem, qemu_pids
from vmsidecar_contract.spec import load_spec
from vmsidecar_runtime import confinement
from vmsidecar_runtime.backend import close_backends
from vmsidecar_runtime.backend.libvirt.backend import LibvirtBackend
from vmsidecar_runtime.plan import BootPlan

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(_libvirt_problem() is not None, reason=str(_libvirt_problem()))]


@pytest.fixture
async def launched(tiny_image: Any, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Callable[[bool], Any]]:
    """``await launch(confined)``: the libvirt domain of a tiny guest's boot plan, paused, and its files."""
    root = Path(tempfile.mkdtemp(prefix="vmsidecar-"))  # short: Unix socket paths are limited
    backends: list[LibvirtBackend] = []

    async def launch(confined: bool) -> tuple[LibvirtBackend, Host]:
        if not confined:
            monkeypatch.setenv(confinement.ENV, "off")
        host = Host(root, tiny_image.disk, "qcow2")
        spec = load_spec({"image": f"file:{tiny_image.disk}", "memory": "128M", "backend": "libvirt",
                          "network": {"enabled": False}})
        backend = LibvirtBackend(BootPlan(spec, "tcg", host.overlay, "qcow2", host.run, disk_chain=(host.base,)),
                                 lambda event, data: None)
        backends.append(backend)
        await backend.launch()
        return backend, host

    yield launch
    for backend in backends:
        if backend.alive:
            await backend.kill()
    await close_backends()  # the private libvirtd
    shutil.rmtree(root, ignore_errors=True)


def _reply(backend: LibvirtBackend, command: str, /, **arguments: Any) -> dict[str, Any]:
    """The domain's QEMU's reply to a QMP command, through libvirt (``virsh qemu-monitor-command``)."""
    import libvirt_qemu

    reply: dict[str, Any] = json.loads(libvirt_qemu.qemuMonitorCommand(
        backend._dom, json.dumps({"execute": command, "arguments": arguments}), 0))
    return reply


def _monitor(backend: LibvirtBackend, command: str, /, **arguments: Any) -> str:
    """What the domain's QEMU answers to a QMP command: ``"done"``, or its error."""
    reply = _reply(backend, command, **arguments)
    return "done" if "error" not in reply else str(reply["error"].get("desc"))


def _opens(backend: LibvirtBackend, node: str, path: Path, *, read_only: bool) -> str:
    return _monitor(backend, "blockdev-add", driver="file", filename=str(path), **{"node-name": node},
                    **{"read-only": read_only})


def _capabilities(pid: int) -> dict[str, int]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: int(v, 16) for k, v in (line.split(":") for line in lines) if k in ("CapEff", "CapPrm", "CapBnd")}


@pytest.mark.parametrize("confined", [False, True], ids=["unconfined", "confined"])
async def test_an_escaped_libvirt_qemu_holds_no_capability_and_opens_no_host_file_but_its_own(
        launched: Any, confined: bool) -> None:
    backend, host = await launched(confined)
    [pid] = qemu_pids(str(host.run))
    assert _capabilities(pid) == {"CapEff": 0, "CapPrm": 0, "CapBnd": 0}
    # libvirtd's socket, where a domain of the attacker's making would start: closed to QEMU
    assert backend._conn is not None and backend._conn.daemon is not None
    daemon_socket = backend._conn.daemon.socket
    assert daemon_socket.is_socket()
    answer = _monitor(backend, "chardev-add", id="libvirtd", backend={
        "type": "socket", "data": {"addr": {"type": "unix", "data": {"path": str(daemon_socket)}}, "server": False}})
    assert "Permission denied" in answer, answer
    attempts = {
        "read the pool's auth file": _opens(backend, "auth", host.auth, read_only=True),
        "rewrite the next restore's overlay": _opens(backend, "ahead", host.ahead, read_only=False),
        "write the cache's base image": _opens(backend, "base-rw", host.base, read_only=False),
        "plant a file in the state directory": _monitor(
            backend, "chardev-add", id="planted", backend={"type": "file", "data": {"out": str(host.state / "planted")}}),
    }
    judge_escape(attempts, host, confined=confined, success="done")
    if not confined:  # the attack, as it was
        return
    # what the boot needs still opens, and the guest runs on it
    assert _opens(backend, "base-ro", host.base, read_only=True) == "done"
    await backend.resume()
    assert _reply(backend, "query-status")["return"]["status"] == "running"


#: run as root with CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH out of its bounding set (a container
#: that drops them, ``capabilities: {drop: [ALL], add: [SYS_ADMIN]}``): start the private libvirtd,
#: then connect to its socket as QEMU runs (root, no capability)
_WITHOUT_DAC = """
import asyncio, subprocess, sys
from pathlib import Path
from vmsidecar_contract.errors import VmsidecarError
from vmsidecar_runtime.backend.libvirt.daemon import PrivateDaemon
from vmsidecar_runtime.confinement import NO_CAPABILITIES

CONNECT = "import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1]); print('connected')"

async def main(root):
    daemon = PrivateDaemon(root)
    try:
        await daemon.start()
    except VmsidecarError as e:
        print("refused:", e)
        return
    try:
        as_qemu = subprocess.run(["setpriv", *NO_CAPABILITIES, "--", sys.executable, "-c", CONNECT,
                                  str(daemon.socket)], capture_output=True, text=True)
        print("as QEMU:", as_qemu.stdout.strip() or as_qemu.stderr.strip().splitlines()[-1])
    finally:
        await daemon.stop()

asyncio.run(main(Path(sys.argv[1])))
"""


def test_a_root_runtime_without_dac_capabilities_refuses_a_private_libvirtd_its_qemu_could_reach() -> None:
    """Without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH the runtime cannot enter a socket directory
    it does not own; the one it owns is open to a QEMU that is root too: the private daemon is
    refused, naming the capability, rather than started where an escaped guest reaches it."""
    root = Path(tempfile.mkdtemp(prefix="vmsidecar-"))
    try:
        result = subprocess.run(["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--", sys.executable,
                                 "-c", _WITHOUT_DAC, str(root)], capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert result.returncode == 0, result.stderr[-3000:]
    said = result.stdout.strip()
    assert said.startswith("refused:"), said
    assert "CAP_DAC_OVERRIDE" in said and "libvirt_uri" in said and "backend: qemu" in said, said
