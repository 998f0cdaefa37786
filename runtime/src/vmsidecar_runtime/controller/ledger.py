"""What one lease did, for the audit trail's summary line at its end (``vmsidecar.audit``).

``Lease`` keeps one ``LeaseLedger`` per generation: ``DiskOps`` adds what a flash brought in
and a dump took out, the API's audit middleware the power operations a caller asked for, the
claim when the lease began. The recycle (or the shutdown of ExitAndReplace) drains it into one
summary and starts the next generation's.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

#: the flashes a summary names (the last ones: the disk the lease left is the last); it counts them all
FLASHED_KEPT = 32


@dataclass
class LeaseLedger:
    """One generation's activity."""

    started: float = field(default_factory=time.monotonic)
    claimed_at: float | None = None
    #: the last disks flashed: ``REFERENCE@DIGEST`` (``upload@DIGEST`` for an upload), credentials stripped
    flashed: deque[str] = field(default_factory=lambda: deque(maxlen=FLASHED_KEPT))
    flashes: int = 0
    power_operations: int = 0
    bytes_in: int = 0
    bytes_out: int = 0

    def claimed(self) -> None:
        if self.claimed_at is None:
            self.claimed_at = time.monotonic()

    def flash(self, target: str, nbytes: int) -> None:
        self.flashed.append(target)
        self.flashes += 1
        self.bytes_in += nbytes

    def dump(self, nbytes: int) -> None:
        self.bytes_out += nbytes

    def power_operation(self) -> None:
        self.power_operations += 1

    def summary(self, generation: int, ended_by: str) -> dict[str, Any]:
        """The summary line's fields; the lease's duration runs from its claim (else from the
        generation's start, for a generation no lease claimed)."""
        since = self.claimed_at if self.claimed_at is not None else self.started
        return {"audit": "lease", "generation": generation, "claimed": self.claimed_at is not None,
                "ended_by": ended_by, "flashed": list(self.flashed), "flashes": self.flashes,
                "power_operations": self.power_operations,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "duration_s": round(time.monotonic() - since, 3)}
