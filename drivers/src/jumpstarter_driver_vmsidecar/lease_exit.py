"""jumpstarter 0.9.0's lease lifecycle, as the driver sees it: which driver tree serves a lease
(``serves_a_lease``), and ExitAndReplace (make ``jmp run`` end after the first lease).

**Which tree is a lease's.** 0.9.0 builds a fresh driver tree for every session and calls its
``reset()`` synchronously inside the context manager that builds it, before the session serves:

- ``Exporter.session`` (controller mode, once at start-up): reset → Register → close. No lease:
  the only tree that must not claim.
- ``Exporter.session_for_lease`` (controller mode, from ``handle_lease``): one tree per lease,
  built when the controller assigns the lease, before LEASE_READY is reported.
- ``Exporter.serve_standalone_tcp`` (``jmp run --tls-grpc-listener``): one tree for the process.
- ``ExporterConfigV1Alpha1.serve_unix_async`` (``jmp shell --exporter-config``) and
  ``jumpstarter.common.utils.serve_async`` (in-process): one tree per shell.

A tree's ``reset()`` cannot see its lease (``Session.lease_context`` is set after it, and 0.9.0
passes no LEASE_NAME to drivers), so the caller is read off the stack: the start-up tree is the one
built by ``Exporter.session``. A tree built anywhere else is handed to someone: claimed.

0.9.0 has no ``exitOnLeaseEnd``. Its ``jmp run`` restarts the exporter child whenever the child
exits 0. SIGHUP to the child is its own "exit after the current lease" switch: the exporter then
skips reporting AVAILABLE (except on the ``EndSession`` path of ``jmp shell`` auto-leases, which
reports it before exiting), unregisters, and its parent does not restart it. ``jmp run`` itself
then exits 0 (click discards the internal code 129), so a ``restartPolicy: Never`` pod completes
Succeeded. We send SIGHUP when the lease's tree claims the VM (its ``reset()``): ``serve()`` has
marked the exporter started before it builds a lease's tree, so the signal waits for the lease's
end; a SIGHUP before the first lease would stop the exporter at once (the start-up tree never
claims). Where
jumpstarter has ``exitOnLeaseEnd`` and the config sets it, jumpstarter does this itself.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

import yaml

#: (module, qualified name) of the function that builds 0.9.0's start-up tree (never a lease's)
STARTUP_TREE_BUILDER = ("jumpstarter.exporter.exporter", "Exporter.session")


def serves_a_lease() -> bool:
    """Whether the driver tree whose ``reset()`` is running is handed out (module docstring)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if (frame.f_globals.get("__name__"), getattr(code, "co_qualname", code.co_name)) == STARTUP_TREE_BUILDER:
            return False
        frame = frame.f_back
    return True


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
