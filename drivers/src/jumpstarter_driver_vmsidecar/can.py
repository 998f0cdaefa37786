"""``VmCan``: upstream's ``jumpstarter_driver_can.driver.Can`` with every argument of its exported
calls checked where it arrives, for both kinds of bus a spec has: ours (``vmsidecar-slcan``) and
python-can's socketcan bus (``mode: native``), which checks nothing.

A lease holder calls the exports with any values, and whatever they leave behind must end with the
lease: the exporter runs every lease's calls on one pool of worker threads (anyio's, 40), and keeps
what a lease made until its tree goes. So: a timeout is 0 to a day or None; a ``recv`` waits in
slices and ends once the tree shut the bus down (the socketcan bus waits in ``select``, which the
close of its socket does not wake: 40 ``recv(None)`` had held every worker thread for good); a
periodic send has a period of 1 ms to a day, at most ``MAX_PERIODIC_FRAMES`` frames, and at most
``MAX_PERIODIC_SENDS`` are kept per bus, started or not; every frame is a valid one of this bus's
own channel (python-can's socketcan bus opens its broadcast-manager socket on the channel of the
first frame of a periodic send, and one per channel named).

The exported names and signatures are upstream's (its validation included), so the stock
``CanClient`` talks to it unchanged.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import field
from typing import Any
from uuid import UUID, uuid4

import can
from jumpstarter.driver import export
from jumpstarter_driver_can.common import CanMessage
from jumpstarter_driver_can.driver import Can
from pydantic import ConfigDict, validate_call
from pydantic.dataclasses import dataclass

from .arguments import periodic_send, seconds_or_none
from .slcan import VmsidecarSlcanBus
from .uploads import RefusesUploads

#: the longest one wait of a ``recv`` (or a native ``send``) on the bus: how late it sees the bus shut down
WAIT_SLICE_S = 0.25
#: a CAN FD frame on a raw SocketCAN socket (``CANFD_MTU``), the largest a native bus reads
CANFD_FRAME_BYTES = 72
#: the most frames a claim drops from a native bus's socket: more than its receive buffer holds
MAX_QUEUED_FRAMES = 100_000


def forget_queued_frames(bus: Any) -> None:
    """Drop what a native bus's socket holds: its tree opens the host's interface when it is made,
    while the last lease's guest still runs, and the claim has recycled that guest since; the
    kernel queues no frame of the recycled guest after the claim (its QEMU has ended)."""
    sock = getattr(bus, "socket", None)
    if not isinstance(sock, socket.socket):
        return
    with contextlib.suppress(OSError):  # BlockingIOError: empty; any other: a closed bus stays so
        for _ in range(MAX_QUEUED_FRAMES):  # (a host interface others flood must not hold the claim)
            sock.recv(CANFD_FRAME_BYTES, socket.MSG_DONTWAIT)


class _Kept:
    """What a ``VmCan`` keeps for its lease (one field, so that pydantic sees one arbitrary type)."""

    def __init__(self) -> None:
        #: taken to make, start or forget a periodic send, and to shut the bus down
        self.lock = threading.Lock()
        self.closed = threading.Event()
        #: periodic sends by the id the client holds, until its ``_stop_task``
        self.tasks: dict[UUID, can.broadcastmanager.CyclicSendTaskABC] = {}


@dataclass(kw_only=True, config=ConfigDict(arbitrary_types_allowed=True))
class VmCan(RefusesUploads, Can):
    """Upstream's ``Can`` (client ``CanClient``), with its arguments checked and its waits ended by
    the bus's shutdown at the end of the lease (``shut_bus_down``)."""

    _kept: _Kept = field(init=False, default_factory=_Kept, repr=False)

    # ---- what the tree calls ---------------------------------------------------------------
    def forget_before_claim(self) -> None:
        """The claim may have recycled the guest behind the bus: nothing it received before is this
        lease's (our bus connects anew; a native one drops what its socket queued)."""
        if isinstance(self.bus, VmsidecarSlcanBus):
            with contextlib.suppress(Exception):  # (a shut-down bus stays down; the claim stands)
                self.bus.reconnect()
        else:
            forget_queued_frames(self.bus)

    def shut_bus_down(self) -> None:
        """End everything of this bus: its periodic sends, every ``recv`` and ``send`` (within
        ``WAIT_SLICE_S``), and any later call; the python-can bus is shut down."""
        with self._kept.lock:
            self._kept.closed.set()
            tasks = list(self._kept.tasks.values())
        for task in tasks:  # (BusABC.shutdown stops only the tasks its send_periodic recorded)
            with contextlib.suppress(Exception):
                task.stop()
        self.bus.shutdown()

    def _shut_down(self) -> can.CanOperationError:
        return can.CanOperationError(f"the CAN bus {self.channel} is shut down (its lease ended)")

    def _check_open(self) -> None:
        if self._kept.closed.is_set():
            raise self._shut_down()

    def _frame(self, msg: CanMessage) -> can.Message:
        """``msg`` as a python-can frame of this bus: checked by python-can, on this bus's channel
        whatever channel it names (socketcan opened a socket on the named one for periodic sends)."""
        # (the driver's channel: python-can buses keep theirs in ``channel`` or not, not always a name)
        fields = {**msg.__dict__, "channel": self.channel}
        if not fields.get("is_remote_frame"):  # a data frame's length is its data's (upstream let dlc differ)
            fields.pop("dlc", None)
        try:
            return can.Message(**fields, check=True)
        except (TypeError, ValueError) as e:
            raise ValueError(f"msg is not a CAN frame: {e}") from e

    # ---- upstream's exports, checked ----------------------------------------------------------
    @export
    @validate_call(validate_return=True)
    def _recv_internal(self, timeout: float | None) -> tuple[CanMessage | None, bool]:
        limit = seconds_or_none(timeout)
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            self._check_open()
            left = WAIT_SLICE_S if deadline is None else max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic()))
            try:
                msg, filtered = self.bus._recv_internal(left)
            except Exception as e:  # a socketcan bus shut down meanwhile: select on a closed socket
                if self._kept.closed.is_set():
                    raise self._shut_down() from e
                raise
            if msg is not None:
                return CanMessage.construct(msg), filtered
            if deadline is not None and time.monotonic() >= deadline:
                return None, filtered

    @export
    @validate_call(validate_return=True)
    def send(self, msg: CanMessage, timeout: float | None = None) -> None:
        """Send an individual CAN message."""
        limit = seconds_or_none(timeout)
        frame = self._frame(msg)
        self._check_open()
        if limit is None or isinstance(self.bus, VmsidecarSlcanBus):
            # None: python-can's "try once" (ours: 5 s); our bus's waits end at its shutdown
            self.bus.send(frame, limit)
            return
        deadline = time.monotonic() + limit
        while True:  # socketcan waits in select for room in its queue: not woken by the shutdown
            try:
                self.bus.send(frame, max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic())))
                return
            except Exception as e:
                if self._kept.closed.is_set():
                    raise self._shut_down() from e
                # socketcan's queue still full ("Transmit buffer full", no errno): wait on, else fail
                if not isinstance(e, can.CanOperationError) or e.error_code is not None \
                        or time.monotonic() >= deadline:
                    raise

    @export
    @validate_call(validate_return=True, config=ConfigDict(arbitrary_types_allowed=True))
    def _send_periodic_internal(
        self,
        msgs: Sequence[CanMessage] | CanMessage,
        period: float,
        duration: float | None = None,
        autostart: bool = True,
        modifier_callback: Callable[[can.Message], None] | None = None,
    ) -> UUID:
        if modifier_callback is not None:  # (a function does not cross gRPC: only a direct caller has one)
            raise ValueError("modifier_callback is not supported by the exported driver; leave it None")
        given = [msgs] if isinstance(msgs, CanMessage) else list(msgs)
        with self._kept.lock:  # (the shutdown stops, under it, every task made before it)
            self._check_open()
            period_s, duration_s = periodic_send(given, period, duration, kept=len(self._kept.tasks),
                                                 channel=self.channel)
            frames = [self._frame(msg) for msg in given]
            task = self.bus._send_periodic_internal(frames, period_s, duration_s, autostart, None)
            uuid = uuid4()
            self._kept.tasks[uuid] = task
        return uuid

    def _task(self, uuid: UUID) -> can.broadcastmanager.CyclicSendTaskABC:
        try:
            return self._kept.tasks[uuid]
        except KeyError:
            raise ValueError(f"no periodic send {uuid} on the CAN bus {self.channel} (stopped "
                             "already?)") from None

    @export
    @validate_call(validate_return=True)
    def _start_task(self, uuid: UUID) -> None:
        with self._kept.lock:
            self._check_open()
            task = self._task(uuid)
            if not isinstance(task, can.broadcastmanager.RestartableCyclicTaskABC):
                raise ValueError(f"the periodic send {uuid} cannot be started again")
            task.start()

    @export
    @validate_call(validate_return=True)
    def _stop_task(self, uuid: UUID) -> None:
        with self._kept.lock:
            task = self._task(uuid)
            del self._kept.tasks[uuid]
            if self._kept.closed.is_set():
                return  # stopped with the bus (CanClient's shutdown stops its tasks after the bus's)
        task.stop()

    @export
    @validate_call(validate_return=True)
    def shutdown(self) -> None:
        """Shutdown the bus."""
        self.shut_bus_down()
