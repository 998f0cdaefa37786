"""Races found by reading the code, each produced for real: a forward's port taken between its
choice and QEMU's bind; a wait for Ready on a VM nothing will boot; concurrent dumps; a VM powered
on while a flash from a reference is still pulling; a new lease's console clear racing a reader
whose backlog is full."""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path
from typing import Any

import pytest
from test_console_hub import FakeChardev

from fixtures.faults import ThrottleProxy, wait_phase
from fixtures.registry import push_incompressible
from fixtures.waiting import wait_until_async
from vmsidecar_contract.errors import GuestError, StateError
from vmsidecar_contract.spec import load_spec
from vmsidecar_images.console import Console
from vmsidecar_runtime import ports
from vmsidecar_runtime.console import CLIENT_QUEUE_CHUNKS, ConsoleHub
from vmsidecar_runtime.controller import RuntimePaths, VmController

pytestmark = pytest.mark.timeout(600)


async def test_a_forward_port_taken_before_qemu_binds_it_is_retried(
    tiny_image: Any, tmp_path: Path, image_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    thief = socket.socket()
    thief.bind(("127.0.0.1", 0))
    thief.listen()
    stolen = thief.getsockname()[1]
    picks = iter([stolen])
    real = ports._free_port
    # the one seam: the first "free" port handed out is one another process holds by the time QEMU binds
    monkeypatch.setattr(ports, "_free_port", lambda address: next(picks, None) or real(address))
    spec = load_spec({"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off",
                      "network": {"forwards": [{"name": "web", "guest_port": 80}]}})
    paths = RuntimePaths(tmp_path / "shared", image_cache, tmp_path / "state", Path(f"/tmp/vmsidecar-race-{id(tmp_path)}"))
    vm = VmController(spec, paths)
    await vm.start(boot=False)
    try:
        state = await vm.power_on()
        assert state.phase.value == "Running" and state.forwards["web"] != f"127.0.0.1:{stolen}"
    finally:
        await vm.close()
        thief.close()


async def test_wait_ready_gives_up_on_a_vm_that_stays_stopped(start_runtime: Any, tiny_image: Any) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})
    client = rt.client()
    await client.wait_ready(240)
    await client.power("off", graceful=False)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(GuestError, match="nothing is booting it; power it on"):
        await client.wait_ready(120)
    assert loop.time() - started < 30


async def test_concurrent_dumps_do_not_share_a_file(start_runtime: Any, tiny_image: Any, tmp_path: Path) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})
    client = rt.client()
    await client.wait_ready(240)
    await client.power("off", graceful=False)
    outs = [tmp_path / f"dump{i}.qcow2" for i in range(4)]
    sizes = await asyncio.gather(*(rt.client().dump(out) for out in outs))
    digests = {out.read_bytes()[:4096] for out in outs}
    assert all(size > 0 for size in sizes) and len(digests) == 1  # four whole, identical copies
    assert not list(rt.state.glob("dump-*")), "a dump file was left behind"


