"""GPIO on a real guest: vhost-user virtio-gpio backend, the guest's gpio-virtio gpiochip and
libgpiod tools, and upstream's gpiod clients through Jumpstarter."""

from __future__ import annotations

import asyncio
import json
import statistics
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest
from jumpstarter.client.core import DriverError
from jumpstarter_driver_gpiod.client import PinState

from fixtures.attack import VhostMaster
from fixtures.vmdev import vm_client, vm_runtime
from fixtures.waiting import wait_until_async
from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.spec import GpioLine
from vmsidecar_images.console import Console
from vmsidecar_runtime.devices import vhost_user as vu
from vmsidecar_runtime.devices import virtio_gpio as vg
from vmsidecar_runtime.devices import virtqueue as vq
from vmsidecar_runtime.devices.gpio import GpioDevice

# one xdist worker runs the module (scripts/test: --dist loadgroup), so its module-scoped `gpio_vm`
# is made once, not once on each worker that gets one of its tests
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("gpio")]

LINES = [
    {"name": "reset-button", "direction": "in"},
    {"name": "led", "direction": "out"},
    {"name": "boot-mode", "direction": "in", "initial": 1},
]


@pytest.fixture(scope="module")
def gpio_vm(tiny_image: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "gpio": LINES}
    root, cache = tmp_path_factory.mktemp("gpio-rt"), tmp_path_factory.mktemp("gpio-cache")
    with vm_runtime(spec, root, cache) as rt, vm_client(rt, spec) as client:
        yield rt, client


async def _console(rt: Any) -> Console:
    con = await Console.open(rt.shared / "console.sock")
    await con.wake()
    return con


async def _guest_listens(rt: Any, name: str, edge: int) -> None:
    """Until the guest's gpiomon listens on ``name``: as the device sees it, the line's ``edge``
    interrupt is enabled and an event buffer armed (an edge before that would be missed)."""

    async def listening() -> bool:
        reader, writer = await asyncio.open_unix_connection(str(rt.shared / "gpio.sock"))
        try:
            writer.write(b'{"op": "list"}\n')
            await writer.drain()
            lines = json.loads(await reader.readline())["lines"]
        finally:
            writer.close()
        line = next(x for x in lines if x["name"] == name)
        return bool(line["armed"] and line["irq_type"] & edge)

    await wait_until_async(listening, 30, f"the guest's gpiomon to listen on {name}")


async def test_gpiochip_names_and_both_directions(gpio_vm: tuple[Any, Any]) -> None:
    rt, client = gpio_vm
    con = await _console(rt)
    info = await con.run("gpioinfo gpiochip0")
    assert '"reset-button"' in info and '"led"' in info and '"boot-mode"' in info, info
    assert (await con.run("gpioget gpiochip0 0 2")).split() == ["0", "1"]  # spec initial values

    # host drives a guest input: `j vm gpio reset-button on` in Python
    button, led = client.gpio.children["reset-button"], client.gpio.children["led"]
    assert type(button).__name__ == "DigitalOutputClient" and type(led).__name__ == "DigitalInputClient"
    await asyncio.to_thread(button.on)
    assert (await con.run("gpioget gpiochip0 0")).strip() == "1"
    assert await asyncio.to_thread(button.read) == PinState.ACTIVE
    await asyncio.to_thread(button.off)
    assert (await con.run("gpioget gpiochip0 0")).strip() == "0"

    # guest drives an output; the host reads it and waits on it
    await con.run("gpioset gpiochip0 1=1")
    assert await asyncio.to_thread(led.read) == PinState.ACTIVE
    await asyncio.to_thread(led.wait_for_active, 5)  # already active: returns at once
    waiter = asyncio.create_task(asyncio.to_thread(led.wait_for_edge, "falling", 30))
    await asyncio.sleep(0.5)  # the runtime tells no one when a host wait is registered: give it the time
    await con.run("gpioset gpiochip0 1=0")
    await asyncio.wait_for(waiter, 30)
    assert await asyncio.to_thread(led.read) == PinState.INACTIVE
    with pytest.raises(DriverError, match=r"did not go active within 0\.5 s"):  # TimeoutError, as upstream's
        await asyncio.to_thread(led.wait_for_active, 0.5)

    # the guest cannot drive a host-driven line (the device answers with an error status)
    assert "error" in (await con.run("gpioset gpiochip0 0=1 2>&1")).lower()
    await con.close()


