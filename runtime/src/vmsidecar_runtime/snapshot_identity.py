"""What a memory snapshot was captured with, field by field: its cache key and the annotations a
snapshot artifact in a registry carries (docs/oci.md, "Snapshot artifacts").

The key (:func:`.snapshots.snapshot_key`) is one hash; a registry artifact spells out what went
into it as well, so a runtime that finds an artifact of another key can say which field differs
(another QEMU, CPU model, image …) instead of "no match". One function computes both, for the
runtime deciding to restore and for ``vmsidecar-oci snapshot push`` publishing: they can never
disagree on a key.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
from dataclasses import asdict, dataclass, replace

from vmsidecar_contract.spec import VmSpec

from .backend.common import MACHINE, effective_cpu
from .disk import DiskImage
from .readiness_rules import effective_readiness
from .snapshots import FORMAT, qemu_version, snapshot_form, snapshot_key

#: annotation prefix of the fields; ``…key`` is the snapshot key itself (the spec hash)
PREFIX = "io.vmsidecar.snapshot."
#: field -> how a refusal names it (in the order a mismatch is reported: the coarsest first)
FIELDS = {
    "format": "snapshot format",
    "runtime_version": "vmsidecar runtime version",
    "image_digest": "image digest",
    "qemu_version": "QEMU version",
    "machine": "machine type",
    "cpu": "CPU model",
    "accelerator": "accelerator",
    "readiness": "readiness (the instant of capture)",
    "key": "spec (devices, memory, CPUs …)",
}


@functools.cache
def runtime_version() -> str:
    """The installed vmsidecar-runtime's version ("" when it is not installed as a package)."""
    try:
        return importlib.metadata.version("vmsidecar-runtime")
    except importlib.metadata.PackageNotFoundError:
        return ""


@dataclass(frozen=True)
class SnapshotIdentity:
    """Everything a snapshot must match to be restored by this runtime, as text."""

    key: str
    image_digest: str
    qemu_version: str
    machine: str
    cpu: str
    accelerator: str
    readiness: str
    runtime_version: str
    format: str

    def annotations(self) -> dict[str, str]:
        """``io.vmsidecar.snapshot.<field>`` for every field."""
        return {PREFIX + name.replace("_", "-"): value for name, value in asdict(self).items()}

    def mismatch(self, annotations: dict, ignore: frozenset[str] = frozenset()) -> str | None:
        """Why an artifact annotated with ``annotations`` is not a snapshot this runtime may restore
        (the first field that differs, both values named), or None when every field not in ``ignore``
        is equal."""
        mine = asdict(self)
        for name, label in FIELDS.items():
            if name in ignore:
                continue
            theirs = annotations.get(PREFIX + name.replace("_", "-"))
            if theirs != mine[name]:
                shown = "not set" if theirs is None else repr(str(theirs)[:200])
                return f"its {label} is {shown}, this runtime's is {mine[name][:200]!r}"
        return None


#: the fields only the pulled image tells: its disk's digest, the readiness its annotations may set,
#: and the key, which hashes both
IMAGE_FIELDS = frozenset({"image_digest", "readiness", "key"})


def identify_before_pull(spec: VmSpec, accel: str) -> SnapshotIdentity:
    """The identity of ``spec``'s snapshot as far as it is known before its image is pulled: every
    field but :data:`IMAGE_FIELDS` (left empty).

    :raise HostError: the spec's CPU model cannot run under ``accel`` (``cpu: host`` under TCG).
    """
    return SnapshotIdentity(
        key="",
        image_digest="",
        qemu_version=qemu_version(spec.arch),
        machine=spec.machine or MACHINE[spec.arch],
        cpu=effective_cpu(spec, accel),
        accelerator=accel,
        readiness="",
        runtime_version=runtime_version(),
        format=str(FORMAT),
    )


def identify(spec: VmSpec, base: DiskImage, accel: str) -> SnapshotIdentity:
    """The identity of the snapshot of ``spec`` booted from ``base`` under ``accel``.

    :raise ImageError: the image's readiness annotations are invalid (the boot fails on them too).
    :raise HostError: the spec's CPU model cannot run under ``accel`` (``cpu: host`` under TCG).
    """
    known = identify_before_pull(spec, accel)
    # the image's annotations may set the readiness, i.e. the instant a snapshot is taken
    readiness = effective_readiness(spec, base).readiness
    return replace(
        known,
        # the form is in the key, not a field of its own: an artifact of the other form is "another spec"
        key=snapshot_key(spec, base.digest, accel, known.cpu, readiness, snapshot_form(spec)[0]),
        image_digest=base.digest,
        readiness=json.dumps(readiness.model_dump(mode="json"), sort_keys=True),
    )