async def test_a_lease_clear_never_hands_a_full_reader_the_previous_lease_backlog(tmp_path: Path) -> None:
    """``ConsoleHub.clear(disconnect_clients=True)`` (a new lease) on a reader whose queue is full:
    the reader ends (EOF) after at most what was already in its socket, never with the queued
    previous-lease bytes (before the fix, the end marker did not fit in a full queue: the reader got
    the whole backlog and then hung, never dropped)."""
    chardev = FakeChardev(tmp_path / "qemu.sock")
    await chardev.start()
    hub = ConsoleHub("ttyS0", tmp_path / "console.sock")
    await hub.listen()
    await hub.attach(chardev.path)
    await asyncio.wait_for(chardev.connected.wait(), 10)
    reader, writer = await asyncio.open_unix_connection(str(hub.listen_path))  # never reads until the clear
    await wait_until_async(lambda: len(hub._clients) == 1, 10, "the hub to take the connection in", interval=0.01)
    (queue,) = hub._clients  # white box: how full this reader's backlog is

    # one chunk at a time (each read by the hub on its own), small enough that the chunk bound, not
    # the byte bound, fills first: once the socket is full, the queue takes CLIENT_QUEUE_CHUNKS more
    size, sent = 256, 0
    while queue.qsize() < CLIENT_QUEUE_CHUNKS:
        assert sent < 20_000, f"the reader's queue never filled ({queue.qsize()} chunks after {sent})"
        chardev.emit(f"old-{sent:06d}".encode().ljust(size - 1, b".") + b"\n")
        await chardev.writer.drain()  # type: ignore[union-attr]
        sent += 1
        # awaited in this iteration: the lambda sees this iteration's ``sent``
        await wait_until_async(lambda: hub.bytes_seen >= sent * size, 10,  # noqa: B023
                               "the hub to drain the chardev", interval=0.001)
    await asyncio.sleep(0.5)  # only waiting shows the queue stays full (the reader's pump is stuck on its socket)
    assert queue.full() and queue in hub._clients
    queued_from = sent - queue.qsize()  # chunks from here on were still in the queue, never sent

    hub.clear(disconnect_clients=True)  # the next lease starts
    chardev.emit(b"new-lease\n")
    fresh = Console(*await asyncio.open_unix_connection(str(hub.listen_path)))
    await fresh.expect(b"new-lease", 10)
    assert b"old-" not in fresh.seen

    got = bytearray()
    eof = False
    try:
        while data := await asyncio.wait_for(reader.read(1 << 16), 10):
            got += data
        eof = True
    except TimeoutError:
        pass
    late = [int(n) for n in re.findall(rb"old-(\d{6})", bytes(got)) if int(n) >= queued_from]
    assert not late, (f"after the clear the slow reader got {len(late)} previous-lease chunks that were "
                      f"still queued (from #{late[0]}; {sent} sent, {sent - queued_from} queued)")
    assert eof, "the slow reader was never disconnected by the clear"
    assert b"new-lease" not in got
    await fresh.close()
    writer.close()
    await hub.close()
    chardev.server.close()


async def test_a_vm_powered_on_during_a_flash_pull_is_not_powered_off_by_the_flash(
    start_runtime: Any, tiny_image: Any, registry: Any, tmp_path: Path
) -> None:
    """``flash_reference`` with ``power_off=false`` checks the phase before its pull and again under
    the lock after it: a VM powered on while the image was still downloading is refused with
    ``wrong_phase`` and keeps running on its old disk (before the fix, the flash powered it off)."""
    # 16 MiB of random data: cannot compress, and through the proxy below it takes minutes to pull
    push_incompressible(registry, "races/flash-mid-pull:1", tmp_path)

    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off"})
    client = rt.client()
    before = await client.wait_ready(240)
    await client.power("off", graceful=False)
    await wait_phase(client, "Stopped", timeout=60)

    port = int(registry.host.rsplit(":", 1)[1])
    async with ThrottleProxy(("127.0.0.1", port), rate=64 << 10) as proxy:
        flash = asyncio.create_task(rt.client().flash_reference(f"{proxy.host}/races/flash-mid-pull:1"))

        def flowing() -> bool:  # the layer is flowing: the flash is in its pull
            assert not flash.done(), f"the flash ended before its pull was under way: {flash}"
            return proxy.forwarded >= 512 << 10

        await wait_until_async(flowing, 120, "the pull to start", detail=lambda: f"{proxy.forwarded} bytes")
        on = await client.power("on")
        assert on.phase.value in ("Starting", "Running", "Ready") and on.boot == before.boot + 1
        assert not flash.done(), "the pull ended before the VM was powered on: no race was made"
        proxy.rate = 1 << 30  # let the pull finish now
        with pytest.raises(StateError) as exc:
            await asyncio.wait_for(flash, 180)
    assert exc.value.code == "wrong_phase" and "power_off=true" in exc.value.message, exc.value.message

    state = await wait_phase(client, "Running", "Ready", timeout=60)
    assert state.boot == on.boot and state.image_digest == before.image_digest  # not powered off, not flashed
    ready = await client.wait_ready(240)
    assert ready.boot == on.boot and ready.image_digest == before.image_digest
    con = await Console.open(rt.shared / "console.sock")
    try:
        await con.expect("VMSIDECAR-READY image=tiny ", 120)  # the old disk's guest, this boot's output
    finally:
        await con.close()
