"""Where the runtime keeps things: shared sockets, the image cache, per-instance state, private sockets."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RuntimePaths:
    """The runtime's directories (design §2: the shared dir is small; the cache is its own volume)."""

    shared: Path
    cache: Path
    state: Path
    run: Path

    def __post_init__(self) -> None:
        # Absolute against the working directory, not resolved (``serve`` must still see a shared dir
        # that is a link, to refuse it): every path the runtime derives from these ends up somewhere
        # recorded (an overlay's backing file name), and qemu-img reads a relative one from the
        # overlay's own directory, not from ours.
        for name in ("shared", "cache", "state", "run"):
            object.__setattr__(self, name, getattr(self, name).absolute())

    def stream_socket(self, stream: str) -> Path:
        """The shared-dir socket for a guest stream (design §2)."""
        if stream == "ttyS0":
            return self.shared / "console.sock"
        if stream.startswith("can-"):
            return self.shared / "can" / f"{stream.removeprefix('can-')}.sock"
        if stream.startswith("channel-"):
            return self.shared / "channels" / f"{stream.removeprefix('channel-')}.sock"
        return self.shared / f"{stream}.sock"

    @property
    def overlay(self) -> Path:
        """The lease's qcow2 overlay over the read-only base (survives power cycles, not recycles)."""
        return self.state / "overlay.qcow2"

    @property
    def overlay_base(self) -> Path:
        """Under the overlay of a lease whose boot was captured in place: that boot's disk up to the
        capture, frozen (the snapshot holds a copy of it); goes with the lease."""
        return self.state / "overlay-base.qcow2"

    @property
    def overlay_ahead(self) -> Path:
        """The next restore's overlay, made while a lease runs (``Disks.prepare_ahead``), renamed into
        :attr:`overlay` by that restore."""
        return self.state / "overlay-ahead.qcow2"

    @property
    def spare(self) -> Path:
        """A spare restore's own overlay and UEFI vars (``standby.py``), moved into the lease's places
        when a recycle adopts it."""
        return self.state / "spare"

    @property
    def flashed(self) -> Path:
        """Disks flashed during this lease."""
        return self.state / "flashed"

    @property
    def firmware(self) -> Path:
        """Per-lease UEFI vars."""
        return self.state / "firmware"
