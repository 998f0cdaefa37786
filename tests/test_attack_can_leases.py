"""Attack: a CAN bus carries nothing of one lease into the next (docs/security.md).

jumpstarter 0.9.0 builds a lease's driver tree before its ``reset()`` claims the VM, and a claim or
a recycle swaps the guest behind the same ``can/<bus>.sock``. Four ways lease N reached lease N+1:

- lease N+1's bus, connected when its tree was built, queued what lease N's guest sent until the
  claim and handed it out at its first ``recv``;
- lease N's tree recycled before it shut its buses down: a periodic send of lease N reconnected
  and sent into the restored guest of lease N+1;
- a tree whose runtime was not up at ``reset()`` kept retrying the claim after its ``close()``: a
  late claim would recycle the next lease's guest under it.
- a periodic send with a period of hours (the exported ``Can._send_periodic_internal`` takes any
  period, and any number of sends) kept its thread and bus for that long after the lease ended, so
  the exporter's threads piled up lease after lease.

And (item 5) the lease holder's arguments to the exported ``Can`` calls, which the tree's ``VmCan``
checks for both kinds of bus: periodic sends made unstarted and without a bound on their frames
grew the exporter without end, and python-can's socketcan bus (``mode: native``) took any timeout,
period and channel, and a ``recv`` waiting in its ``select`` outlived the lease.

Real guests under QEMU (the tiny image: ``cansend``, ``candump``, slcand on a virtio console); the
one fake socket stands in for the runtime where what is tested is the bus's own bookkeeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import can
import pytest

from fixtures.runtime import RuntimeProcess
from fixtures.vmdev import vm_runtime
from fixtures.waiting import wait_until
from jumpstarter_driver_vmsidecar.arguments import MAX_PERIODIC_FRAMES, MAX_PERIODIC_SENDS
from jumpstarter_driver_vmsidecar.can import VmCan, forget_queued_frames
from jumpstarter_driver_vmsidecar.driver import VirtualMachine
from jumpstarter_driver_vmsidecar.slcan import VmsidecarSlcanBus
from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.process import clean_environ
from vmsidecar_images.console import Console

# one xdist worker runs the module: its tests share one runtime and its generations
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("can-leases")]

OLD_ID, NEW_ID, PERIODIC_ID = 0x7AA, 0x7BB, 0x5AA


def _spec(image: Any) -> dict[str, Any]:
    return {"image": f"file:{image.disk}", "memory": "256M", "can": [{"name": "can0", "bitrate": 250000}]}


@pytest.fixture(scope="module")
def can_rt(tiny_image: Any, image_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with vm_runtime(_spec(tiny_image), tmp_path_factory.mktemp("can-leases-rt"), image_cache) as rt:
        yield rt


def _tree(rt: Any, image: Any) -> VirtualMachine:
    return VirtualMachine(socket=str(rt.socket), spec=_spec(image), recycle="InPlaceReuse")


async def _in_guest(rt: Any, command: str, timeout: float = 60) -> str:
    """Run ``command`` on the current guest's serial console once it is Ready."""
    async with RuntimeClient(rt.socket) as client:
        await client.wait_ready(180)
    con = await Console.open(rt.shared / "console.sock")
    try:
        await con.wake()
        return await con.run(command, timeout=timeout)
    finally:
        await con.close()


def _guest(rt: Any, command: str, timeout: float = 60) -> str:
    return asyncio.run(_in_guest(rt, command, timeout))


def _ids_for(bus: can.BusABC, seconds: float) -> list[int]:
    """Every frame id ``bus`` hands out within ``seconds``."""
    ids = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if (msg := bus.recv(min(left, 0.2))) is not None:
            ids.append(msg.arbitration_id)
    return ids


def _claim_as_lease_n(rt: Any) -> None:
    async def claim() -> None:
        async with RuntimeClient(rt.socket) as client:
            await client.claim()

    asyncio.run(claim())


