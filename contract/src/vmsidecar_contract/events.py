"""The events of ``GET /v1/events``: the envelope every NDJSON line has, and the data of each type.

``EVENTS`` maps each type to its data model. The runtime's event bus builds every event it
publishes as an :class:`Event`, which checks the data against its type's model: an event type or
field that is not here cannot reach the wire. The data stays the dict the runtime published (the
models check it, they do not rewrite it: an int stays an int on the wire). A reader gets the typed
data with :meth:`Event.typed`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from .models import ErrorBody
from .state import Phase, Timings


class EventData(BaseModel):
    """The data of one event type; a field the runtime does not document is refused."""

    model_config = ConfigDict(extra="forbid")


class HelloData(EventData):
    """``hello``: the first line of every stream (time 0), with the phase the VM is in."""

    phase: Phase


class PhaseData(EventData):
    """``phase``: the VM changed phase; the other fields say why (one or two of them at a time)."""

    phase: Phase
    #: Error/Crashed: the error that put it there
    error: ErrorBody | None = None
    #: Running after a boot: the accelerator and why it was chosen
    accel: str | None = None
    accel_reason: str | None = None
    #: Stopped or Running: recycled, reset, guest reset, flash, shutdown, or QEMU's shutdown cause
    reason: str | None = None
    #: Stopping: an ACPI power-off (true) or a hard one
    graceful: bool | None = None
    #: Ready: the boot's timings
    timings: Timings | None = None


class SpecData(EventData):
    """``spec``: the spec was replaced (as ``GET /v1/vm/spec`` would answer it); null: dropped (a
    lease's spec, at the next claim of a runtime with no spec of its own)."""

    spec: dict[str, Any] | None


class PulledData(EventData):
    """``pulled``: an image is in the cache."""

    reference: str
    digest: str
    cached: bool
    bytes_downloaded: int


class FlashedData(EventData):
    """``flashed``: the disk was replaced, by an upload (size, format) or from a reference."""

    digest: str
    size: int | None = None
    format: str | None = None
    reference: str | None = None


class TransferCancelledData(EventData):
    """``transfer_cancelled``: a disk transfer was abandoned; nothing of it was installed."""

    what: str
    #: the generation the transfer belonged to
    generation: int
    reason: str


class GenerationData(EventData):
    """``claimed`` and ``recycled``: the generation the VM is now in."""

    generation: int


class BootData(EventData):
    """``boot``: a boot began (power-on, reset, guest reboot); ``boot`` counts the generation's
    boots (``VmState.boot``)."""

    boot: int
    reason: str


class PowerdownTimeoutData(EventData):
    """``powerdown_timeout``: the guest ignored ACPI power-down for ``timeout`` seconds; forced off."""

    timeout: float


class PoweredOffData(EventData):
    """``guest.powered_off``: the guest powered off (``guest``: by itself)."""

    reason: str
    guest: bool


class ResetData(EventData):
    """``guest.reset``: a reset (``guest``: the guest's own, not the API's)."""

    guest: bool


class IoErrorData(EventData):
    """``guest.io_error``: a disk I/O error (QEMU's ``BLOCK_IO_ERROR``)."""

    operation: str
    action: str
    nospace: bool
    reason: str


class ExitedData(EventData):
    """``backend.exited``: the hypervisor process (or domain) ended."""

    returncode: int | None = None
    signal: int | None = None
    reason: str | None = None


class NoData(EventData):
    """An event whose type says it all."""


#: every event type, with its data; ``GET /v1/events?types=`` takes these names
EVENTS: dict[str, type[EventData]] = {
    "hello": HelloData,
    "phase": PhaseData,
    "spec": SpecData,
    "pulled": PulledData,
    "flashed": FlashedData,
    "transfer_cancelled": TransferCancelledData,
    "claimed": GenerationData,
    "recycled": GenerationData,
    "boot": BootData,
    "powerdown_timeout": PowerdownTimeoutData,
    "guest.powered_off": PoweredOffData,
    "guest.reset": ResetData,
    "guest.paused": NoData,
    "guest.resumed": NoData,
    "guest.panicked": NoData,
    "guest.powerdown_requested": NoData,
    "guest.io_error": IoErrorData,
    "backend.exited": ExitedData,
}


class Event(BaseModel):
    """One line of ``GET /v1/events``: something that happened to the VM in ``generation``."""

    type: str
    time: float
    generation: int
    data: dict[str, Any] = {}

    @model_validator(mode="after")
    def _known(self) -> Event:
        self.typed()
        return self

    def typed(self) -> EventData:
        """The data as its type's model.

        :raise ValueError: for a type ``EVENTS`` does not list (pydantic's ValidationError for bad data).
        """
        model = EVENTS.get(self.type)
        if model is None:
            raise ValueError(f"event type {self.type!r} is not in vmsidecar_contract.events.EVENTS; "
                             "add it there with its data model")
        return model.model_validate(self.data)
