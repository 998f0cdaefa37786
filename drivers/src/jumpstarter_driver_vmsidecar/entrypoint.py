"""``vmsidecar-exporter``: ``jmp run`` for the exporter container, with ExitAndReplace exit codes.

It runs ``jmp run ARGS…`` as its child, forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT to it, and
exits with the child's code, except that an exit the driver itself requested for
ExitAndReplace (``jmp run`` 0.9.0 reports it as 129) becomes 0: the lease ended as planned and
the pod completes Succeeded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from .lease_exit import MARKER_ENV

REQUESTED_EXIT_CODE = 128 + signal.SIGHUP


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = sys.argv[1:] if argv is None else argv
    with tempfile.TemporaryDirectory(prefix="vmsidecar-exporter-") as tmp:
        marker = Path(tmp) / "exit-requested"
        env = {**os.environ, MARKER_ENV: str(marker)}
        proc = subprocess.Popen(["jmp", "run", *args], env=env)

        def forward(signum: int, _frame: object) -> None:
            proc.send_signal(signum)

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, forward)
        rc = proc.wait()
        if rc == REQUESTED_EXIT_CODE and marker.exists():
            print("vmsidecar-exporter: lease served, exiting for ExitAndReplace", file=sys.stderr)
            return 0
        return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
