"""Attack: the guest floods the exporter's SLCAN reader (issue 19, item 7).

The guest owns the far end of a CAN bus socket and may write anything: 64 MiB without a CR (a
line that never ends), or a million frames that no test reads. The exporter's python-can bus must
keep its memory bounded, keep parsing in linear time, keep working, and say what it dropped.

The runtime's ``can/<bus>.sock`` relays the guest's bytes unchanged, so a Unix socket served by
the test stands in for it: the guest's own (TCG) serial port could not produce 64 MiB in a test's
time, and the bytes the bus sees are the same.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import can
import pytest

from fixtures.waiting import wait_until
from jumpstarter_driver_vmsidecar.slcan import VmsidecarSlcanBus

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20


class FakeGuest:
    """The guest's side of one CAN bus socket: accepts the bus and writes what the test gives it."""

    def __init__(self, path: Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.conn: socket.socket | None = None
        self.sent = 0
        self._accepted = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.conn, _ = self.listener.accept()
        self._accepted.set()

    def write(self, data: bytes, repeat: int = 1) -> threading.Thread:
        """Send ``data`` ``repeat`` times from a thread (the bus reads on its own thread)."""
        assert self._accepted.wait(10), "the bus never connected"

        def run() -> None:
            assert self.conn is not None
            try:
                for _ in range(repeat):
                    self.conn.sendall(data)
                    self.sent += len(data)
            except OSError:
                pass

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


@pytest.fixture
def guest_bus(tmp_path: Path) -> Iterator[tuple[FakeGuest, VmsidecarSlcanBus]]:
    guest = FakeGuest(tmp_path / "can0.sock")
    bus = VmsidecarSlcanBus(str(tmp_path / "can0.sock"))
    try:
        yield guest, bus
    finally:
        bus.shutdown()
        guest.close()


def test_64_mib_without_cr_is_dropped_in_linear_time_and_bounded_memory(
    guest_bus: tuple[FakeGuest, VmsidecarSlcanBus], caplog: pytest.LogCaptureFixture, record_property: object
) -> None:
    guest, bus = guest_bus
    tracemalloc.start()
    try:
        t0 = time.monotonic()
        writer = guest.write(b"a" * MIB, 64)
        writer.join(30)
        assert not writer.is_alive(), f"the bus stopped reading: {guest.sent // MIB} MiB of 64 taken in 30 s"
        guest.write(b"\rt1232BEEF\r").join(5)  # the CR ends the 64 MiB line; then a real frame
        msg = bus.recv(10)
        elapsed = time.monotonic() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert msg is not None and msg.arbitration_id == 0x123 and bytes(msg.data) == b"\xbe\xef", msg
    assert peak < 8 * MIB, f"the bus held {peak / MIB:.0f} MiB for one line without CR"
    assert bus.dropped_bytes >= 64 * MIB and bus.dropped_lines >= 1, (bus.dropped_bytes, bus.dropped_lines)
    assert any("overlong" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    print(f"64 MiB without CR: {elapsed:.1f} s, tracemalloc peak {peak / MIB:.1f} MiB")
    record_property("slcan_64mib_s", round(elapsed, 2))


def test_a_million_unread_frames_keep_the_newest_and_count_the_rest(
    guest_bus: tuple[FakeGuest, VmsidecarSlcanBus], caplog: pytest.LogCaptureFixture, record_property: object
) -> None:
    guest, bus = guest_bus
    frames = 1_000_000
    tracemalloc.start()
    try:
        t0 = time.monotonic()
        writer = guest.write(b"t1230\r" * 1000, frames // 1000)
        while writer.is_alive():
            writer.join(0.5)
            held = tracemalloc.get_traced_memory()[0]
            assert held < 64 * MIB, f"{held / MIB:.0f} MiB held after {guest.sent // 6} unread frames"
            assert time.monotonic() - t0 < 60, f"the bus took only {guest.sent // 6} of {frames} frames in 60 s"
        guest.write(b"t7FF1AA\r").join(5)
        wait_until(lambda: bus.dropped_frames + bus.backlog() >= frames + 1, 10, "the bus to take every frame")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    elapsed = time.monotonic() - t0
    assert bus.backlog() == bus.rx_limit and bus.dropped_frames == frames + 1 - bus.rx_limit
    assert peak < 64 * MIB, f"{peak / MIB:.0f} MiB for unread frames"
    # the oldest went first: draining the backlog ends with the newest frame
    last = None
    while (m := bus.recv(0)) is not None:
        last = m
    assert last is not None and last.arbitration_id == 0x7FF and bytes(last.data) == b"\xaa"
    assert any("dropped" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    # and the bus still works both ways
    bus.send(can.Message(arbitration_id=0x42, data=b"\x01", is_extended_id=False))
    print(f"1,000,000 unread frames: {elapsed:.1f} s, backlog {bus.rx_limit}, tracemalloc peak {peak / MIB:.1f} MiB")
    record_property("slcan_1m_frames_s", round(elapsed, 2))
