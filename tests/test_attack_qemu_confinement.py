"""A guest that escapes into QEMU is QEMU: what it can open on the host (docs/security.md row 67).

QEMU runs as the runtime's UID, so without more it could open every file that UID can: the pool's
registry auth file, the next restore's overlay made during the lease, any image of the cache (for
writing). The attack is carried out by the real QEMU the runtime starts (``QemuBackend.launch``),
asked over its own QMP to open host files (``blockdev-add`` of a ``file`` node, a ``file``
chardev): the same ``open`` an escaped guest's code would make in that process. With
``VMSIDECAR_QEMU_CONFINEMENT=off`` (QEMU outside its Landlock domain, as before) every one of them
succeeds, which shows the attack is real; in its domain each is refused by the kernel, while what
QEMU needs (its own disk, the backing image read-only) still opens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from qemu.qmp.error import QMPError

from fixtures.attack import SECRET, Host, judge_escape
from fixtures.runtime import qemu_pids
from vmsidecar_contract.errors import HostError
from vmsidecar_contract.spec import load_spec
from vmsidecar_runtime import confinement
from vmsidecar_runtime.backend.qemu import QemuBackend
from vmsidecar_runtime.image.checks import run_qemu_img
from vmsidecar_runtime.image.limits import Origin
from vmsidecar_runtime.plan import BootPlan


@pytest.fixture
async def launched(tiny_image: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[
        Callable[[bool], Any]]:
    """``await launch(confined)``: the real QEMU of a tiny guest's boot plan, paused, and its files."""
    backends: list[QemuBackend] = []

    async def launch(confined: bool) -> tuple[QemuBackend, Host]:
        if not confined:
            monkeypatch.setenv(confinement.ENV, "off")
        host = Host(tmp_path, tiny_image.disk, "qcow2")
        spec = load_spec({"image": f"file:{tiny_image.disk}", "memory": "128M", "network": {"enabled": False}})
        plan = BootPlan(spec, "tcg", host.overlay, "qcow2", host.run, disk_chain=(host.base,))
        backend = QemuBackend(plan, lambda event, data: None)
        backends.append(backend)
        await backend.launch()
        return backend, host

    yield launch
    for backend in backends:
        await backend.quit()


async def _opens(backend: QemuBackend, node: str, path: Path, *, read_only: bool) -> str:
    """What QEMU answers when asked to open ``path``: ``"opened"``, or its error."""
    try:
        await backend._execute("blockdev-add", driver="file", filename=str(path), **{"node-name": node},
                               **{"read-only": read_only})
    except QMPError as e:
        return str(e)
    return "opened"


async def _writes_new_file(backend: QemuBackend, path: Path) -> str:
    try:
        await backend._execute("chardev-add", id="planted", backend={"type": "file", "data": {"out": str(path)}})
    except QMPError as e:
        return str(e)
    return "opened"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("confined", [False, True], ids=["unconfined", "confined"])
async def test_an_escaped_qemu_opens_no_host_file_but_its_own(launched: Any, confined: bool) -> None:
    backend, host = await launched(confined)
    attempts = {
        "read the pool's auth file": await _opens(backend, "auth", host.auth, read_only=True),
        "rewrite the next restore's overlay": await _opens(backend, "ahead", host.ahead, read_only=False),
        "write the cache's base image": await _opens(backend, "base-rw", host.base, read_only=False),
        "plant a file in the state directory": await _writes_new_file(backend, host.state / "planted"),
    }
    judge_escape(attempts, host, confined=confined, success="opened")
    if not confined:  # the attack, as it was
        return
    # what the boot needs still opens: the base read-only (the overlay's backing), its own disk
    # (open already: QEMU answered QMP with it attached), and the guest runs on them
    assert await _opens(backend, "base-ro", host.base, read_only=True) == "opened"
    await backend._execute("cont")
    assert (await backend._execute("query-status"))["status"] == "running"


