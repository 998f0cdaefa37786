"""A capture under way: what ``SnapshotOps.save`` hands to ``SnapshotOps.commit``."""

from __future__ import annotations

from dataclasses import dataclass

from ..capture_ram import CaptureRam, FrozenRam
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
    #: where that RAM is copied in the pause when the guest goes on in its process
    frozen: FrozenRam | None = None
    #: seconds from the pause to the commit, or to the frozen copy of a guest that goes on in its process
    seconds: float = 0.0


@dataclass
class FrozenCapture:
    """A capture whose guest went on: its RAM copied out of the guest's reach, to be stored."""

    #: the guest's RAM at the capture, read-only (a templated capture), else None (a full stream)
    ram: FrozenRam | None


@dataclass
class Staging:
    """A templated capture made ready before its cold boot: where it is committed, the boot's RAM
    and the copy of it that follows it (``FrozenRam``)."""

    snap: Snapshot
    ram: CaptureRam
    frozen: FrozenRam

    def close(self) -> None:
        """Release both memfds (a QEMU still running on the boot's RAM keeps its mapping)."""
        self.frozen.close()
        self.ram.close()
