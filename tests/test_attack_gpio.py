"""Attack: a hostile guest (and QEMU side) on the runtime's virtio-gpio backend (issue 19, item 6).

The test connects to a real runtime's vhost-user GPIO socket as QEMU would (the runtime drops its
QEMU's session for the newest connection), with a memfd as guest memory, and writes what a
malicious guest driver could: a 4 GiB descriptor, a response buffer of 1 GiB, 60 MiB of readable
buffers, a loop, a 32768-descriptor chain posted 32768 times, an avail index racing 65000 ahead,
and (as the QEMU side) a ring size and a message size past any limit. Meanwhile ``GET /v1/vm``
must answer within 1 s, and the runtime's RSS high-water mark may not grow by more than 64 MiB.

The lease holder attacks ``gpio.sock`` through the exporter's real GPIO drivers (any JSON as their
arguments): waits with no timeout opened and abandoned again and again must leave no waiter, client
or fd in the runtime (the device outlives leases); the end of a lease ends its waits; connections
past the cap are refused in a sentence; a timeout that is not a number of seconds in range is a
``ValueError`` naming it. These run on a real control socket without a guest.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.attack import VhostMaster, max_state_latency, memory_kib, qemu_chardev_path
from fixtures.runtime import qemu_pids
from fixtures.waiting import wait_until_async
from jumpstarter_driver_vmsidecar.driver import VirtualMachine
from vmsidecar_contract.spec import GpioLine
from vmsidecar_runtime.devices import gpio_control
from vmsidecar_runtime.devices import vhost_user as vu
from vmsidecar_runtime.devices import virtio_gpio as vg
from vmsidecar_runtime.devices.gpio import GpioDevice
from vmsidecar_runtime.devices.virtqueue import DESC_NEXT, DESC_WRITE

pytestmark = pytest.mark.timeout(300)

MIB = 1 << 20
LINES = [{"name": "button", "direction": "in"}, {"name": "led", "direction": "out"}]


async def test_hostile_virtqueues_keep_the_runtime_answering_and_small(
    start_runtime: Any, tiny_image: Any, record_property: Any
) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off",
                              "gpio": LINES, "readiness": {"pattern": None}})
    client = rt.client()
    await client.wait_ready(120)
    (qemu,) = qemu_pids(str(rt.state))
    before = memory_kib(rt.proc.pid)
    m = VhostMaster(qemu_chardev_path(qemu, "gpio-vhost.sock"), size=96 * MIB, num=256)
    worst = 0.0
    try:
        await m.connect()
        m.start_queue()
        req, res = m.data, m.data + 0x100
        struct.pack_into("<HHI", m.mem, req, vg.MSG_GET_VALUE, 0, 0)
        m.post([(req, 8, DESC_NEXT, 1), (res, 2, DESC_WRITE, 0)], 0, 1)
        assert await m.used_len(1) == 2 and m.mem[res] == vg.STATUS_OK  # a good request is served

        # one request each: a 4 GiB request buffer; GET_NAMES into a 1 GiB response buffer (outside
        # memory: checked before the response is built); 4 x 15 MiB of readable buffers inside
        # memory (over the per-request cap: refused before a byte is copied); a chain that loops
        m.post([(req, 0xFFFFFFFF, DESC_NEXT, 1), (res, 2, DESC_WRITE, 0)], 0, 2)
        struct.pack_into("<HHI", m.mem, req + 0x1000, vg.MSG_GET_NAMES, 0, 0)
        m.post([(req + 0x1000, 8, DESC_NEXT, 1), (res, 1 << 30, DESC_WRITE, 0)], 0, 3)
        big = [(m.data + 0x10000 + i * 15 * MIB, 15 * MIB, DESC_NEXT, i + 1) for i in range(4)]
        m.post([*big, (res, 2, DESC_WRITE, 0)], 0, 4)
        m.post([(req, 8, DESC_NEXT, 1), (res, 2, DESC_NEXT | DESC_WRITE, 0)], 0, 5)
        worst = max(worst, await max_state_latency(client, 1.5))
        for idx in (2, 3, 4, 5):
            await m.used_len(idx, timeout=5)

        # a ring of 32768 (the virtio maximum) whose one chain is 32768 descriptors long, posted
        # 32768 times: every slot of the ring names it
        m.start_queue(num=32768)
        m.descriptors([(req, 8, DESC_NEXT, i + 1) for i in range(32767)] + [(res, 2, DESC_WRITE, 0)])
        m.set_avail_idx(32768)
        worst = max(worst, await max_state_latency(client, 3))

        # the avail index races 65000 ahead of what was served, again and again
        m.start_queue(num=256)
        for step in range(5):
            m.set_avail_idx(m.used_idx() + 65000 + step)
        worst = max(worst, await max_state_latency(client, 1.5))

        # the QEMU side: a ring larger than virtio allows, then a 4 GiB message: the session ends
        m.send(vu.SET_VRING_NUM, struct.pack("<II", 0, 1 << 20))
        assert await m.dropped(), "the runtime kept a session asking for a 1 Mi ring"
    finally:
        m.close()
    m2 = VhostMaster(qemu_chardev_path(qemu, "gpio-vhost.sock"))
    try:
        await m2.connect()
        m2.sock.sendall(struct.pack("<III", vu.GET_FEATURES, vu.FLAG_VERSION, 0xFFFFFFFF) + b"x" * 65536)
        assert await m2.dropped(), "the runtime kept reading a 4 GiB vhost-user message"
    finally:
        m2.close()
    worst = max(worst, await max_state_latency(client, 1))
    after = memory_kib(rt.proc.pid)
    grew = (after["VmHWM"] - before["VmHWM"]) / 1024
    log = rt.log_text()
    record_property("gpio_attack_api_latency_max_s", round(worst, 3))
    record_property("gpio_attack_hwm_growth_mib", round(grew, 1))
    print(f"GPIO attack: API latency max {worst:.3f} s; runtime RSS {before['VmRSS'] // 1024} -> "
          f"{after['VmRSS'] // 1024} MiB, high-water mark grew {grew:.1f} MiB")
    assert grew < 64, f"the runtime's RSS high-water mark grew by {grew:.0f} MiB"
    assert "gpio: request chain refused" in log or "gpio: request refused" in log, log[-2000:]
    assert "is broken (avail index" in log, log[-2000:]
    assert (await client.state()).phase.value == "Ready"
    # and the runtime still controls its QEMU (hard off: the guest's own power-off is not the point)
    assert (await client.power("off", graceful=False)).phase.value == "Stopped"


# ---- the lease holder on gpio.sock, through the exporter's drivers (no guest) ------------------------
Tree = tuple[GpioDevice, Any]
#: a wait on ``led`` (no timeout), which nothing here drives
WAIT_LED = {"op": "wait", "line": "led", "for": "active"}


@pytest.fixture
async def gpio_tree(tmp_path: Path) -> AsyncIterator[Tree]:
    """A real ``gpio.sock`` and the exporter's real driver tree on it (its lease already claimed: no
    runtime API behind it). Nothing drives ``led`` (the guest would): its waits wait."""
    dev = GpioDevice([GpioLine.model_validate(x) for x in LINES])
    await dev.listen_control(tmp_path / "gpio.sock")
    vm = VirtualMachine(socket=str(tmp_path / "api.sock"), spec={"image": "file:/none.qcow2", "gpio": LINES})
    vm.link.claimed_generation = 1
    try:
        yield dev, vm.children["gpio"]
    finally:
        await dev.close()
        await wait_until_async(lambda: not dev.control._clients, 5, "the control connections to end")


def _socket_fds() -> int:
    """Sockets this process holds: the control server's and its clients' (both ends live here)."""
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


async def _ask(sock: Path, request: dict[str, Any]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_unix_connection(str(sock))
    writer.write(json.dumps(request).encode() + b"\n")
    await writer.drain()
    return reader, writer


async def test_abandoned_waits_leave_no_waiter_client_or_fd(gpio_tree: Tree, tmp_path: Path) -> None:
    dev, gpio = gpio_tree
    server, led, sock = dev.control, gpio.children["led"], tmp_path / "gpio.sock"
    fds = _socket_fds()
    for i in range(50):  # j vm gpio led wait-for-edge rising, timeout None, then ^C
        seen = set(server._waiters)
        call = asyncio.create_task(led.wait_for_edge("rising", None))
        await wait_until_async(lambda seen=seen: server._waiters - seen, 5, f"wait {i} to be pending")
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
    for _ in range(20):  # and raw clients that hang up mid-wait
        seen = set(server._waiters)
        _, writer = await _ask(sock, WAIT_LED)
        await wait_until_async(lambda seen=seen: server._waiters - seen, 5, "the raw wait to be pending")
        writer.close()
    await wait_until_async(lambda: not server._waiters and not server._clients and _socket_fds() <= fds, 2,
                           "the abandoned waits to end",
                           detail=lambda: f"{len(server._waiters)} waiters, {len(server._clients)} clients, "
                                          f"{_socket_fds() - fds} extra sockets")
    # the socket still serves, and a wait still sees its edge
    reader, writer = await _ask(sock, {"op": "wait", "line": "button", "for": "rising"})
    await wait_until_async(lambda: server._waiters, 5, "the wait to be pending")
    dev.model.drive("button", 1)
    assert json.loads(await asyncio.wait_for(reader.readline(), 5)) == {"ok": True, "value": 1}
    writer.close()


async def test_the_end_of_a_lease_ends_its_waits(gpio_tree: Tree, tmp_path: Path) -> None:
    dev, gpio = gpio_tree
    server = dev.control
    calls = [asyncio.create_task(gpio.children["led"].wait_for_active(None)) for _ in range(3)]
    _, idle = await asyncio.open_unix_connection(str(tmp_path / "gpio.sock"))  # connected, asks nothing
    await wait_until_async(lambda: len(server._waiters) == 3, 5, "the waits to be pending")
    dev.end_lease()
    for result in await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 2):
        assert isinstance(result, RuntimeError) and "lease ended" in str(result), result
    await wait_until_async(lambda: not server._waiters and not server._clients, 2, "the connections to close")
    idle.close()
    assert await gpio.children["led"].read_pin() == 0  # the socket serves the next lease


async def test_connections_past_the_cap_are_refused(gpio_tree: Tree, tmp_path: Path) -> None:
    dev, gpio = gpio_tree
    server, cap, sock = dev.control, gpio_control.MAX_CLIENTS, tmp_path / "gpio.sock"
    held = [await _ask(sock, WAIT_LED) for _ in range(cap)]
    await wait_until_async(lambda: len(server._waiters) == cap, 5, f"{cap} waits to be pending")
    reader, writer = await _ask(sock, {"op": "list"})
    reply = json.loads(await asyncio.wait_for(reader.readline(), 5))
    assert reply["error"] == "busy" and f"at most {cap} connections" in reply["message"], reply
    assert await reader.read() == b""
    writer.close()
    with pytest.raises(RuntimeError, match=f"at most {cap} connections"):  # the driver says the same
        await gpio.children["led"].read_pin()
    held.pop()[1].close()
    await wait_until_async(lambda: len(server._clients) < cap, 2, "a held connection to end")
    assert await gpio.children["led"].read_pin() == 0
    for _, w in held:
        w.close()


#: the documented range is 0 to 86400 s, or None
BAD_TIMEOUTS = ["inf", float("inf"), float("nan"), 1e308, -1, 86400.5, [1], True, {"s": 1}, "5"]


@pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=repr)
async def test_a_bad_timeout_is_a_value_error_naming_it(gpio_tree: Tree, tmp_path: Path, bad: Any) -> None:
    dev, gpio = gpio_tree
    led = gpio.children["led"]
    for call in (lambda: led.wait_for_active(bad), lambda: led.wait_for_edge("rising", bad)):
        with pytest.raises(ValueError, match=r"^timeout must be a number of seconds from 0 to 86400"):
            await asyncio.wait_for(call(), 2)
    # the runtime refuses it too (a JSON number past a float is inf; NaN and Infinity are JSON to Python)
    reader, writer = await _ask(tmp_path / "gpio.sock", {**WAIT_LED, "timeout": bad})
    reply = json.loads(await asyncio.wait_for(reader.readline(), 2))
    writer.close()
    assert reply["error"] == "bad_wait" and reply["message"].startswith("timeout must be"), reply
    assert not dev.control._waiters


async def test_timeouts_in_range_still_work(gpio_tree: Tree) -> None:
    led = gpio_tree[1].children["led"]
    with pytest.raises(TimeoutError, match=r"did not go active within 0\.2 s"):
        await led.wait_for_active(0.2)
    await led.wait_for_inactive(86400)  # already inactive: at once
    await led.wait_for_inactive(0)


async def test_a_gpio_call_of_an_ended_lease_acts_on_nothing_of_the_next(start_runtime: Any) -> None:
    """0.9.0 hands the next lease out while the last one's session ends: lease N's tree opened
    ``gpio.sock`` after lease N+1 claimed and drove N+1's button (``gpio.sock`` takes no API call, so
    the generation check of the API never saw it). A request of a tree names its generation now,
    and is refused once the VM moved on; a runtime that restarted (unclaimed) is claimed again."""
    rt = await start_runtime({"memory": "256M", "gpio": LINES})
    spec = {"memory": "256M", "gpio": LINES}
    lease_n = VirtualMachine(socket=str(rt.socket), spec=spec, recycle="InPlaceReuse")
    lease_n1 = VirtualMachine(socket=str(rt.socket), spec=spec, recycle="InPlaceReuse")
    button_n = lease_n.children["gpio"].children["button"]
    button_n1 = lease_n1.children["gpio"].children["button"]
    try:
        assert await button_n.read_pin() == 0  # lease N's first call claims
        await lease_n1.link.call(lambda c: c.state())  # the next lease claims: N's generation is recycled
        assert lease_n1.link.claimed_generation == (lease_n.link.claimed_generation or 0) + 1
        with pytest.raises(ValueError, match="has ended"):
            await button_n.on()
        assert await button_n1.read_pin() == 0, "lease N's tree drove lease N+1's button"
        await button_n1.on()
        assert await button_n1.read_pin() == 1
        # a raw request naming an ended (or a made-up) generation is refused the same way
        ended = {"op": "set", "line": "button", "value": 0, "generation": lease_n.link.claimed_generation}
        reader, writer = await _ask(rt.socket.parent / "gpio.sock", ended)
        reply = json.loads(await asyncio.wait_for(reader.readline(), 5))
        writer.close()
        assert reply["ok"] is False and reply["error"] == "generation_changed", reply
        for bad in ("1", -1, True, 1.5, 10**30):
            reader, writer = await _ask(rt.socket.parent / "gpio.sock", {"op": "get", "line": "button",
                                                                        "generation": bad})
            reply = json.loads(await asyncio.wait_for(reader.readline(), 5))
            writer.close()
            assert reply["error"] == "bad_request" and "generation" in reply["message"], (bad, reply)
        assert await button_n1.read_pin() == 1
        # the runtime restarts: lease N+1's tree claims the new process's VM and goes on
        assert rt.stop() == 0
        await start_runtime(spec)
        await button_n1.off()
        state = await lease_n1.link.call(lambda c: c.state())
        assert state.claimed and lease_n1.link.claimed_generation == state.generation == 0, state
    finally:
        for vm in (lease_n, lease_n1):
            if vm.link._client is not None:
                await vm.link._client.close()


async def test_the_next_lease_finds_the_lines_as_the_spec_wires_them_without_a_boot(start_runtime: Any) -> None:
    """A recycle without a boot (``recycle(boot=False)``; a runtime with no image yet; a boot that
    fails) left the lines as lease N set them, until the next power-on: lease N+1 read what lease N
    had driven. The end of a lease puts them back to the spec's initial values."""
    rt = await start_runtime({"memory": "256M", "gpio": LINES})
    spec = {"memory": "256M", "gpio": LINES}
    lease_n = VirtualMachine(socket=str(rt.socket), spec=spec, recycle="InPlaceReuse")
    lease_n1 = VirtualMachine(socket=str(rt.socket), spec=spec, recycle="InPlaceReuse")
    try:
        await lease_n.children["gpio"].children["button"].on()
        assert await lease_n.children["gpio"].children["button"].read_pin() == 1
        await lease_n1.link.call(lambda c: c.state())  # the next lease claims: N's generation is recycled
        assert await lease_n1.children["gpio"].children["button"].read_pin() == 0, "lease N's line value stayed"
    finally:
        for vm in (lease_n, lease_n1):
            if vm.link._client is not None:
                await vm.link._client.close()