# ---- item 1: what the previous guest sent never comes out of the next lease's bus -------------
def test_frames_of_lease_n_never_come_out_of_lease_n_plus_1_bus(can_rt: Any, tiny_image: Any) -> None:
    """Lease N's guest keeps sending 0x7AA; lease N+1's tree is built (as 0.9.0 does, before its
    claim) and then claims, which recycles lease N's guest: its bus must hand out nothing of lease
    N, and still what lease N+1's guest sends (0x7BB)."""
    _claim_as_lease_n(can_rt)
    loop = f"while true; do cansend can0 {OLD_ID:03X}#4C4541534520; sleep 0.05; done"
    _guest(can_rt, f"({loop}) >/dev/null 2>&1 & true")
    tree = _tree(can_rt, tiny_image)
    try:
        time.sleep(1)  # lease N's guest sends ~20 frames between the tree's construction and its claim
        tree.reset()
        bus = tree.children["can"].bus
        queued = bus.backlog()
        assert queued == 0, f"{queued} frames of lease N were queued on lease N+1's bus at its claim"
        ids = _ids_for(bus, 2)
        assert OLD_ID not in ids, f"lease N's frames came out of lease N+1's bus: {[hex(i) for i in ids]}"
        _guest(can_rt, f"cansend can0 {NEW_ID:03X}#4E4557")
        assert NEW_ID in _ids_for(bus, 10), "lease N+1's own guest's frame never arrived"
    finally:
        tree.close()


def test_a_dropped_connection_takes_its_unread_frames_with_it(tmp_path: Path) -> None:
    """The runtime drops a bus's socket (a claim or a recycle) while frames wait unread: the bus
    does not connect again by itself (the next lease's guest may be behind the socket), and once its
    tree claims (``reconnect``) it hands out only what arrived on the new connection."""
    path = tmp_path / "can0.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(2)
    bus = VmsidecarSlcanBus(str(path))
    try:
        assert bus._sock is None, "the bus connected when it was built (before its tree's claim)"
        assert bus.recv(0) is None  # first use: connects
        old, _ = listener.accept()
        old.sendall(b"t7AA1AA\rt7AA1BB\rt7A")  # two frames and an unfinished line of lease N
        wait_until(lambda: bus.backlog() == 2, 10, "the bus to queue lease N's frames")
        old.close()  # the runtime's claim disconnects every client
        wait_until(lambda: bus._sock is None, 10, "the bus to see its socket end")
        accepted: list[socket.socket] = []
        threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
        with pytest.raises(can.CanOperationError, match="next claim"):
            bus.recv(0.5)  # (before: it reconnected by itself, to whichever guest is there now)
        with pytest.raises(can.CanOperationError, match="next claim"):
            bus.send(can.Message(arbitration_id=OLD_ID, data=b"x", is_extended_id=False), timeout=0.5)
        assert not accepted, "the bus connected again by itself after the runtime ended its connection"
        bus.reconnect()  # its tree's claim
        assert bus.recv(0.5) is None, "a frame received before the drop came out after it"
        wait_until(lambda: accepted, 10, "the bus to reconnect")
        accepted[0].sendall(b"BB1CC\rt7BB1DD\r")  # would end lease N's "t7A" line as a frame 0x7AB
        msg = bus.recv(5)
        assert msg is not None and msg.arbitration_id == NEW_ID, f"not the new guest's frame: {msg}"
        accepted[0].close()
    finally:
        bus.shutdown()
        listener.close()


