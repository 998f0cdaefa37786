"""A capture under way: what ``SnapshotOps.save`` hands to ``SnapshotOps.commit``."""

from __future__ import annotations

from dataclasses import dataclass

from ..capture_ram import CaptureRam
from ..snapshots import Snapshot


@dataclass
class Capture:
    """A capture under way: the guest's state is written, the snapshot not committed yet."""

    key: str
    staged: Snapshot
    guest_agent: bool
    started: float
    #: the boot's RAM (a templated capture), copied into ``staged`` at the commit
    ram: CaptureRam | None = None
    #: seconds from the start to the commit
    seconds: float = 0.0


@dataclass
class Staging:
    """A templated capture made ready before its cold boot: where it is committed, the boot's RAM."""

    snap: Snapshot
    ram: CaptureRam