async def test_gpiomon_woken_by_host_edge_and_round_trip(gpio_vm: tuple[Any, Any], record_property: Any) -> None:
    rt, client = gpio_vm
    con = await _console(rt)
    button, led = client.gpio.children["reset-button"], client.gpio.children["led"]
    con.writer.write(b"gpiomon -n 1 -r gpiochip0 0; echo MON-$?-DONE\n")
    await con.writer.drain()
    await _guest_listens(rt, "reset-button", vg.IRQ_RISING)
    await asyncio.to_thread(button.on)
    m = await con.expect(rb"RISING EDGE offset: 0[\s\S]*MON-0-DONE", 20)
    assert m
    await asyncio.to_thread(button.off)

    # round trip: host edge -> guest gpiomon -> guest gpioset -> host wait_for_active
    samples = []
    for _ in range(5):
        await con.run("gpioset gpiochip0 1=0")
        con.writer.write(b"gpiomon -n 1 -s -r gpiochip0 0 >/dev/null && gpioset gpiochip0 1=1\n")
        await con.writer.drain()
        await _guest_listens(rt, "reset-button", vg.IRQ_RISING)
        t0 = time.monotonic()
        await asyncio.to_thread(button.on)
        await asyncio.to_thread(led.wait_for_active, 20)
        samples.append(time.monotonic() - t0)
        await asyncio.to_thread(button.off)
    median_ms = statistics.median(samples) * 1000
    record_property("gpio_round_trip_ms", round(median_ms, 1))
    print(f"\nGPIO round trip host->guest gpiomon->gpioset->host: median {median_ms:.1f} ms "
          f"({', '.join(f'{s * 1000:.0f}' for s in samples)})")
    await con.close()


async def test_guest_reboot_reinitialises_the_device(gpio_vm: tuple[Any, Any]) -> None:
    rt, client = gpio_vm
    con = await _console(rt)
    con.seen.clear()
    con.writer.write(b"reboot\n")
    await con.writer.drain()
    await con.expect(rb"VMSIDECAR-READY", 120)  # the guest came back up (a reset, same QEMU)
    con2 = await _console(rt)
    button = client.gpio.children["reset-button"]
    await asyncio.to_thread(button.on)
    assert (await con2.run("gpioget gpiochip0 0")).strip() == "1"
    con2.writer.write(b"gpiomon -n 1 -f gpiochip0 0; echo MON-$?-DONE\n")
    await con2.writer.drain()
    await _guest_listens(rt, "reset-button", vg.IRQ_FALLING)
    await asyncio.to_thread(button.off)
    await con2.expect(rb"FALLING EDGE[\s\S]*MON-0-DONE", 20)
    await con.close()
    await con2.close()


async def test_control_socket_errors(gpio_vm: tuple[Any, Any]) -> None:
    rt, _ = gpio_vm
    reader, writer = await asyncio.open_unix_connection(str(rt.shared / "gpio.sock"))
    replies = []
    # 5000 "[": past what Python's JSON parser nests (a RecursionError, not a ValueError)
    for req in (b"not json\n", b"[" * 5000 + b"\n", b'{"op": "set", "line": "led", "value": 1}\n',
                b'{"op": "get", "line": "nope"}\n', b'{"op": "wait", "line": "led", "for": "sideways"}\n',
                b'{"op": "list"}\n'):
        writer.write(req)
        await writer.drain()
        replies.append(json.loads(await reader.readline()))
    assert [r.get("error") for r in replies[:5]] == ["bad_request", "bad_request", "not_host_driven",
                                                     "no_line", "bad_wait"]
    assert [x["name"] for x in replies[5]["lines"]] == ["reset-button", "led", "boot-mode"]
    # a line past the reader's limit: said, and that connection ends; the socket serves the next
    writer.write(b"x" * 100_000 + b"\n")
    await writer.drain()
    answer = json.loads(await reader.readline())
    assert answer["error"] == "bad_request" and "longer than" in answer["message"], answer
    assert await reader.read() == b""
    writer.close()
    reader, writer = await asyncio.open_unix_connection(str(rt.shared / "gpio.sock"))
    writer.write(b'{"op": "list"}\n')
    await writer.drain()
    assert "lines" in json.loads(await reader.readline())
    writer.close()


