"""Leases: which lease has the VM, and what a lease leaves behind.

A lease is tied to the runtime's generation (docs/architecture.md, "Leases and recycling"); the
controller bumps it at every recycle and decides when a claim or a recycle happens. ``Lease`` keeps
whether the current generation is claimed and what its lease did (the audit trail's summary),
refuses a recycle meant for an earlier generation, and clears what an ending lease leaves.

The exporter claims when it hands a lease out, before the lease can do anything (CAN and network
forwards reach the guest without a runtime call).

A call bound to a lease's generation is checked as it arrives (the API's generation middleware)
and again once it holds the power lock (:func:`bound_call`, :meth:`Lease.require_bound_call`): it
may have waited for the lock behind the next lease's claim, whose recycle moved the generation on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

from vmsidecar_contract.errors import GenerationChangedError

from .. import audit
from ..events import EventBus
from .disks import Disks
from .ledger import LeaseLedger
from .streams import GuestStreams

T = TypeVar("T")


class LeaseEnded(Exception):
    """The lease a wait was for ended first (:func:`unless_ended`)."""


async def unless_ended(work: Awaitable[T], ending: asyncio.Event | None, timeout: float | None = None) -> T:
    """What ``work`` returns, unless ``ending`` (a lease's :attr:`Lease.ending`) is set first: then
    ``work`` is cancelled (and has ended) before this raises.

    :raise LeaseEnded: ``ending`` was set first. :raise TimeoutError: past ``timeout`` (``work`` cancelled).
    """
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(ending.wait()) if ending is not None else None
    try:
        done, _ = await asyncio.wait({task} if stop is None else {task, stop}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        if stop is not None:
            stop.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task in done:
        return task.result()
    if not task.cancelled():
        task.exception()  # (read: thrown away with the work)
    if stop is not None and stop in done:
        raise LeaseEnded
    raise TimeoutError


#: the generation the API call being served is bound to, with the task serving it (a task the call
#: spawns copies the context, but is not the call: a boot's helpers outlive it)
_bound: ContextVar[tuple[int, asyncio.Task[Any] | None] | None] = ContextVar("lease_bound_call", default=None)


@contextlib.contextmanager
def bound_call(generation: int) -> Iterator[None]:
    """While the current task serves a call bound to the lease of ``generation``."""
    token = _bound.set((generation, asyncio.current_task()))
    try:
        yield
    finally:
        _bound.reset(token)


class Lease:
    """The claim of the current generation, and the clearing of a lease's leftovers."""

    def __init__(self, disks: Disks, streams: GuestStreams, events: EventBus) -> None:
        self._disks = disks
        self._streams = streams
        self._events = events
        #: a lease has the current generation (no capture starts; the next claim recycles first)
        self.claimed = False
        #: the token its claim named (``claimed_by``), if any
        self.token: str | None = None
        #: a recycle runs: its generation is unclaimed before its guest boots, and is claimed after
        self._recycling = False
        #: what the current generation's lease did, for its summary line when it ends
        self.ledger = LeaseLedger()
        #: set once the current generation's lease is being ended (its recycle, or the next lease's
        #: claim, waits for the power lock): a wait that lease holds the lock with ends early
        self.ending = asyncio.Event()

    def require_generation(self, if_generation: int | None) -> None:
        """:raise GenerationChangedError: ``if_generation`` is no longer the current one (an earlier
        recycle already happened, e.g. the next lease claimed the VM first)."""
        generation = self._events.generation
        if if_generation is not None and if_generation != generation:
            raise GenerationChangedError(
                f"generation {if_generation} was already recycled (now {generation}); nothing to do")

    def require_claimed(self, generation: int) -> None:
        """A call bound to the lease that claimed ``generation`` goes on only while the VM is at it and
        it is claimed: an unclaimed one is no lease's yet (a recycle made it, or the runtime restarted
        and counts its generations from 0 again).

        :raise GenerationChangedError: naming both generations.
        """
        current = self._events.generation
        if generation != current or not self.claimed:
            now = f"generation {current}{'' if self.claimed else ', claimed by no lease'}"
            raise GenerationChangedError(f"this call belongs to the lease of generation {generation}, which "
                                         f"has ended (the VM is at {now}); it was not carried out")

    def require_bound_call(self) -> None:
        """:meth:`require_claimed` for the call the current task serves, if it is bound to a lease
        (:func:`bound_call`); the power lock runs it once acquired.

        :raise GenerationChangedError: the call's lease ended while it waited."""
        bound = _bound.get()
        if bound is not None and bound[1] is asyncio.current_task():
            self.require_claimed(bound[0])

    def claim_unclaimed(self, token: str | None = None) -> bool:
        """Claim the current generation if no lease has it yet (for the claimer of ``token``); False
        when an earlier lease claimed it (the claim then recycles first, so a new lease never sees the
        previous one), or while a recycle runs (the claim then waits for it, behind the lock)."""
        if self.claimed or self._recycling:
            return False
        self.claimed, self.token = True, token
        return True

    def end(self) -> None:
        """The current generation's lease is being ended: what it holds the power lock with stops
        waiting (a graceful power-off whose timeout it chose, up to an hour; a pull or a snapshot
        fetch from a registry of its own), so that neither its recycle nor the next claim waits."""
        self.ending.set()

    def claimed_by(self, token: str | None) -> bool:
        """Whether the claimer of ``token`` holds the current generation already."""
        return token is not None and self.claimed and self.token == token

    @contextlib.contextmanager
    def recycling(self) -> Iterator[None]:
        """While a recycle runs (``claim_unclaimed`` claims nothing then)."""
        self._recycling = True
        try:
            yield
        finally:
            self._recycling = False

    async def clear(self, *, claim: bool, token: str | None = None) -> None:
        """Drop what the ending lease left (the guest is stopped): its overlay, flashed disks and
        UEFI vars, all scrollback, every console client. ``claim``: the next generation is the
        claiming lease's (of ``token``) from the start (its boot is never captured, no other claim
        can take it, and that claim asked again is answered, not taken for the next lease's)."""
        await self._disks.discard_lease()
        self._streams.clear_for_next_lease()
        self.claimed, self.token = claim, token if claim else None
        self.summarize("claim" if claim else "recycle")
        self.ledger = LeaseLedger()
        self.ending = asyncio.Event()

    def summarize(self, ended_by: str) -> None:
        """The audit trail's summary line of the current generation's lease."""
        audit.write(**self.ledger.summary(self._events.generation, ended_by))
