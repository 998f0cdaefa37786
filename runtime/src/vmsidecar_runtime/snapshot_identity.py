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
import hashlib
import importlib.metadata
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

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
    "form": "snapshot form (templated or stream)",
    "runtime_version": "vmsidecar runtime version",
    "image_digest": "image digest",
    "qemu_version": "QEMU version",
    "machine": "machine type",
    "cpu": "CPU model",
    "accelerator": "accelerator",
    "readiness": "readiness (the instant of capture)",
    "key": "spec (devices, memory, CPUs, kernel and initrd files …)",
}


#: CPU models that hand the guest the node's own CPU under KVM (``max`` is ``host`` and more): their
#: state runs only on a node whose CPU is of the same kind
PASSTHROUGH_MODELS = frozenset({"host", "max"})
#: the /proc/cpuinfo fields that name a kind of processor (x86_64; aarch64), and those that list its features
_CPU_NAME_FIELDS = ("vendor_id", "cpu family", "model", "stepping",
                    "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "CPU revision")
_CPU_FEATURE_FIELDS = ("flags", "Features")


@functools.cache
def read_cpuinfo() -> str:
    """This node's /proc/cpuinfo ("" where there is none)."""
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def host_cpu(cpuinfo: str) -> str:
    """Each kind of processor ``cpuinfo`` (/proc/cpuinfo's text) lists, by its name fields and a hash of
    its features (``AuthenticAMD 25 17 1, features 3f0c9a…``); kinds joined by `` + `` (big.LITTLE)."""
    kinds = set()
    for block in cpuinfo.split("\n\n"):
        fields = {name.strip(): value.strip()
                  for name, sep, value in (line.partition(":") for line in block.splitlines()) if sep}
        named = " ".join(fields[f] for f in _CPU_NAME_FIELDS if f in fields)
        features = next((fields[f] for f in _CPU_FEATURE_FIELDS if f in fields), None)
        if named or features is not None:
            listed = " ".join(sorted((features or "").split()))
            kinds.add(f"{named}, features {hashlib.sha256(listed.encode()).hexdigest()[:12]}")
    return " + ".join(sorted(kinds)) or "unknown"


def snapshot_cpu(model: str, accel: str) -> str:
    """The CPU a snapshot's state belongs to: ``model``, and where KVM passes the node's CPU through
    (:data:`PASSTHROUGH_MODELS`) that CPU after it, so that a node of another kind never restores it
    (the guest would run instructions its CPU lacks). TCG's models are QEMU's own, and a named model
    is the pool owner's choice of what every node provides: the same on every node."""
    if accel == "kvm" and model in PASSTHROUGH_MODELS:
        return f"{model} ({host_cpu(read_cpuinfo())})"
    return model


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
    #: ``TEMPLATED`` or ``STREAM`` (:func:`.snapshots.snapshot_form`): also in the key; spelled out so
    #: that a fetched snapshot's own record of its form (``meta.json``) is held to it
    form: str

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
        cpu=snapshot_cpu(effective_cpu(spec, accel), accel),
        accelerator=accel,
        readiness="",
        runtime_version=runtime_version(),
        format=str(FORMAT),
        form=snapshot_form(spec)[0],
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
        key=snapshot_key(spec, base.digest, accel, known.cpu, readiness, known.form),
        image_digest=base.digest,
        readiness=json.dumps(readiness.model_dump(mode="json"), sort_keys=True),
    )