def test_a_kernel_without_landlock_runs_qemu_unconfined_and_says_so(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """(A kernel without Landlock, or a seccomp profile refusing its syscalls, cannot be made here:
    the ruleset's creation fails as landlockpy reports it there.)"""
    def refused(**_: Any) -> Any:
        raise confinement.LandlockError(38, "Function not implemented")

    monkeypatch.setattr(confinement, "Ruleset", refused)
    confinement._warn_unconfined.cache_clear()
    assert confinement.ruleset_for([]) is None
    assert "QEMU and qemu-img run without a Landlock domain (Function not implemented)" in caplog.text
    assert "landlock_* syscalls" in caplog.text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("confined", [False, True], ids=["unconfined", "confined"])
async def test_an_overlay_header_an_escaped_qemu_rewrote_opens_nothing_at_the_next_boot(
        launched: Any, confined: bool, tmp_path: Path) -> None:
    """The overlay is its QEMU's to write, header included: an escaped QEMU names the auth file as
    its backing file, and the lease's next boot (a power cycle) opens what the header names. The
    runtime's record of what the overlay stands on (``disk_chain``) is all the next QEMU may open."""
    backend, host = await launched(confined)
    await backend.quit()
    subprocess.run(["qemu-img", "rebase", "-u", "-f", "qcow2", "-b", str(host.auth), "-F", "raw", str(host.overlay)],
                   check=True)  # (what the escaped QEMU writes into its overlay's header)
    spec = backend.plan.spec
    again = QemuBackend(BootPlan(spec, "tcg", host.overlay, "qcow2", host.run, disk_chain=(host.base,)),
                        lambda event, data: None)
    try:
        if not confined:  # the guest's disk reads the auth file
            await again.launch()
            nodes = await again._execute("query-named-block-nodes", flat=True)
            assert str(host.auth) in {n["image"]["filename"] for n in nodes}, nodes
            return
        with pytest.raises(HostError, match="Permission denied"):
            await again.launch()
    finally:
        await again.quit()


@pytest.mark.parametrize("confined", [False, True], ids=["unconfined", "confined"])
def test_qemu_img_on_a_hostile_image_opens_only_that_image(tiny_image: Any, tmp_path: Path, confined: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A qemu-img a crafted image took over is qemu-img asked to open another file: here asked
    plainly (``info`` of the auth file) with the rights of a check of the image."""
    if not confined:
        monkeypatch.setenv(confinement.ENV, "off")
    host = Host(tmp_path, tiny_image.disk, "qcow2")
    rc, out, err = run_qemu_img("info", "-f", "raw", "--output=json", str(host.auth),
                                origin=Origin("the image", "fix it"), read=(host.base,))
    if not confined:
        assert rc == 0 and json.loads(out)["filename"] == str(host.auth), (rc, out, err)
        return
    assert rc != 0 and "Permission denied" in err, (rc, out, err)
    rc, out, err = run_qemu_img("info", "-f", "qcow2", "--output=json", str(host.base),
                                origin=Origin("the image", "fix it"), read=(host.base,))
    assert rc == 0, err


@pytest.mark.timeout(240)
async def test_a_dump_of_an_overlay_naming_another_backing_file_copies_no_host_file(
        start_runtime: Any, tiny_image: Any, tmp_path: Path) -> None:
    """The runtime's own dump (``GET /v1/vm/disk``) converts the lease's overlay: one whose header
    an escaped QEMU rewrote to name the auth file copied it into the dump for the lease holder."""
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    auth = secrets / "auth.json"
    auth.write_text(json.dumps({"auths": {"reg.example": {"auth": SECRET}}}))
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "128M", "snapshot": "off"})
    client = rt.client()
    await client.wait_ready(timeout=120)
    await client.power("off")
    overlay = rt.state / "overlay.qcow2"
    subprocess.run(["qemu-img", "rebase", "-u", "-f", "qcow2", "-b", str(auth), "-F", "raw", str(overlay)],
                   check=True)
    dest = tmp_path / "dump.raw"
    try:
        await client.dump(dest, fmt="raw")
    except HostError as e:
        assert "Permission denied" in e.message, e.message
    assert not dest.exists() or SECRET.encode() not in dest.read_bytes()


@pytest.mark.timeout(240)
async def test_a_spares_serial_socket_taken_during_the_lease_gives_nothing_of_the_next_leases_console(
        start_runtime: Any, tiny_image: Any) -> None:
    """A connect to a Unix socket by path is not confined (Landlock ABI 11's ``RESOLVE_UNIX``): an
    escaped QEMU of lease N (the runtime's UID) connects to the standby spare's serial socket, which
    QEMU serves to one client; the spare becomes lease N+1's guest at the recycle, and its console
    was the attacker's. The runtime now holds every console socket of a QEMU from its launch."""
    from vmsidecar_images.console import Console

    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M", "standby": True})
    client = rt.client()
    await client.wait_ready(180)
    await client.wait_spare()
    [spare] = qemu_pids(str(rt.state / "spare"))
    argv = Path(f"/proc/{spare}/cmdline").read_bytes().decode().split("\0")
    serial = next(a.split("path=")[1].split(",")[0] for a in argv if a.startswith("socket,id=ser0,"))
    reader, writer = await asyncio.open_unix_connection(serial)  # (what the escaped QEMU does)
    try:
        await client.recycle()
        await client.wait_ready(60)
        con = await Console.open(rt.shared / "console.sock")
        try:
            await con.wake(60)
            await con.run("echo next-lease-$((6*7))")
            stolen = b""
            with contextlib.suppress(TimeoutError):
                while True:
                    stolen += await asyncio.wait_for(reader.read(4096), 2)
                    if not stolen or reader.at_eof():
                        break
            assert b"next-lease-42" not in stolen, stolen[-500:]
        finally:
            await con.close()
    finally:
        writer.close()
