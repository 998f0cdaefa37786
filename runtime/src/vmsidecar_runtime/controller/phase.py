"""The state machine's state: the phase, the power lock, the last error.

One ``PhaseMachine`` per VM, owned by ``VmController`` and handed to the collaborators that move
the phase (``Power``, ``DiskOps``). Every operation takes ``lock`` (requests are serialized, so
there are never two hypervisors) and checks its phase at the door (``require``); every change of
phase is published as a ``phase`` event.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from vmsidecar_contract.errors import SpecError, VmsidecarError
from vmsidecar_contract.spec import VmSpec
from vmsidecar_contract.state import Phase, require

from ..events import EventBus

log = logging.getLogger(__name__)


def unexpected(e: Exception, what: str) -> str:
    """How ``what`` failing on an exception nobody raised on purpose (a bug) is told: the exception,
    where its traceback is (logged here), and that it is to be reported."""
    log.error("the %s failed on an unexpected error", what, exc_info=e)
    return (f"the {what} failed on an unexpected {type(e).__name__} ({e}): a bug in vmsidecar, please report it "
            "with the runtime's log (it has the traceback)")


class PowerLock:
    """The power lock (an ``asyncio.Lock``) that tells its holder when another operation waits for
    it: a capture waiting for its guest to settle (``Power._capture``) then captures at once."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._waiting = 0
        #: set while an operation waits for the lock
        self.wanted = asyncio.Event()
        #: run once the lock is held; what it raises releases the lock and ends the operation (the
        #: controller's: a lease's call that waited past its lease's end goes no further)
        self.on_acquired: Callable[[], None] | None = None

    async def __aenter__(self) -> None:
        self._waiting += 1
        self.wanted.set()
        try:
            await self._lock.acquire()
        finally:
            self._waiting -= 1
            if not self._waiting:
                self.wanted.clear()
        if self.on_acquired is not None:
            try:
                self.on_acquired()
            except BaseException:
                self._lock.release()
                raise

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()


class PhaseMachine:
    """The phase of the VM, its power lock and the error that ended the last boot."""

    def __init__(self, events: EventBus) -> None:
        self._events = events
        self.phase = Phase.STOPPED
        self.lock = PowerLock()
        self.last_error: VmsidecarError | None = None

    def set(self, phase: Phase, **data: Any) -> None:
        """Move to ``phase`` (published with ``data``; staying in a phase publishes nothing)."""
        if phase != self.phase:
            log.info("phase %s -> %s", self.phase.value, phase.value)
            self.phase = phase
            self._events.publish("phase", phase=phase.value, **data)

    def fail(self, phase: Phase, error: VmsidecarError) -> None:
        """Move to Error or Crashed because of ``error`` (kept as ``last_error``)."""
        self.last_error = error
        log.error("%s", error.message)
        self.set(phase, error=error.to_dict())

    def require(self, allowed: frozenset[Phase], operation: str, *, hint: str = "") -> None:
        """:raise StateError: (409) unless the phase is one of ``allowed``."""
        require(self.phase, allowed, operation, hint=hint)


def require_spec(spec: VmSpec | None) -> VmSpec:
    """:raise SpecError: (no_spec) the runtime has no spec yet."""
    if spec is None:
        raise SpecError("the runtime has no VM spec yet; PUT /v1/vm/spec or start it with --spec/--image",
                        code="no_spec")
    return spec
