"""ExitAndReplace on jumpstarter 0.9.0: make ``jmp run`` end after the first lease.

0.9.0 has no ``exitOnLeaseEnd``. Its ``jmp run`` restarts the exporter child whenever the child
exits 0. SIGHUP to the child is its own "exit after the current lease" switch: the exporter then
skips reporting AVAILABLE (except on the ``EndSession`` path of ``jmp shell`` auto-leases, which
reports it before exiting), unregisters, and its parent does not restart it. ``jmp run`` itself
then exits 0 (click discards the internal code 129), so a ``restartPolicy: Never`` pod completes
Succeeded. We send SIGHUP at the first driver call of a lease: driver calls are only served in
LEASE_READY, and a SIGHUP before the first lease would stop the exporter at once. Where
jumpstarter has ``exitOnLeaseEnd`` and the config sets it, jumpstarter does this itself.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import yaml


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
    # vmsidecar-exporter: exporter_run.py, `jmp run` without its supervising fork (the exporter image)
    runner = len(argv) > 1 and Path(argv[0]).name in ("jmp", "jumpstarter", "vmsidecar-exporter") and argv[1] == "run"
    return runner and not any(a.startswith("--tls-grpc-listener") for a in argv)


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
    log.info("ExitAndReplace: asking jmp run (pid %d) to exit after this lease", os.getpid())
    os.kill(os.getpid(), signal.SIGHUP)
