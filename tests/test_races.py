"""Races found by reading the code, each produced for real: a forward's port taken between its
choice and QEMU's bind; a wait for Ready on a VM nothing will boot; concurrent and unread dumps; a
VM powered on while a flash from a reference is still pulling; a new lease's console clear racing a
reader whose backlog is full."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from test_console_hub import FakeChardev

from fixtures.faults import ThrottleProxy, wait_phase
from fixtures.registry import push_incompressible
from fixtures.waiting import wait_until_async
from vmsidecar_contract.errors import GuestError, StateError, TransferError, VmsidecarError
from vmsidecar_contract.spec import load_spec
from vmsidecar_images.console import Console
from vmsidecar_runtime import ports
from vmsidecar_runtime.backend import close_backends
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
        await close_backends()  # serve's last step: QEMU's reap (a test that skipped it left a pipe open)
        thief.close()
        shutil.rmtree(paths.run, ignore_errors=True)  # (serve's job in a runtime; this test has none)


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


async def _stalled_dump(socket: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int, Any]:
    """``GET /v1/vm/disk?format=raw`` by a reader that takes the answer's head and then reads no
    more (a lease holder's exporter can do this): the stream, the status and a refusal's JSON body."""
    reader, writer = await asyncio.open_unix_connection(str(socket))
    writer.write(b"GET /v1/vm/disk?format=raw HTTP/1.1\r\nHost: vmsidecar\r\n\r\n")
    await writer.drain()
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 120)).decode()
    status = int(head.split()[1])
    length = int(re.search(r"(?im)^content-length: *(\d+)", head)[1])  # type: ignore[index]
    body = json.loads(await reader.readexactly(length)) if status != 200 else {}
    return reader, writer, status, body


async def _flashed_runtime(start_runtime: Any, tiny_image: Any) -> Any:
    """A runtime whose disk is an upload flash (no image in the spec): a dump needs no guest boot."""
    rt = await start_runtime({"memory": "256M"})
    await rt.client().flash(tiny_image.disk)
    return rt


async def test_a_lease_holder_gets_one_dump_at_a_time_and_a_leaving_reader_frees_its_file(
        start_runtime: Any, tiny_image: Any, tmp_path: Path) -> None:
    """Each dump converts the disk into a full-size temp file in the state volume that lives until
    its reader has read it all: dumps started and never read filled the state volume (before the
    fix, 3 unread dumps left 3 copies at once). One dump at a time (409 ``transfer_in_progress``,
    like a flash, which it also excludes); its file goes as soon as its reader leaves."""
    rt = await _flashed_runtime(start_runtime, tiny_image)
    client = rt.client()
    dumps = await asyncio.gather(*(_stalled_dump(rt.socket) for _ in range(3)))
    temp_files = sorted(p.name for p in rt.state.glob("dump-*"))
    statuses = sorted(status for _, _, status, _ in dumps)
    assert statuses == [200, 409, 409] and len(temp_files) == 1, (
        f"3 unread dumps answered {statuses} and left {len(temp_files)} temp disk copies: {temp_files}")
    for _, _, status, body in dumps:
        if status == 409:
            assert body["error"] == "transfer_in_progress", body
            assert "a disk dump" in body["message"] and "wait for it to end" in body["message"], body
    with pytest.raises(TransferError) as exc:  # a flash waits for the dump too
        await rt.client().flash(_junk(), size=4096)
    assert exc.value.code == "transfer_in_progress" and "a disk dump" in exc.value.message, exc.value
    for _, writer, _, _ in dumps:
        writer.close()  # the readers go away
    await wait_until_async(lambda: not list(rt.state.glob("dump-*")), 10,
                           "the dump's temp file to go once its reader left",
                           detail=lambda: [p.name for p in rt.state.glob("dump-*")])
    size = await client.dump(tmp_path / "after.raw", fmt="raw")  # the slot is free again
    assert size == (tmp_path / "after.raw").stat().st_size > 0
    # (removed as the handler ends, which can be just after the reader has its last byte)
    await wait_until_async(lambda: not list(rt.state.glob("dump-*")), 10, "the finished dump's file to go",
                           detail=lambda: [p.name for p in rt.state.glob("dump-*")])
    # the slot is free as the reader gets the last byte: a flash asked for at once is not a 409 (the
    # handler had held it until its own end; a reviewer's loop saw 3 in 100 idle, 100 in 100 with the
    # runtime's worker threads busy)
    for _ in range(10):
        await client.dump(tmp_path / "again.qcow2")
        with pytest.raises(VmsidecarError) as refused:
            await client.flash(_junk(), size=4096)  # (junk: refused as an image, once it is let in)
        assert refused.value.code != "transfer_in_progress", refused.value


async def test_an_unread_dump_is_ended_with_its_lease(start_runtime: Any, tiny_image: Any) -> None:
    """A dump still being read when its lease ends (recycle) is cut off and its temp file removed:
    before the fix the copy of lease N's disk stayed in the state volume into lease N+1."""
    rt = await _flashed_runtime(start_runtime, tiny_image)
    client = rt.client()
    lease_n = await client.claim()
    reader, writer, status, _ = await _stalled_dump(rt.socket)
    assert status == 200 and len(list(rt.state.glob("dump-*"))) == 1
    state = await asyncio.wait_for(client.recycle(boot=False, if_generation=lease_n.generation), 30)
    assert state.generation == lease_n.generation + 1
    await wait_until_async(lambda: not list(rt.state.glob("dump-*")), 10,
                           "the ended lease's dump file to go", detail=lambda: list(rt.state.glob("dump-*")))
    got = 0
    while data := await asyncio.wait_for(reader.read(1 << 20), 30):  # the runtime closed the stream
        got += len(data)
    assert got < tiny_image_raw_size(tiny_image), "the ended lease's dump was sent whole"
    writer.close()


def tiny_image_raw_size(image: Any) -> int:
    info = ["qemu-img", "info", "--output=json", str(image.disk)]
    out = subprocess.run(info, capture_output=True, text=True, check=True)
    return int(json.loads(out.stdout)["virtual-size"])


async def _junk() -> AsyncIterator[bytes]:
    yield b"\0" * 4096


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

    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})
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
    assert ready.snapshot.boot == "cold", ready.snapshot  # a power-on in a lease boots: its console is fresh
    con = await Console.open(rt.shared / "console.sock")
    try:
        await con.expect("VMSIDECAR-READY image=tiny ", 120)  # the old disk's guest, this boot's output
    finally:
        await con.close()
