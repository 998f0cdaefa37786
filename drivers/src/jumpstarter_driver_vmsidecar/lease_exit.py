"""ExitAndReplace on jumpstarter 0.9.0: make ``jmp run`` end after the first lease.

0.9.0 has no ``exitOnLeaseEnd``. Its ``jmp run`` restarts the exporter child whenever it exits 0
and passes any other exit code through. SIGHUP to the child is its own "exit after the current
lease" switch: the exporter then skips reporting AVAILABLE, unregisters, and exits 129, which the
parent does not restart. We send it when the first lease claims the VM, so the pool never offers
this exporter again. ``vmsidecar-exporter`` (the exporter image's entrypoint) turns that
requested 129 into exit 0 so the pod completes Succeeded. Where jumpstarter has
``exitOnLeaseEnd`` and the config sets it, jumpstarter does all of this itself.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import yaml

#: set by ``vmsidecar-exporter``: a file the driver writes when it asked for the exit
MARKER_ENV = "VMSIDECAR_EXIT_MARKER"


def _argv_option(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def controller_mode(argv: list[str] | None = None) -> bool:
    """True inside ``jmp run`` talking to a controller (not standalone TCP, not ``jmp shell``)."""
    argv = sys.argv if argv is None else argv
    return len(argv) > 1 and Path(argv[0]).name in ("jmp", "jumpstarter") and argv[1] == "run" and not any(
        a.startswith("--tls-grpc-listener") for a in argv
    )


def config_exits_on_lease_end(argv: list[str] | None = None) -> bool:
    """Whether this jumpstarter has ``exitOnLeaseEnd`` and the exporter config turns it on."""
    from jumpstarter.config.exporter import ExporterConfigV1Alpha1

    if "exit_on_lease_end" not in ExporterConfigV1Alpha1.model_fields:
        return False
    path = _argv_option(sys.argv if argv is None else argv, "--exporter-config")
    if path is None:
        return False
    try:
        return bool(yaml.safe_load(Path(path).read_text()).get("exitOnLeaseEnd"))
    except (OSError, AttributeError, yaml.YAMLError):
        return False


def request_exit_after_lease(log: logging.Logger) -> None:
    """Ask ``jmp run`` to exit once the current lease ends (no-op outside controller mode)."""
    if not controller_mode():
        log.info("ExitAndReplace: not under `jmp run` with a controller; the runtime stops when the session ends")
        return
    if config_exits_on_lease_end():
        log.info("ExitAndReplace: exitOnLeaseEnd is set; jumpstarter exits after this lease")
        return
    marker = os.environ.get(MARKER_ENV)
    if marker:
        Path(marker).write_text("ExitAndReplace\n")
    log.info("ExitAndReplace: asking jmp run (pid %d) to exit after this lease", os.getpid())
    os.kill(os.getpid(), signal.SIGHUP)
