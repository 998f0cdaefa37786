"""Attack: the guest floods the exporter's SLCAN reader (issue 19, item 7).

The guest owns the far end of a CAN bus socket and may write anything: 64 MiB without a CR (a
line that never ends), or a million frames that no test reads. The exporter's python-can bus must
keep its memory bounded, keep parsing in linear time, keep working, and say what it dropped.

The runtime's ``can/<bus>.sock`` relays the guest's bytes unchanged, so a Unix socket served by
the test stands in for it: the guest's own (TCG) serial port could not produce 64 MiB in a test's
time, and the bytes the bus sees are the same.

The lease holder attacks the same bus through upstream's ``Can`` driver: ``recv``/``send`` with
timeouts that never end (None, NaN, infinity) or are no timeouts at all must not keep the exporter's
worker threads past the bus's shutdown at lease end; and the guest's frame lines must be SLCAN, not
whatever ``int(x, 16)`` reads (a sign, spaces, ``0x``, ids wider than CAN's).
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import can
import pytest

from fixtures.waiting import wait_until
from jumpstarter_driver_vmsidecar.slcan import VmsidecarSlcanBus, decode

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
        try:
            self.conn, _ = self.listener.accept()
        except OSError:  # closed by a test whose bus never connected (it connects at first use)
            return
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
    bus.reconnect()  # what the driver does at its tree's claim: connected from then on
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


# ---- the lease holder's calls (issue: endless recv/send) --------------------------------------
# The client reaches ``_recv_internal`` and ``send`` through upstream's ``Can`` driver: each call
# runs on a worker thread of the exporter (anyio's ``to_thread.run_sync``, 40 at most) with
# whatever timeout the client sent. A call that never ends keeps the exporter from exiting after
# the lease (ExitAndReplace) and takes a worker from the next lease (InPlaceReuse) for good.

#: a call must end this soon once the bus is shut down (the bus promises 0.5 s; the rest is a
#: loaded 2-core machine)
ENDS_WITHIN = 2.0
FRAME = can.Message(arbitration_id=0x123, data=b"\x01", is_extended_id=False)


class Call:
    """``fn(*args)`` on a thread of its own: what it returned or raised, and whether it ended."""

    def __init__(self, fn: Callable[..., object], *args: object) -> None:
        self.result: object = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[..., object], *args: object) -> None:
        try:
            self.result = fn(*args)
        except BaseException as e:
            self.error = e

    def ended(self, within: float) -> bool:
        self.thread.join(within)
        return not self.thread.is_alive()


@pytest.fixture
def lost_bus(tmp_path: Path) -> Iterator[VmsidecarSlcanBus]:
    """A bus whose socket nobody serves (the runtime is down): ``send`` keeps retrying."""
    bus = VmsidecarSlcanBus(str(tmp_path / "nobody.sock"))
    try:
        yield bus
    finally:
        bus.shutdown()


@pytest.mark.parametrize("recv", ["_recv_internal", "recv"])
def test_recv_without_timeout_ends_when_the_bus_shuts_down(
    guest_bus: tuple[FakeGuest, VmsidecarSlcanBus], recv: str
) -> None:
    # None is what upstream's CanClient.recv() sends when given no timeout: wait for a frame...
    _, bus = guest_bus
    call = Call(getattr(bus, recv), None)
    assert not call.ended(0.3), (call.result, call.error)
    t0 = time.monotonic()
    bus.shutdown()  # ...or for the bus to close (the driver's close at lease end)
    assert call.ended(ENDS_WITHIN), f"recv(None) still waits {ENDS_WITHIN} s after shutdown"
    assert time.monotonic() - t0 < ENDS_WITHIN
    assert call.result is None or isinstance(call.error, can.CanOperationError), (call.result, call.error)


def test_a_frame_still_ends_recv_without_timeout(guest_bus: tuple[FakeGuest, VmsidecarSlcanBus]) -> None:
    guest, bus = guest_bus
    call = Call(bus._recv_internal, None)
    guest.write(b"t4561AA\r").join(5)
    assert call.ended(10) and call.error is None, call.error
    msg, _ = call.result  # type: ignore[misc]
    assert msg.arbitration_id == 0x456 and bytes(msg.data) == b"\xaa"


def test_calls_on_a_shut_down_bus_fail_at_once(guest_bus: tuple[FakeGuest, VmsidecarSlcanBus]) -> None:
    _, bus = guest_bus
    bus.shutdown()
    for call in (Call(bus._recv_internal, None), Call(bus.recv, 30), Call(bus.send, FRAME, 30)):
        assert call.ended(ENDS_WITHIN), "a call on a shut-down bus waits"
        assert isinstance(call.error, can.CanOperationError) and "shut down" in str(call.error), call.error


def test_send_to_an_unreachable_socket_ends_when_the_bus_shuts_down(lost_bus: VmsidecarSlcanBus) -> None:
    call = Call(lost_bus.send, FRAME, 60)
    assert not call.ended(0.3), call.error  # retrying: the runtime may come back
    lost_bus.shutdown()
    assert call.ended(ENDS_WITHIN), f"send still retries {ENDS_WITHIN} s after shutdown"
    assert isinstance(call.error, can.CanOperationError), call.error


def test_send_to_a_guest_that_does_not_read_ends_when_the_bus_shuts_down(
    guest_bus: tuple[FakeGuest, VmsidecarSlcanBus],
) -> None:
    guest, bus = guest_bus
    guest.write(b"").join(5)  # (connected) the guest reads nothing: the socket buffer fills, then send blocks

    def flood() -> None:
        while True:
            bus.send(FRAME, 30)

    call = Call(flood)
    assert not call.ended(1), call.error
    bus.shutdown()
    assert call.ended(ENDS_WITHIN), "send still blocks after shutdown"
    assert isinstance(call.error, can.CanOperationError), call.error


#: what a lease holder can send (JSON, or a string that float() reads) that is no time to wait for
ENDLESS_OR_NOT_A_TIMEOUT = ["nan", "NaN", "inf", "Infinity", "-Infinity", math.nan, math.inf,
                            -1, -0.001, "-1", "soon", "", [], {}, [1], True, 10**400]


@pytest.mark.parametrize("timeout", ENDLESS_OR_NOT_A_TIMEOUT, ids=lambda v: repr(v)[:12])
def test_recv_refuses_a_timeout_that_is_not_a_finite_wait(
    guest_bus: tuple[FakeGuest, VmsidecarSlcanBus], timeout: object
) -> None:
    _, bus = guest_bus
    call = Call(bus._recv_internal, timeout)
    assert call.ended(ENDS_WITHIN), f"recv({timeout!r}) waits"
    assert isinstance(call.error, ValueError), (call.result, call.error)
    assert "timeout must be a number of seconds" in str(call.error), call.error


@pytest.mark.parametrize("timeout", ENDLESS_OR_NOT_A_TIMEOUT, ids=lambda v: repr(v)[:12])
def test_send_refuses_a_timeout_that_is_not_a_finite_wait(
    lost_bus: VmsidecarSlcanBus, timeout: object
) -> None:
    call = Call(lost_bus.send, FRAME, timeout)
    assert call.ended(ENDS_WITHIN), f"send({timeout!r}) keeps retrying"
    assert isinstance(call.error, ValueError), call.error
    assert "timeout must be a number of seconds" in str(call.error), call.error


def test_a_lease_holders_timeouts_through_the_can_driver(tmp_path: Path) -> None:
    """Through upstream's ``Can`` driver and its gRPC DriverCall, as the lease holder calls it."""
    from jumpstarter.client.core import DriverInvalidArgument
    from jumpstarter.common.utils import serve
    from jumpstarter_driver_can.common import CanMessage
    from jumpstarter_driver_can.driver import Can

    guest = FakeGuest(tmp_path / "can0.sock")
    driver = Can(channel=str(tmp_path / "can0.sock"), interface="vmsidecar-slcan")
    try:
        with serve(driver) as client:
            frame = CanMessage.construct(FRAME).model_dump(mode="json")
            for timeout in ("nan", "Infinity", -1):  # (pydantic reads the strings as floats)
                for call in (Call(client.call, "_recv_internal", timeout),
                             Call(client.call, "send", frame, timeout)):
                    assert call.ended(ENDS_WITHIN), f"a DriverCall with timeout {timeout!r} waits"
                    assert isinstance(call.error, DriverInvalidArgument), call.error
                    assert "timeout must be" in str(call.error), call.error
            assert client.call("_recv_internal", 0) == [None, False]  # the bus still serves
    finally:
        driver.bus.shutdown()
        guest.close()


