"""Attack: a hostile guest (and QEMU side) on the runtime's virtio-gpio backend (issue 19, item 6).

The test connects to a real runtime's vhost-user GPIO socket as QEMU would (the runtime drops its
QEMU's session for the newest connection), with a memfd as guest memory, and writes what a
malicious guest driver could: a 4 GiB descriptor, a response buffer of 1 GiB, 60 MiB of readable
buffers, a loop, a 32768-descriptor chain posted 32768 times, an avail index racing 65000 ahead,
and (as the QEMU side) a ring size and a message size past any limit. Meanwhile ``GET /v1/vm``
must answer within 1 s, and the runtime's RSS high-water mark may not grow by more than 64 MiB.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest

from fixtures.attack import VhostMaster, max_state_latency, memory_kib, qemu_chardev_path
from fixtures.runtime import qemu_pids
from vmsidecar_runtime.devices import vhost_user as vu
from vmsidecar_runtime.devices import virtio_gpio as vg
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
