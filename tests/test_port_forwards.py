"""Named port forwards: host ports picked free at boot (two instances never collide), reported by
the API, and reachable through the driver's NetworkClient child — on a real guest."""

from __future__ import annotations

import asyncio
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fixtures.jmp import exporter_config, jmp_env
from fixtures.ports import free_port
from fixtures.waiting import wait_until_async
from vmsidecar_contract.errors import HostError
from vmsidecar_contract.spec import PortForward
from vmsidecar_images.console import Console
from vmsidecar_runtime import ports

pytestmark = pytest.mark.timeout(600)

CLIENT = """
from jumpstarter.utils.env import env
with env() as client:
    print("address", client.vm.web.address())
    with client.vm.web.stream() as conn:
        print("got", conn.receive().decode().strip())
"""


async def _serve_once(rt: Any, text: str) -> None:
    con = await Console.open(rt.shared / "console.sock")
    await con.wake()
    await con.run(f"(echo {text} | nc -l -p 8080 >/dev/null 2>&1 &)")
    await con.close()


async def _read_forward(address: str) -> bytes:
    """Connect until the guest's listener answers (slirp accepts before the guest listens)."""
    host, port = address.rsplit(":", 1)

    async def answered() -> bytes:
        reader, writer = await asyncio.open_connection(host, int(port))
        line = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
        return line.strip()

    return await wait_until_async(answered, 60, f"the guest to answer through {address}", interval=0.25)


async def test_forwards_are_free_reported_and_reach_the_guest(
    start_runtime: Any, tiny_image: Any, tmp_path: Path
) -> None:
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M",
            "network": {"forwards": [{"name": "web", "guest_port": 8080}]}}
    first = await start_runtime(spec, name="one")
    a = await first.client().wait_ready(180)
    await first.client().wait_stored()  # the second restores the first's capture, not a boot of its own
    second = await start_runtime(spec, name="two")
    b = await second.client().wait_ready(180)
    assert a.forwards["web"].startswith("127.0.0.1:") and a.forwards["web"] != b.forwards["web"]

    await _serve_once(first, "hello-from-guest")
    assert await _read_forward(a.forwards["web"]) == b"hello-from-guest"

    await _serve_once(first, "hello-through-jumpstarter")
    cfg = exporter_config(tmp_path / "exporter.yaml",
                          {"socket": str(first.socket), "recycle": "InPlaceReuse", "spec": spec})
    (tmp_path / "client.py").write_text(CLIENT)
    result = await asyncio.to_thread(
        subprocess.run, ["jmp", "shell", "--exporter-config", str(cfg), "--", "python", "client.py"],
        cwd=tmp_path, env=jmp_env(), capture_output=True, text=True, timeout=120)
    assert f"address tcp://{a.forwards['web']}" in result.stdout, result.stderr[-2000:]
    assert "got hello-through-jumpstarter" in result.stdout, result.stderr[-2000:]


def test_a_fixed_port_the_last_lease_connected_through_is_free_for_the_next_boot_a_listened_one_is_not() -> None:
    """A connection through a fixed forward that the guest's side closed first leaves the host port in
    TIME_WAIT for a minute: QEMU's slirp binds it all the same (SO_REUSEADDR), and so must the
    runtime's check before a boot (the recycle after such a lease failed, "in use"). A port another
    socket listens on stays refused."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as slirp's
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the guest's side first: TIME_WAIT is on the host port's side
    assert client.recv(1) == b""
    client.close()
    listener.close()
    forward = PortForward(name="ssh", guest_port=22, host_port=port)
    assert ports.allocate([forward]) == {"ssh": port}

    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", port))
        other.listen()
        with pytest.raises(HostError, match=f"host port {port} for forward 'ssh' is in use"):
            ports.allocate([forward])


async def test_a_fixed_port_taken_at_a_restore_fails_the_boot_and_keeps_the_snapshot(
        start_runtime: Any, tiny_image: Any) -> None:
    """Another process holding a fixed forward's host port is the host's problem, not the snapshot's:
    the boot fails naming the port, and once the port is free the next recycle restores (the
    snapshot was discarded as refused, and the guest booted cold to capture it again)."""
    port = free_port()
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "channels": [{"name": "port-clash"}],
            "network": {"forwards": [{"name": "ssh", "guest_port": 22, "host_port": port}]}}
    rt = await start_runtime(spec)
    client = rt.client()
    await client.wait_ready(240)
    assert (await client.wait_stored()).snapshot.available
    await client.power("off", graceful=False)
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        with pytest.raises(HostError, match=f"host port {port} for forward 'ssh' is in use"):
            await client.recycle()
    state = await client.state()
    assert state.snapshot.available, state.snapshot
    await client.recycle()
    state = await client.wait_ready(120)
    assert state.snapshot.boot == "restored", state.snapshot
