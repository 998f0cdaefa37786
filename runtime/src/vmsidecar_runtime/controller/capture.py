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
    #: seconds from the pause to the commit, or to the frozen copy of a guest that goes on in its process
    seconds: float = 0.0


@dataclass
class FrozenCapture:
    """A capture whose guest went on: its RAM copied out of the guest's reach, sealed, to be stored."""

    #: a copy of the guest's RAM at the capture (a templated capture), else None (a full stream)
    ram: CaptureRam | None
    #: the RAM's seal digest, taken with the guest paused
    sealed: str | None


@dataclass
class Staging:
    """A templated capture made ready before its cold boot: where it is committed, the boot's RAM."""

    snap: Snapshot
    ram: CaptureRam
