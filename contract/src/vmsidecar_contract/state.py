"""Phases of a VM and the state the API reports."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel

from .errors import StateError
from .spec import Readiness


class Phase(StrEnum):
    """Lifecycle phases; every operation names the phases it accepts."""

    PULLING = "Pulling"
    STOPPED = "Stopped"
    STARTING = "Starting"
    RUNNING = "Running"
    READY = "Ready"
    STOPPING = "Stopping"
    CRASHED = "Crashed"
    ERROR = "Error"


#: phases with a live backend process
LIVE = frozenset({Phase.STARTING, Phase.RUNNING, Phase.READY})
#: phases from which a fresh boot may start
BOOTABLE = frozenset({Phase.STOPPED, Phase.CRASHED, Phase.ERROR})


def require(actual: Phase, allowed: frozenset[Phase], operation: str, *, hint: str = "") -> None:
    """Raise a 409-mapped error when ``actual`` is not one of ``allowed``.

    :raise StateError: naming the actual and the required phases (and ``hint``, another way out).
    """
    if actual not in allowed:
        wanted = "|".join(sorted(p.value for p in allowed))
        raise StateError(
            f"cannot {operation} while the VM is {actual.value}; it needs {wanted}" + (f", {hint}" if hint else ""),
            actual=actual.value,
            required=wanted,
        )


class Timings(BaseModel):
    """Seconds of the current boot (``VmState.boot``), measured from its start: the QEMU launch,
    a reset or a guest reboot. A new boot starts with ``first_console_byte`` and ``ready`` unset."""

    #: wall-clock time (epoch seconds) the current boot started
    launched_at: float | None = None
    first_console_byte: float | None = None
    ready: float | None = None
    pull: float | None = None


SourceRefusal = Literal["not_found", "key_mismatch", "unreachable", "tampered", "bad_artifact", "too_large",
                        "not_registry_image", "timeout", "host_error"]
#: why a snapshot takes the full-stream form instead of the templated one (the fixed set)
FORM_REASON_GPIO = "vhost-user GPIO shares guest RAM with its backend process"
FORM_REASON_RUNTIME = "VMSIDECAR_SNAPSHOT_FORM=stream on this runtime"
FormReason = Literal["vhost-user GPIO shares guest RAM with its backend process",
                     "VMSIDECAR_SNAPSHOT_FORM=stream on this runtime"]


class SnapshotInfo(BaseModel):
    """How memory snapshots serve this VM (``spec.snapshot``)."""

    #: how the current boot began: booted cold, restored from the snapshot in the cache, restored
    #: from a snapshot fetched from the spec's ``snapshot_source`` (the cache had none), or not begun
    boot: Literal["none", "cold", "restored", "registry_warm"] = "none"
    #: why no snapshot of the spec's ``snapshot_source`` was used, when one was looked for (details
    #: in ``reason``): none published for this image, a key that differs, the source unreachable or
    #: refusing, an artifact that fails its digests or cannot be read, one past the size caps, a
    #: file: image (no manifest), the fetch's time bound, the cache not writable
    source_refusal: SourceRefusal | None = None
    #: why the current boot was cold, or why no snapshot is taken (flashed disk, libvirt, a device …)
    reason: str | None = None
    #: the snapshot in the cache for this spec and image, if any
    available: bool = False
    #: this boot's capture is under way: the guest, Ready, settles before it is captured (any claim
    #: or operation captures it at once), or the capture is being written into the cache;
    #: ``available`` turns true when it is there (the next boot waits for it)
    storing: bool = False
    size: int | None = None
    #: how long the capture kept the guest paused (what it added to a claim that came meanwhile)
    capture_seconds: float | None = None
    #: when the capture was taken: "settled" (the guest's vCPUs had gone idle), "requested" (a
    #: claim or an operation wanted the guest first), "settle_limit" (it never idled), "at_ready"
    #: (at the readiness marker: the runtime cannot see the vCPUs, or VMSIDECAR_CAPTURE_SETTLE_S=0)
    captured_when: Literal["settled", "requested", "settle_limit", "at_ready"] | None = None
    #: seconds from Ready to the capture's pause (the guest settling)
    settle_seconds: float | None = None
    restore_seconds: float | None = None
    #: the guest's wall clock after this boot's restore (a restored guest resumes at the capture
    #: instant; a capture also restores, to go on): "corrected" (set to the host's through the
    #: guest agent), "setting" (a restore is Ready before its clock is set; console input and a
    #: claim's answer wait for it), "no guest agent" (none answered at capture; the clock stays
    #: behind), "failed: <why>"; None when the boot neither restored nor captured
    clock: str | None = None
    #: the snapshot's form: "templated" (guest RAM in a file every restore maps copy-on-write; the
    #: stream holds device state only) or "stream" (RAM in the migration stream); None when this
    #: spec gets no snapshot
    form: Literal["templated", "stream"] | None = None
    #: why the form is "stream" (None when templated)
    form_reason: FormReason | None = None
    #: this boot's guest was restored ahead, while the previous lease ran, and the recycle only
    #: switched to it (the spec's ``standby``)
    restored_ahead: bool = False
    #: what waits for the next recycle (the spec's ``standby``): "off" (not asked for),
    #: "preparing", "ready" (a spare restore runs: the recycle switches to it), "parked" (a paused
    #: QEMU with nothing loaded: the recycle loads the snapshot into it), or "none" (why in
    #: ``standby_reason``)
    standby: Literal["off", "preparing", "ready", "parked", "none"] = "off"
    standby_reason: str | None = None


class ExitInfo(BaseModel):
    """How the last backend process ended."""

    returncode: int | None = None
    signal: int | None = None
    stderr_tail: list[str] = []
    reason: str = ""


class VmState(BaseModel):
    """``GET /v1/vm``."""

    phase: Phase
    generation: int
    #: boots of this generation (power-on, reset, guest reboot; the one that begins it is 1):
    #: console scrollback and ``timings`` belong to this boot only
    boot: int = 0
    #: a lease has used this generation (the next lease gets a recycled guest)
    claimed: bool = False
    backend: str
    image: str | None = None
    image_digest: str | None = None
    disk: str | None = None
    accel: str | None = None
    accel_reason: str | None = None
    timings: Timings = Timings()
    forwards: dict[str, str] = {}
    sockets: dict[str, str] = {}
    last_error: dict[str, str] | None = None
    last_exit: ExitInfo | None = None
    console_tail: str | None = None
    snapshot: SnapshotInfo = SnapshotInfo()
    #: the readiness the guest is held to: the spec's fields, else the image's annotations, else
    #: the defaults (None until the spec's image is known, unless the spec sets the pattern)
    readiness: Readiness | None = None
    #: where ``readiness.pattern`` came from
    readiness_source: Literal["spec", "image", "default"] | None = None
