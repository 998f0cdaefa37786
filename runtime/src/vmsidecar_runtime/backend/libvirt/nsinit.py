"""PID 1 of the private libvirt namespace (``python -m vmsidecar_runtime.backend.libvirt.nsinit ROOT``).

Runs inside ``unshare --mount --pid --fork --mount-proc --kill-child``: bind-mounts ROOT's
etc/run/lib/cache/log over libvirt's fixed privileged paths (so this libvirtd shares nothing with
a system libvirt or another runtime) and ROOT/nss/{passwd,group} over /etc/passwd and /etc/group
(they name libvirt's built-in QEMU user even when no package created it), starts libvirtd, reaps
every child (QEMU is reparented to us) and exits with libvirtd. When this process dies the kernel
kills everything left in the PID namespace, QEMU included: no guest outlives its runtime, however
the runtime ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

#: private dir (under ROOT) -> libvirt's compiled-in privileged path
BINDS = {
    "etc": "/etc/libvirt",
    "run": "/run/libvirt",
    "lib": "/var/lib/libvirt",
    "cache": "/var/cache/libvirt",
    "log": "/var/log/libvirt",
    "nss/passwd": "/etc/passwd",
    "nss/group": "/etc/group",
}


def main(argv: list[str]) -> int:
    """Mount, start libvirtd, reap until it exits."""
    root = Path(argv[0])
    for sub, target in BINDS.items():
        if (root / sub).is_dir():
            Path(target).mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "--bind", str(root / sub), target], check=True)
    daemon = subprocess.Popen(["libvirtd", "--config", "/etc/libvirt/libvirtd.conf",
                               "--pid-file", "/run/libvirt/libvirtd.pid"])

    def forward(signum: int, _frame: object) -> None:
        daemon.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue
        if pid == daemon.pid:
            daemon.returncode = os.waitstatus_to_exitcode(status)
            return daemon.returncode if daemon.returncode >= 0 else 128 - daemon.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