def test_endless_recv_calls_through_the_can_driver_end_at_lease_end(tmp_path: Path) -> None:
    """40 ``recv(None)`` DriverCalls take every worker thread of the exporter's event loop; the
    bus's shutdown (the vmsidecar driver's close at lease end) must end them all."""
    from jumpstarter.common.utils import serve
    from jumpstarter_driver_can.driver import Can

    guest = FakeGuest(tmp_path / "can0.sock")
    driver = Can(channel=str(tmp_path / "can0.sock"), interface="vmsidecar-slcan")
    try:
        with serve(driver) as client:
            calls = [Call(client.call, "_recv_internal", None) for _ in range(40)]
            time.sleep(0.5)  # (the absence of an answer: every call waits for a frame)
            assert not any(c.ended(0) for c in calls)
            t0 = time.monotonic()
            driver.bus.shutdown()
            deadline = t0 + 10
            assert all(c.ended(max(0.0, deadline - time.monotonic())) for c in calls), (
                f"{sum(c.thread.is_alive() for c in calls)} of 40 recv(None) calls outlive the bus by 10 s"
            )
            print(f"40 recv(None) DriverCalls ended {time.monotonic() - t0:.2f} s after shutdown")
            # the worker threads are free again: a synchronous call answers
            info = Call(client.call, "channel_info")
            assert info.ended(10) and info.error is None, info.error
    finally:
        driver.bus.shutdown()
        guest.close()


