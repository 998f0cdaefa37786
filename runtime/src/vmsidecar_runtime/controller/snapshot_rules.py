"""Why a boot neither restores nor captures a memory snapshot: the rules that come before any key.

Each rule gives the reason shown in ``snapshot.reason`` of ``GET /v1/vm`` and the fixed reason of
the ``vmsidecar_snapshot_lookups_total`` metric.
"""

from __future__ import annotations

from collections.abc import Callable

from vmsidecar_contract.spec import VmSpec

from ..metrics import LookupReason
from .disks import Disks
from .paths import RuntimePaths


def never_snapshots(spec: VmSpec, supports: Callable[[str], bool]) -> tuple[str, LookupReason] | None:
    """Why no boot of ``spec`` restores or captures, whatever its disk (a spare restore neither:
    ``standby.py``), or None."""
    if spec.snapshot == "off":
        return "snapshot: off in the spec", "disabled"
    if not supports(spec.backend):
        return f"the {spec.backend} backend has no memory snapshots yet", "backend_unsupported"
    if spec.arch != "x86_64":  # only x86_64 gets a vmgenid (backend/qemu_argv.py): decisions.md
        return f"{spec.arch}: no vmgenid, the guest's RNG would repeat — cold boot", "arch_unsupported"
    return None


#: the reasons of :func:`no_snapshot` that are the lease's disk: the spec's snapshot still serves
#: the next recycle
LEASE_BOUND: frozenset[LookupReason] = frozenset({"flashed", "lease_changes"})


def no_snapshot(spec: VmSpec, disks: Disks, paths: RuntimePaths,
                supports: Callable[[str], bool]) -> tuple[str, LookupReason] | None:
    """Why booting ``spec`` now must be a plain cold boot, or None when a snapshot may serve."""
    if (rule := never_snapshots(spec, supports)) is not None:
        return rule
    if disks.flashed is not None or disks.current is None:
        return "the disk was flashed in this lease", "flashed"
    if paths.overlay.exists():
        return "the disk already has this lease's changes (power cycle within a lease)", "lease_changes"
    return None