# ---- item 2: an ended lease's tree sends nothing to the next guest ------------------------------
def test_a_periodic_send_of_lease_n_never_reaches_the_guest_of_lease_n_plus_1(
    can_rt: Any, tiny_image: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lease N starts a periodic send (upstream ``Can._send_periodic_internal``: a thread with no
    duration) and ends; its ``close()`` recycles. The next guest must receive nothing of it, and
    the ended tree's bus must refuse to send."""
    from jumpstarter_driver_can.common import CanMessage

    rx = "cat /sys/class/net/can0/statistics/rx_packets"
    a = _tree(can_rt, tiny_image)
    a.reset()  # lease N claims (a fresh generation, or a recycle of the one before)
    link_close = a.link.close

    def descheduled_close() -> None:
        # a loaded exporter: the thread ending the lease loses the CPU for a second after the
        # recycle, which only widens the window the old order left between recycle and shutdown
        time.sleep(1)
        link_close()

    monkeypatch.setattr(a.link, "close", descheduled_close)
    pristine = _guest(can_rt, rx).strip()
    frame = can.Message(arbitration_id=PERIODIC_ID, data=b"LEASE-N", is_extended_id=False)
    a.children["can"]._send_periodic_internal([CanMessage.construct(frame)], 0.01)  # as CanClient calls it
    time.sleep(0.5)
    assert int(_guest(can_rt, rx)) > int(pristine), "lease N's periodic send never reached its own guest"
    a.close()
    b = _tree(can_rt, tiny_image)
    try:
        b.reset()  # lease N+1 claims the recycled generation
        listen = f"timeout 2 candump -L can0,{PERIODIC_ID:03X}:7FF; {rx}"
        out = _guest(can_rt, listen)
        assert f"{PERIODIC_ID:03X}#" not in out and out.strip().splitlines()[-1] == pristine, (
            f"lease N's periodic frames reached lease N+1's guest (pristine rx_packets {pristine}):\n{out}")
        with pytest.raises(can.CanOperationError, match="shut down"):
            a.children["can"].bus.send(frame, timeout=1)
    finally:
        b.close()


def test_the_next_lease_claiming_before_the_last_tree_closes_gets_nothing_of_it(
    can_rt: Any, tiny_image: Any
) -> None:
    """0.9.0 may hand out lease N+1 (its tree claims) before lease N's tree is closed: lease N's
    periodic send, whose connection N+1's claim ended, must not connect again to N+1's guest."""
    from jumpstarter_driver_can.common import CanMessage

    rx = "cat /sys/class/net/can0/statistics/rx_packets"
    a = _tree(can_rt, tiny_image)
    a.reset()
    frame = can.Message(arbitration_id=PERIODIC_ID, data=b"LEASE-N", is_extended_id=False)
    a.children["can"]._send_periodic_internal([CanMessage.construct(frame)], 0.01)
    b = _tree(can_rt, tiny_image)
    try:
        b.reset()  # lease N+1 claims: lease N's generation is recycled under its still open tree
        pristine = _guest(can_rt, rx).strip()
        time.sleep(1)  # lease N's periodic send goes on trying
        listen = f"timeout 2 candump -L can0,{PERIODIC_ID:03X}:7FF; {rx}"
        out = _guest(can_rt, listen)
        assert f"{PERIODIC_ID:03X}#" not in out and out.strip().splitlines()[-1] == pristine, (
            f"lease N's periodic frames reached lease N+1's guest (rx_packets at its Ready {pristine}):"
            f"\n{out}")
    finally:
        a.close()
        b.close()


# ---- item 3: a closed tree's claim retry stops ---------------------------------------------------
def test_the_claim_retry_of_a_closed_tree_never_claims(
    tiny_image: Any, image_cache: Path, tmp_path: Path
) -> None:
    """The runtime is not up at ``reset()``: the tree retries the claim in a thread. After its
    ``close()`` (the lease ended) that thread must stop: a claim coming later would recycle the
    next lease's guest."""
    root = tmp_path / "late-rt"
    spec = _spec(tiny_image)
    tree = VirtualMachine(socket=str(root / "shared" / "api.sock"), spec=spec, recycle="InPlaceReuse")
    before = set(threading.enumerate())
    tree.reset()
    retry = [t for t in threading.enumerate() if t not in before and t.name == "vmsidecar-spec"]
    assert retry, "no claim retry started for a runtime that is not up"
    tree.close()
    rt = RuntimeProcess.start(root, spec=spec, cache=image_cache, args=["--grace", "20"], env=clean_environ())
    try:
        asyncio.run(rt.wait_serving())
        time.sleep(3)  # absence of a claim: the retry looks every 0.5 s

        async def claimed() -> bool:
            async with RuntimeClient(rt.socket) as client:
                return (await client.state()).claimed

        assert not asyncio.run(claimed()), "the closed tree's retry thread claimed the VM after close()"
        wait_until(lambda: not retry[0].is_alive(), 5, "the closed tree's retry thread to end")
    finally:
        rt.stop()


def test_the_spec_retry_of_the_start_up_tree_outlives_its_close(
    tiny_image: Any, image_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The counterpart: 0.9.0 closes its start-up tree right after registering, often before the
    pod's runtime serves. That tree's retry hands over the spec (what boots the pod's guest) and
    claims nothing: it must go on after ``close()``, or the pod is never Ready (a CI run's pod
    waited 300 s when the claim's stop also stopped it)."""
    import jumpstarter_driver_vmsidecar.driver as driver_module

    monkeypatch.setattr(driver_module, "serves_a_lease", lambda: False)  # the tree Exporter.session builds
    root = tmp_path / "late-rt"
    spec = _spec(tiny_image)
    tree = VirtualMachine(socket=str(root / "shared" / "api.sock"), spec=spec, recycle="InPlaceReuse")
    tree.reset()
    tree.close()
    rt = RuntimeProcess.start(root, cache=image_cache, env=clean_environ(),
                              args=["--grace", "20", "--allow-host-paths", str(Path(tiny_image.disk).parent)])
    try:
        asyncio.run(rt.wait_serving())

        async def spec_arrived() -> bool:
            async with RuntimeClient(rt.socket) as client:
                return (await client.get_spec()) is not None and not (await client.state()).claimed

        wait_until(lambda: asyncio.run(spec_arrived()), 20, "the start-up tree's spec to reach the runtime")
    finally:
        rt.stop()


# ---- item 4: a lease's periodic sends end with it, and are bounded -------------------------------
def _drop_listener(path: Path) -> socket.socket:
    """A CAN bus socket at ``path`` that takes every connection and reads and drops what comes."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                threading.Thread(target=lambda c=conn: all(iter(lambda: c.recv(65536), b"")),
                                 daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener


@pytest.fixture()
def slcan_can(tmp_path: Path) -> Iterator[Any]:
    """The tree's CAN driver on our bus, the socket served by a listener that reads and drops
    (the runtime's side does not matter here: what is tested is the exporter's threads)."""
    listener = _drop_listener(tmp_path / "can0.sock")
    driver = VmCan(channel=f"{tmp_path / 'can0.sock'};bitrate=500000", interface="vmsidecar-slcan")
    try:
        yield driver
    finally:
        driver.shut_bus_down()
        listener.close()


@pytest.fixture()
def slcan_bus(tmp_path: Path) -> Iterator[VmsidecarSlcanBus]:
    """Our python-can bus alone (a python-can interface of its own: its checks stand without the driver)."""
    listener = _drop_listener(tmp_path / "can0.sock")
    bus = VmsidecarSlcanBus(f"{tmp_path / 'can0.sock'};bitrate=500000")
    try:
        yield bus
    finally:
        bus.shutdown()
        listener.close()


def _frame() -> Any:
    from jumpstarter_driver_can.common import CanMessage

    return CanMessage.construct(can.Message(arbitration_id=PERIODIC_ID, data=b"\x01", is_extended_id=False))


def test_a_periodic_send_of_a_long_period_ends_its_thread_with_the_lease(slcan_can: Any) -> None:
    """A lease holder starts periodic sends with a period of an hour (the exported
    ``Can._send_periodic_internal`` takes any) and ends the lease: the tree's bus shutdown must end
    their threads then, not when their sleep of an hour ends (before: python-can's thread slept out
    the whole period after its stop, holding its bus, and lease after lease they piled up)."""
    slcan_can._send_periodic_internal([_frame()], 3600.0)
    slcan_can._send_periodic_internal([_frame()], 3600.0, 7200.0)
    threads = [t for t in threading.enumerate() if t.name.startswith("Cyclic send task")]
    assert len(threads) >= 2, "the periodic sends started no thread"
    slcan_can.shut_bus_down()  # what VirtualMachine._shut_can_down does at the lease's end
    deadline = time.monotonic() + 5
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"{len(alive)} periodic send threads outlived the bus's shutdown by 5 s"


@pytest.mark.parametrize("period", [float("nan"), float("inf"), -1.0, 0.0, 1e-6, 1e9])
def test_a_periodic_send_period_outside_a_millisecond_to_a_day_is_refused(slcan_can: Any, period: float) -> None:
    """python-can takes any float: NaN and inf failed inside it with its own words, a negative or
    zero period sent as fast as the bus goes, a period of years held a thread for years."""
    with pytest.raises(ValueError, match=r"period must be a number of seconds from 0\.001 to 86400"):
        slcan_can._send_periodic_internal([_frame()], period)
    with pytest.raises(ValueError, match="duration must be a number of seconds"):
        slcan_can._send_periodic_internal([_frame()], 1.0, float("nan"))


def test_periodic_sends_are_bounded_per_bus(slcan_can: Any) -> None:
    """Each periodic send is a thread of the exporter: a lease holder may not start them without
    bound (the exporter's threads are every lease's). The cap counts every send kept, started or not."""
    held = slcan_can._send_periodic_internal([_frame()], 60.0, None, False)  # made, not started
    tasks = [slcan_can._send_periodic_internal([_frame()], 60.0) for _ in range(MAX_PERIODIC_SENDS - 1)]
    with pytest.raises(ValueError, match=f"{MAX_PERIODIC_SENDS} periodic sends are already kept on"):
        slcan_can._send_periodic_internal([_frame()], 60.0)
    slcan_can._start_task(held)  # counted since it was made: starting it takes no more room
    slcan_can._stop_task(tasks[0])
    slcan_can._send_periodic_internal([_frame()], 60.0)  # one stopped: room for one


def test_a_native_bus_forgets_what_its_socket_queued_before_the_claim() -> None:
    """A native bus's tree opens the host's interface while the last lease's guest still runs, so
    its raw socket queues that guest's frames until the claim recycles it. This kernel has no
    SocketCAN (the native path is otherwise tested only as refused): a datagram socket pair stands
    in for the bus's raw socket, with frames of a CAN FD frame's size."""
    host, raw = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with host, raw:
        bus = type("NativeBus", (), {"socket": raw})()
        for n in range(50):  # lease N's guest, before the claim
            host.send(bytes([n]) * 72)
        forget_queued_frames(bus)
        with pytest.raises(BlockingIOError):
            raw.recv(72, socket.MSG_DONTWAIT)
        host.send(b"\xab" * 72)  # the lease's own guest, after it
        assert raw.recv(72, socket.MSG_DONTWAIT) == b"\xab" * 72
    forget_queued_frames(bus)  # a bus shut down since (its socket closed) stays quiet


# ---- item 5: a lease holder's arguments, checked by the tree's driver for both kinds of bus -------
class _Call:
    """An exported call run on a thread of its own (as the exporter's worker threads run them)."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.error: Exception | None = None
        self.result: Any = None
        self.thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self.thread.start()

    def _run(self, fn: Any, *args: Any) -> None:
        try:
            self.result = fn(*args)
        except Exception as e:  # (what the exporter answers the client with)
            self.error = e

    def ended(self, within: float) -> bool:
        self.thread.join(within)
        return not self.thread.is_alive()


_standins = iter(range(1_000_000))


def _native_standin() -> VmCan:
    """The tree's driver on python-can's ``virtual`` bus, standing in for its socketcan bus (``mode:
    native``), which needs SocketCAN in the kernel (this one has none). What matters is the same:
    it checks none of its arguments, and a ``recv`` waiting in it is not woken by its shutdown."""
    return VmCan(channel=f"native-standin-{next(_standins)}", interface="virtual")


@pytest.fixture(params=["slcan", "native-standin"])
def any_can(request: pytest.FixtureRequest, can_rt: Any, tiny_image: Any) -> Iterator[Any]:
    """The CAN driver of a tree built against the real runtime (not claimed: the bus connects at its
    first use), or the same driver on the stand-in for a native bus."""
    tree = _tree(can_rt, tiny_image)
    if request.param == "native-standin":
        tree.children["can"] = standin = _native_standin()
        tree._can_children[:] = [standin]
    try:
        yield tree.children["can"]
    finally:
        tree.close()


def _tasks_of(driver: Any) -> dict[Any, Any]:
    """The periodic sends the driver keeps for its lease, by the id its client holds."""
    kept = getattr(driver, "_kept", None)
    return kept.tasks if kept is not None else driver._Can__tasks


def test_periodic_sends_made_unstarted_count_against_the_cap(any_can: Any) -> None:
    """Upstream's ``Can`` keeps every task its ``_send_periodic_internal`` made, with its frames,
    until its ``_stop_task``; ``autostart=False`` makes one that never runs. Before, such tasks
    were not counted (python-can's ``stopped`` is True until a start) and a call with 15,000 frames
    grew the exporter by ~20 MiB, as often as the lease holder liked."""
    made = [any_can._send_periodic_internal([_frame()], 60.0, None, False) for _ in range(MAX_PERIODIC_SENDS)]
    for autostart in (False, True):
        with pytest.raises(ValueError, match=f"{MAX_PERIODIC_SENDS} periodic sends are already kept on"):
            any_can._send_periodic_internal([_frame()], 60.0, None, autostart)
    any_can._stop_task(made[0])
    any_can._send_periodic_internal([_frame()], 60.0, None, False)  # one stopped: room for one
    assert len(_tasks_of(any_can)) == MAX_PERIODIC_SENDS


def test_a_periodic_send_cycles_through_a_bounded_number_of_frames(any_can: Any) -> None:
    """One task's frames are kept as long as the task: at most ``MAX_PERIODIC_FRAMES`` of them."""
    with pytest.raises(ValueError, match=f"at most {MAX_PERIODIC_FRAMES} frames, not {MAX_PERIODIC_FRAMES + 1}"):
        any_can._send_periodic_internal([_frame()] * (MAX_PERIODIC_FRAMES + 1), 60.0, None, False)
    assert not _tasks_of(any_can)
    any_can._send_periodic_internal([_frame()] * MAX_PERIODIC_FRAMES, 60.0, None, False)


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1.0, 1e9, "nan", "-inf"])
def test_recv_and_send_timeouts_outside_a_day_are_refused(any_can: Any, timeout: Any) -> None:
    """python-can's socketcan bus hands a timeout to ``select`` as it comes: NaN and a negative
    failed inside it, infinity and 1e9 s waited for ever (and outlived the lease)."""
    for call in (_Call(any_can._recv_internal, timeout), _Call(any_can.send, _frame(), timeout)):
        assert call.ended(5), f"a call with timeout {timeout!r} was still waiting after 5 s"
        assert isinstance(call.error, ValueError), f"timeout {timeout!r}: {call.error!r}"
        assert "timeout must be a number of seconds from 0 to 86400" in str(call.error)


@pytest.mark.parametrize("period", [float("nan"), float("inf"), -1.0, 0.0, 1e-6, 1e9])
def test_periods_and_durations_outside_their_range_are_refused(any_can: Any, period: float) -> None:
    """The socketcan bus hands a period to the kernel's broadcast manager: microseconds flood the
    bus, and NaN or a negative went in as they were."""
    with pytest.raises(ValueError, match=r"period must be a number of seconds from 0\.001 to 86400"):
        any_can._send_periodic_internal([_frame()], period, None, False)
    for duration in (float("nan"), -1.0, 1e9):
        with pytest.raises(ValueError, match="duration must be a number of seconds"):
            any_can._send_periodic_internal([_frame()], 1.0, duration, False)
    assert not _tasks_of(any_can)


def test_a_frame_naming_another_channel_is_sent_on_the_bus_own(any_can: Any) -> None:
    """python-can's socketcan bus opens its broadcast-manager socket on the channel of a periodic
    send's first frame (``msgs[0].channel or self.channel``), one per channel named: a lease holder
    sent on any CAN interface of the host. That socket needs SocketCAN, so what is read here is the
    frames the bus is given: every one is on the driver's own channel, whatever it named."""
    from jumpstarter_driver_can.common import CanMessage

    foreign = CanMessage.construct(can.Message(arbitration_id=PERIODIC_ID, data=b"\x02", is_extended_id=False,
                                               channel="vcan-of-another-lease"))
    uuid = any_can._send_periodic_internal([foreign, foreign], 60.0, None, False)
    channels = {msg.channel for msg in _tasks_of(any_can)[uuid].messages}
    assert channels == {any_can.channel}, f"the periodic send's frames name {channels}"


def test_a_frame_that_is_not_a_can_frame_is_refused(any_can: Any) -> None:
    """A lease holder's frame is checked by python-can (``check=True``): 1 MiB of data in a classic
    frame, an id past 29 bits, a NaN timestamp are a ``ValueError``, not bytes the bus packs."""
    from jumpstarter_driver_can.common import CanMessage

    ok = can.Message(arbitration_id=PERIODIC_ID, data=b"\x01", is_extended_id=False)
    for bad, why in ((dict(data=b"x" * (1 << 20)), "DLC"), (dict(arbitration_id=1 << 40), "arbitration ID"),
                     (dict(timestamp=float("nan")), "timestamp")):
        msg = CanMessage.construct(ok).model_copy(update=bad)
        with pytest.raises(ValueError, match=why):
            any_can._send_periodic_internal([msg], 60.0, None, False)
        with pytest.raises(ValueError, match=why):
            any_can.send(msg, 1)
    # a data frame whose dlc says more than its data is sent with its data, as upstream's Can did
    # (python-can's socketcan bus sends the data); check=True alone had refused it
    any_can.send(CanMessage.construct(ok).model_copy(update={"dlc": 8}), 1)


@pytest.mark.parametrize("kind", ["slcan", "native-standin"])
def test_recv_without_timeout_ends_promptly_when_the_tree_shuts_down(
    can_rt: Any, tiny_image: Any, kind: str
) -> None:
    """``recv(None)`` (CanClient's default) waits until a frame or the end of the lease. On the
    socketcan bus it waited in ``select``, which the close of its socket does not wake (the stand-in
    waits in a queue no shutdown wakes either): 40 of them held every worker thread of the exporter,
    whose event loop serves every lease, and hung every later driver call."""
    tree = _tree(can_rt, tiny_image)
    if kind == "native-standin":
        tree.children["can"] = driver = _native_standin()
        tree._can_children[:] = [driver]
    else:
        driver = tree.children["can"]
    calls = [_Call(driver._recv_internal, None) for _ in range(8)]
    time.sleep(0.5)
    assert not any(call.ended(0) for call in calls), "a recv(None) returned with no frame sent"
    began = time.monotonic()
    tree.close()  # the lease ends
    for call in calls:
        assert call.ended(max(0.0, began + 2 - time.monotonic())), "recv(None) outlived the tree's shutdown by 2 s"
        assert isinstance(call.error, can.CanOperationError) and "shut down" in str(call.error), call.error
    with pytest.raises(can.CanOperationError, match="shut down"):
        driver._recv_internal(0)


def test_a_native_send_waiting_for_room_ends_when_the_tree_shuts_down(tmp_path: Path) -> None:
    """python-can's socketcan ``send(msg, timeout)`` waits in ``select`` for room in the
    interface's queue (then "Transmit buffer full"), which the bus's shutdown does not wake: a full
    queue and a timeout of a day held a worker thread for a day. A full SocketCAN queue cannot be
    made on this kernel: the stand-in bus waits out its timeout and answers as socketcan does."""
    from can.interfaces.virtual import VirtualBus

    class FullQueue(VirtualBus):
        def send(self, msg: can.Message, timeout: float | None = None) -> None:
            time.sleep(timeout or 0)
            raise can.CanOperationError("Transmit buffer full")

    tree = VirtualMachine(socket=str(tmp_path / "api.sock"), spec={"can": [{"name": "can0"}]})
    tree.children["can"] = driver = _native_standin()
    tree._can_children[:] = [driver]
    driver.bus.shutdown()
    driver.bus = FullQueue(channel=driver.channel)
    with pytest.raises(can.CanOperationError, match="Transmit buffer full"):
        driver.send(_frame(), 0.6)  # the timeout kept, across slices
    call = _Call(driver.send, _frame(), 86400)
    assert not call.ended(1)
    tree.close()
    assert call.ended(2), "a send waiting for room outlived the tree's shutdown by 2 s"
    assert isinstance(call.error, can.CanOperationError) and "shut down" in str(call.error), call.error


def test_our_bus_alone_counts_unstarted_periodic_sends_and_bounds_their_frames(slcan_bus: VmsidecarSlcanBus) -> None:
    """The python-can interface on its own (a test's ``can.Bus(interface="vmsidecar-slcan")``) keeps
    the same bounds: a task made unstarted counts until its ``stop``."""
    msg = can.Message(arbitration_id=PERIODIC_ID, data=b"\x01", is_extended_id=False)
    tasks = [slcan_bus.send_periodic(msg, 60.0, autostart=False) for _ in range(MAX_PERIODIC_SENDS)]
    with pytest.raises(ValueError, match=f"{MAX_PERIODIC_SENDS} periodic sends are already kept on"):
        slcan_bus.send_periodic(msg, 60.0, autostart=False)
    tasks[0].stop()
    tasks[1].start()  # counted already: starting takes no more room
    slcan_bus.send_periodic(msg, 60.0, autostart=False)
    tasks[1].stop()
    with pytest.raises(ValueError, match=f"at most {MAX_PERIODIC_FRAMES} frames"):
        slcan_bus.send_periodic([msg] * (MAX_PERIODIC_FRAMES + 1), 60.0, autostart=False)
