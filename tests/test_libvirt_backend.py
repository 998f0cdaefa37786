"""The libvirt backend against a daemon the runtime does not own (``libvirt_uri`` in the spec)."""

from __future__ import annotations

import grp
import os
import pwd
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.events import collecting
from fixtures.runtime import _libvirt_problem

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(_libvirt_problem() is not None, reason=str(_libvirt_problem()))]


@pytest.fixture
async def libvirt_daemon() -> AsyncIterator[Any]:
    """A libvirtd started by the test (the same private, namespaced kind the runtime starts)."""
    from vmsidecar_runtime.backend.libvirt.daemon import PrivateDaemon

    root = Path(tempfile.mkdtemp(prefix="vmsidecar-lv-"))
    daemon = PrivateDaemon(root / "libvirt")
    await daemon.start()
    yield daemon
    await daemon.stop()
    subprocess.run(["rm", "-rf", str(root)], check=False)


def _names(passwd_or_group: str) -> set[str]:
    return {line.split(":", 1)[0] for line in passwd_or_group.splitlines() if line}


async def test_private_daemon_needs_no_system_qemu_user(libvirt_daemon: Any) -> None:
    """libvirtd resolves its built-in QEMU user (Debian: ``libvirt-qemu``, created only by
    libvirt-daemon-system) before it reads qemu.conf; the private daemon is up without that package."""
    from vmsidecar_runtime.backend.libvirt.daemon import BUILTIN_QEMU_GROUPS, BUILTIN_QEMU_USERS, _children

    conf = (libvirt_daemon.root / "etc" / "qemu.conf").read_text()
    assert f'user = "+{os.getuid()}"' in conf and f'group = "+{os.getgid()}"' in conf
    # the daemon's own view of /etc (unshare → nsinit → libvirtd) knows every built-in name …
    [nsinit] = _children(libvirt_daemon.proc.pid)
    [libvirtd] = _children(nsinit)
    etc = Path(f"/proc/{libvirtd}/root/etc")
    for name in BUILTIN_QEMU_USERS:
        assert name in _names((etc / "passwd").read_text()) or _host_knows(pwd.getpwnam, name), name
    for name in BUILTIN_QEMU_GROUPS:
        assert name in _names((etc / "group").read_text()) or _host_knows(grp.getgrnam, name), name
    # … while the host's stays untouched (the bind mounts live in the daemon's namespace only)
    assert "vmsidecar placeholder" not in Path("/etc/passwd").read_text()


def _host_knows(lookup: Any, name: str) -> bool:
    """Known to the host through NSS (files or elsewhere), so libvirtd needs no placeholder."""
    try:
        lookup(name)
    except KeyError:
        return False
    return True


def test_startup_failure_names_the_fix() -> None:
    """libvirtd's own words when its built-in QEMU user is missing (measured on Debian 12 without
    libvirt-daemon-system) turn into a message naming the fix, per daemon mode."""
    from vmsidecar_runtime.backend.libvirt.daemon import startup_hint

    said = ["2026-11-23 06:52:48.033+0000: 23: error : virGetUserID:760 : invalid argument: "
            "Failed to parse user 'libvirt-qemu'",
            "error : daemonRunStateInit:616 : Driver state initialization failed"]
    without_ns = startup_hint(said, namespaced=False)
    assert "'libvirt-qemu'" in without_ns and "CAP_SYS_ADMIN" in without_ns
    assert "libvirt-daemon-system" in without_ns and "useradd --system" in without_ns
    assert "useradd --system --no-create-home --user-group libvirt-qemu" in startup_hint(said, namespaced=True)
    assert "CAP_SYS_ADMIN" in startup_hint(["error : something else"], namespaced=True)


def _domains(uri: str) -> list[str]:
    out = subprocess.run(["virsh", "-c", uri, "list", "--all", "--name"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


async def test_external_uri_boot_power_and_exit_leave_the_daemon_alone(
    start_runtime: Any, tiny_image: Any, libvirt_daemon: Any
) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M",
                              "libvirt_uri": libvirt_daemon.uri}, backend="libvirt")
    client = rt.client()
    state = await client.wait_ready(180)
    assert state.backend == "libvirt" and rt.libvirt_uri() == libvirt_daemon.uri
    assert "private libvirtd" not in rt.log_text()  # it used ours, it did not start its own
    [domain] = _domains(libvirt_daemon.uri)
    assert domain.startswith("vmsidecar-")
    state = await client.power("off", graceful=True, timeout=60)
    assert state.phase.value == "Stopped" and _domains(libvirt_daemon.uri) == []
    await client.power("on")
    await client.wait_ready(180)
    assert _domains(libvirt_daemon.uri) == [domain]
    assert rt.stop() == 0
    assert _domains(libvirt_daemon.uri) == []  # the guest is gone, the daemon (not the runtime's) still answers
    assert libvirt_daemon.proc.returncode is None


async def test_guest_powering_itself_off_is_stopped_and_leaves_no_domain(start_runtime: Any, tiny_image: Any) -> None:
    from vmsidecar_images.console import Console

    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"}, backend="libvirt")
    client = rt.client()
    await client.wait_ready(180)
    assert len(rt.virsh_domains()) == 1
    con = await Console.open(rt.shared / "console.sock")
    await con.wake()
    async with collecting(client, ["guest.powered_off", "backend.exited", "phase"]) as events:
        con.writer.write(b"poweroff -f\n")
        await con.writer.drain()
        await events.wait_for(lambda e: e["type"] == "phase" and e["data"]["phase"] == "Stopped", 60)
    seen = events.kinds()
    await con.close()
    assert ("guest.powered_off", "guest-shutdown") in seen, seen
    state = await client.state()
    assert state.phase.value == "Stopped" and state.last_error is None
    assert rt.virsh_domains() == []