# ---- malformed virtqueue requests, crafted by speaking vhost-user to the backend directly ------------
async def test_malformed_virtqueue_requests_get_an_error_status(tmp_path: Any) -> None:
    dev = GpioDevice([GpioLine(name="a"), GpioLine(name="b", direction="out")])
    path = tmp_path / "vhost.sock"
    await dev.start_vhost(path)
    m = VhostMaster(path)
    mem, size = m.mem, m.size
    try:
        await m.connect()
        m.send(vu.GET_FEATURES)
        hdr = await m.reply(20)
        assert struct.unpack_from("<Q", hdr, 12)[0] & 1  # VIRTIO_GPIO_F_IRQ offered
        m.start_queue()
        await wait_until_async(lambda: dev.vhost.queues[0].started, 5, "the backend to start queue 0")
        post, used_len = m.post, m.used_len

        req, res = m.data, m.data + 0x100
        # 1. unknown request type -> STATUS_ERR
        struct.pack_into("<HHI", mem, req, 99, 0, 0)
        post([(req, 8, vq.DESC_NEXT, 1), (res, 2, vq.DESC_WRITE, 0)], 0, 1)
        assert await used_len(1) == 2 and mem[res] == vg.STATUS_ERR
        # 2. line out of range -> STATUS_ERR
        struct.pack_into("<HHI", mem, req, vg.MSG_GET_VALUE, 7, 0)
        post([(req, 8, vq.DESC_NEXT, 1), (res, 2, vq.DESC_WRITE, 0)], 0, 2)
        assert await used_len(2) == 2 and mem[res] == vg.STATUS_ERR
        # 3. short request (4 bytes) -> STATUS_ERR
        post([(req, 4, vq.DESC_NEXT, 1), (res, 2, vq.DESC_WRITE, 0)], 0, 3)
        assert await used_len(3) == 2 and mem[res] == vg.STATUS_ERR
        # 4. buffer outside guest memory / chain pointing past the ring -> used with length 0, no crash
        post([(size + 0x1000, 8, vq.DESC_NEXT, 1), (res, 2, vq.DESC_WRITE, 0)], 0, 4)
        assert await used_len(4) == 2 and mem[res] == vg.STATUS_ERR
        post([(req, 8, vq.DESC_NEXT, 50)], 0, 5)
        assert await used_len(5) == 0
        # 5. the guest may not drive a host-driven line
        struct.pack_into("<HHI", mem, req, vg.MSG_SET_VALUE, 0, 1)
        post([(req, 8, vq.DESC_NEXT, 1), (res, 2, vq.DESC_WRITE, 0)], 0, 6)
        assert await used_len(6) == 2 and mem[res] == vg.STATUS_ERR
        # and a good request still works afterwards
        struct.pack_into("<HHI", mem, req, vg.MSG_SET_VALUE, 1, 1)
        post([(req, 8, vq.DESC_NEXT, 1), (res, 2, vq.DESC_WRITE, 0)], 0, 7)
        assert await used_len(7) == 2 and mem[res] == vg.STATUS_OK
        assert dev.model.by_name["b"].value == 1 and dev.model.bad_requests >= 5
    finally:
        m.close()
        await dev.close()


async def test_j_cli_like_a_bench(gpio_vm: tuple[Any, Any], tiny_image: Any, tmp_path: Any) -> None:
    """`j vm gpio reset-button on` / `read` under a real `jmp shell` (runs last: its lease claims
    the VM, which recycles it)."""
    from fixtures.jmp import exporter_config, run_shell

    rt, _ = gpio_vm
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "gpio": LINES}
    cfg = exporter_config(tmp_path / "exporter.yaml", {"socket": str(rt.socket), "spec": spec,
                                                       "recycle": "InPlaceReuse"})
    script = ("j vm wait-ready >/dev/null 2>&1 || true\n"
              "j vm gpio reset-button on\nj vm gpio reset-button read\nj vm gpio led read\n"
              "j vm gpio reset-button off\nj vm gpio reset-button read\n")
    # a wait left pending before the lease (an earlier lease's, with no deadline): the device outlives
    # leases, so the claim and the recycle must end it, or it holds its waiter and fd for good
    reader, writer = await asyncio.open_unix_connection(str(rt.shared / "gpio.sock"))
    writer.write(b'{"op": "wait", "line": "led", "for": "rising", "timeout": null}\n')
    await writer.drain()
    result = await asyncio.to_thread(run_shell, ["--exporter-config", str(cfg)], script, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert await asyncio.wait_for(reader.read(), 30) == b"", "the wait outlived the lease"  # ended, closed
    writer.close()
    states = [ln.strip() for ln in result.stdout.splitlines() if ln.strip() in ("active", "inactive")]
    assert states == ["active", "inactive", "inactive"], result.stdout


async def test_a_gpio_guest_is_never_templated_and_says_why(gpio_vm: tuple[Any, Any]) -> None:
    # vhost-user maps guest RAM shared with the device's process for the instance's whole life: a
    # restore mapping the template shared would write into it, so the snapshot is a full stream
    rt, _ = gpio_vm
    async with RuntimeClient(rt.socket) as client:
        state = await client.state()
    assert state.snapshot.form == "stream", state.snapshot
    assert state.snapshot.form_reason == "vhost-user GPIO shares guest RAM with its backend process", state.snapshot