# ---- what the guest writes: only well-formed frames are frames --------------------------------
@pytest.mark.parametrize("line", [
    b"t-7F0",       # int(…, 16) took a sign: id -127
    b"t0x10",       # …a 0x prefix: id 1
    b"t 1F0",       # …whitespace: id 31
    b"t1_20",       # …an underscore: id 0x12
    b"t+120",
    b"TFFFFFFFF0",  # 32 bits; an extended id has 29
    b"T200000000",
    b"t8000",       # 12 bits; a standard id has 11
    b"t12390000000000000000",  # 9 bytes
    b"t123A",
    b"t123-1AA",
    b"t123 1AA",
    b"t1231 A",
    b"t1231+A",
    b"t1232AAB",
    b"t1231AAjunk",  # after the data only a 4-digit timestamp may follow
    b"t1231AA12",
    b"r1231AA",
    b"t12",
    b"T1234567",
    b"T0ABCDEF18",  # a data frame of 8 bytes without them
    b"t\xff\xfe\xfd0",
])
def test_malformed_frame_lines_are_refused(line: bytes) -> None:
    assert decode(line) is None, decode(line)


@pytest.mark.parametrize(("line", "ident", "extended", "data"), [
    (b"t7FF0", 0x7FF, False, b""),
    (b"T1FFFFFFF0", 0x1FFFFFFF, True, b""),
    (b"t0002beef", 0x000, False, b"\xbe\xef"),  # lower-case hex is still hex
    (b"t1231AA1A2B", 0x123, False, b"\xaa"),  # with slcan's 4-digit timestamp
    (b"R0ABCDEF18", 0x0ABCDEF1, True, b""),  # a remote frame: a DLC, no data
])
def test_well_formed_frame_lines_decode(line: bytes, ident: int, extended: bool, data: bytes) -> None:
    msg = decode(line)
    assert msg is not None, line
    assert (msg.arbitration_id, msg.is_extended_id, bytes(msg.data)) == (ident, extended, data)


def test_malformed_frames_from_the_guest_are_dropped(guest_bus: tuple[FakeGuest, VmsidecarSlcanBus]) -> None:
    guest, bus = guest_bus
    guest.write(b"t-7F0\rt0x10\rt 1F0\rTFFFFFFFF0\rt1_20\rt1232BEEF\r").join(5)
    msg = bus.recv(10)
    assert msg is not None and (msg.arbitration_id, bytes(msg.data)) == (0x123, b"\xbe\xef"), msg
    assert bus.recv(0.2) is None


def test_send_to_a_guest_that_does_not_read_keeps_its_timeout(
    guest_bus: tuple[FakeGuest, VmsidecarSlcanBus],
) -> None:
    """``send(msg, 0.5)`` while the guest reads nothing: once the socket's buffer is full, sendall
    had blocked past the timeout for as long as the guest did not read (to the lease's end)."""
    guest, bus = guest_bus
    guest.write(b"").join(5)  # (connected) the guest reads nothing

    def flood() -> None:
        while True:
            bus.send(FRAME, 0.5)

    call = Call(flood)
    assert call.ended(10), "send blocked past its timeout"
    assert isinstance(call.error, can.CanTimeoutError), call.error
    assert "not reading" in str(call.error), call.error


def test_send_with_timeout_zero_sends_when_there_is_room(
    guest_bus: tuple[FakeGuest, VmsidecarSlcanBus],
) -> None:
    """python-can's ``timeout=0``: try once without blocking (the deadline check had come first)."""
    _, bus = guest_bus
    bus.send(FRAME, 0)
