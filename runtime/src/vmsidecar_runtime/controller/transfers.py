"""Disk transfers: pull an image, receive an upload flash, send a dump; one at a time per VM.

``Transfers`` moves the bytes and installs nothing: ``DiskOps`` decides when a transfer runs and
installs what arrived. The files themselves are ``Disks``' job.

A disk transfer (a flash by reference, an upload flash, a dump) belongs to the lease it started in:
one at a time per VM (a second is a 409), cancelled when its lease ends (recycle), when the next
lease claims the VM or when its client goes away, and never installed once cancelled or once the
generation it started in is gone. A flash is bounded by the runtime's pull deadline; a dump (streamed
by ``api/server.py``) lasts until its reader has read it all or left, and its temp copy of the disk
with it. A pull runs in a daemon thread of its own (never the loop's pool: ``threads.py``); given
up, it is told to stop (``Transfer.abort``), which also shuts down its registry connections and
kills its qemu-img, so it stops at once wherever it waits, removing its partial file.

What a transfer is called (``Transfer.what``: a 409's message, the ``transfer_cancelled`` event, the
log) quotes its reference redacted: those reach whoever has the VM next.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterable, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from vmsidecar_contract.errors import PullTimeoutError, TransferError
from vmsidecar_contract.spec import VmSpec

from .. import metrics
from ..audit import redact
from ..disk import DiskImage
from ..events import EventBus
from ..threads import Abort
from .disks import Disks, Progress

log = logging.getLogger(__name__)
T = TypeVar("T")

#: default deadline of one pull or upload flash, start to end (serve --pull-timeout): a registry
#: that trickles must not hold a VM (and a lease's recycle) for ever
DEFAULT_PULL_TIMEOUT_S = 1800.0


@dataclass(eq=False)
class Transfer:
    """One disk transfer of a lease: what it is, the generation it belongs to, how to stop it."""

    what: str
    generation: int
    #: set when the transfer is given up: the pull's thread stops (its reads fail, it checks at each chunk)
    abort: Abort = field(default_factory=Abort)
    #: why it was cancelled (None while it may still be installed)
    reason: str | None = None
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    #: bytes it brought in (a pull's download; 0 from the cache)
    received: int = 0

    def cancel(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.abort.set()
        self.cancelled.set()


class Transfers:
    """The VM's one disk transfer slot and the pull deadline.

    ``events`` carries the generation a transfer is owned by (bumped by every recycle) and receives
    ``pulled`` and ``transfer_cancelled``.
    """

    def __init__(self, disks: Disks, events: EventBus, pull_timeout: float) -> None:
        self._disks = disks
        self._events = events
        #: seconds one pull or upload flash may take (serve --pull-timeout)
        self.pull_timeout = pull_timeout
        #: the one disk transfer under way (a lease's flash), cancelled when its lease ends
        self._transfer: Transfer | None = None

    # ---- the transfer slot ---------------------------------------------------------------
    def begin(self, what: str) -> Transfer:
        """Reserve the VM's one disk transfer for the current generation (the caller ends it).

        :raise TransferError: while another transfer is under way (409 transfer_in_progress).
        """
        current = self._transfer
        if current is not None:
            raise TransferError(
                f"{current.what} is still under way on this VM, and a VM takes one disk transfer (a flash "
                "or a dump) at a time; wait for it to end (a dump ends once its reader has read it all or "
                "disconnected; ending the lease cancels either), then try again")
        self._transfer = Transfer(what, self._events.generation)
        return self._transfer

    def end(self, transfer: Transfer) -> None:
        if self._transfer is transfer:
            self._transfer = None

    def cancel(self, reason: str, transfer: Transfer | None = None) -> None:
        """Give up the transfer under way (only ``transfer``, when named): nothing of it is installed.
        The slot is free at once; the transfer's own call ends with ``transfer_cancelled``."""
        current = self._transfer
        if current is None or (transfer is not None and current is not transfer):
            return
        self._transfer = None
        current.cancel(reason)
        log.warning("%s cancelled: %s", current.what, reason)
        self._events.publish("transfer_cancelled", what=current.what, generation=current.generation, reason=reason)

    def check(self, transfer: Transfer) -> None:
        """Before installing: a cancelled transfer, or one of a generation since recycled, is thrown away.

        :raise TransferError: (transfer_cancelled) naming why.
        """
        if transfer.reason is None and transfer.generation != self._events.generation:
            transfer.cancel(f"the lease it belonged to ended (generation {transfer.generation} was recycled)")
        if transfer.reason is not None:
            raise TransferError(f"{transfer.what} was cancelled: {transfer.reason}; nothing of it was installed",
                                code="transfer_cancelled")

    async def _bounded(self, work: Awaitable[T], what: str, transfer: Transfer | None, abort: threading.Event,
                       *, deadline: bool = True) -> T:
        """Await ``work`` within the pull deadline (``deadline``), unless ``transfer`` is cancelled first.

        :raise PullTimeoutError: past the deadline; :raise TransferError: cancelled.
        """
        task = asyncio.ensure_future(work)
        waiters: set[asyncio.Future[Any]] = {task}
        stop = asyncio.ensure_future(transfer.cancelled.wait()) if transfer is not None else None
        if stop is not None:
            waiters.add(stop)
        try:
            done, _ = await asyncio.wait(waiters, timeout=self.pull_timeout if deadline else None,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if stop is not None:
                stop.cancel()
            if not task.done():
                abort.set()  # a pull's thread stops at once: its sockets shut down, its qemu-img killed
                task.cancel()
                await asyncio.wait({task})  # its clean-up (partial files) runs before the answer (threads.GRACE_S)
        if transfer is not None and transfer.reason is not None:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: it is thrown away with the transfer
            self.check(transfer)
        if task in done:
            return task.result()
        raise PullTimeoutError(
            f"{what} did not finish within {self.pull_timeout:g} s, the runtime's deadline for one pull; nothing "
            "was installed; use a closer or faster registry (or send the image faster), or raise the deadline "
            "with vmsidecar-runtime serve --pull-timeout SECONDS (VMSIDECAR_PULL_TIMEOUT)")

    # ---- transfers -----------------------------------------------------------------------
    async def pull(self, spec: VmSpec, reference: str | None = None, *, progress: Progress | None = None,
                   transfer: Transfer | None = None, on_download: Callable[[str], None] | None = None
                   ) -> tuple[DiskImage, float]:
        """Pull an image into the cache (or reuse it): the base disk and the seconds it took, within
        the pull deadline and unless ``transfer`` is cancelled first. Nothing is installed.

        :raise ImageError: for every pull failure, with the cause and the fix.
        :raise PullTimeoutError: past the deadline. :raise TransferError: ``transfer`` was cancelled.
        """
        abort = transfer.abort if transfer is not None else Abort()

        def report(done: int, total: int | None) -> None:  # the pull's thread, at every chunk
            abort.check()
            if progress is not None:
                progress(done, total)

        what = f"the pull of {redact(reference or spec.image)}"
        disk, pulled, seconds = await self._bounded(self._disks.pull(spec, reference, progress=report,
                                                                     on_download=on_download, abort=abort),
                                                    what, transfer, abort)
        self._events.publish("pulled", reference=disk.source, digest=pulled.digest, cached=pulled.cached,
                             bytes_downloaded=pulled.bytes_downloaded)
        source = metrics.source_of(reference or spec.image or "")
        metrics.pull_bytes.labels(source).inc(pulled.bytes_downloaded)
        metrics.pull_seconds.labels(source).observe(seconds)
        if transfer is not None:
            transfer.received = pulled.bytes_downloaded
        return disk, round(seconds, 3)

    async def receive(self, chunks: AsyncIterable[bytes], transfer: Transfer, *, expected_size: int | None,
                      expected_digest: str | None) -> Any:
        """Receive and verify an upload flash into a temp file, within the pull deadline; nothing
        changes yet.

        :raise ImageError: a bad image. :raise PullTimeoutError: past the deadline.
        :raise TransferError: ``transfer`` was cancelled meanwhile.
        """
        received = await self._bounded(
            self._disks.receive_flash(chunks, expected_size=expected_size, expected_digest=expected_digest),
            "the upload flash", transfer, transfer.abort)
        self.check(transfer)
        return received

    async def dump(self, fmt: str, transfer: Transfer) -> Path:
        """Write the disk in ``fmt`` for a dump (``Disks.dump``) unless ``transfer`` is cancelled first:
        then its qemu-img is killed and its file removed. The conversion runs under the power lock,
        for minutes on a large disk, and the lease's end waits for that lock: it must not wait for
        the whole conversion (nor must the next lease's claim). No deadline: a disk takes its time.

        :raise HostError: qemu-img cannot write it. :raise TransferError: ``transfer`` was cancelled.
        """
        try:
            self.check(transfer)  # (cancelled while it waited for the lock)
            return await self._bounded(self._disks.dump(fmt), "the disk dump", transfer, transfer.abort,
                                       deadline=False)
        except TransferError:
            raise TransferError(f"the disk dump was cancelled: {transfer.reason}; no copy of the disk was kept; "
                                "dump again within a lease", code="transfer_cancelled") from None
