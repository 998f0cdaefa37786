"""``jmp run`` in one process: the exporter image's entrypoint.

jumpstarter 0.9.0's ``jmp run`` forks: a supervising parent that only waits and restarts its
child when the child exits 0, and the child that serves. Both carry the whole ``jmp`` CLI, whose
admin commands import ``kubernetes_asyncio`` (≈ 860 modules): measured here, 147 MB + 139 MB RSS.
This runner serves the same exporter with the same code (``jumpstarter_cli.run._handle_child``,
private in a pinned release, hence the test in tests/test_exporter_run.py) without the fork and
without importing the rest of the CLI, and does the parent's job (restart after a 0 exit, the
rapid-failure limit) in a loop. ``run`` takes ``jmp run``'s options, so a pod's
``args: [run, --exporter-config, …]`` work unchanged; anything else (another subcommand,
``--exporter NAME``, ``--help``) is handed to the real ``jmp``.

``--metrics-listen HOST:PORT`` (or ``VMSIDECAR_EXPORTER_METRICS_LISTEN``) serves the exporter's own
Prometheus metrics (``metrics``) at ``GET /metrics``; ``jmp run`` has no such option.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from .metrics_http import METRICS_LISTEN_ENV, METRICS_LISTEN_FLAG

#: the argv[0] name lease_exit recognises as "jmp run" in controller mode
PROG = "vmsidecar-exporter"

log = logging.getLogger(PROG)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"{PROG} run", add_help=False)
    p.add_argument("--exporter-config", required=True)
    p.add_argument("--tls-grpc-listener", dest="listener")
    p.add_argument("--tls-grpc-insecure", action="store_true")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--passphrase")
    p.add_argument("--log-level")
    p.add_argument(METRICS_LISTEN_FLAG, dest="metrics_listen", default=os.environ.get(METRICS_LISTEN_ENV) or None)
    return p


def _exec_jmp(argv: list[str]) -> int:
    jmp = shutil.which("jmp") or str(Path(sys.executable).parent / "jmp")
    os.execv(jmp, [jmp, *argv])
    return 127  # not reached


def _usage_error(args: argparse.Namespace) -> str | None:
    """The checks of ``jmp run``, with its messages."""
    extras = args.tls_grpc_insecure or args.tls_cert or args.tls_key or args.passphrase
    if args.listener is None:
        return "--tls-grpc-insecure, --tls-cert, --tls-key, and --passphrase require --tls-grpc-listener" \
            if extras else None
    if args.tls_grpc_insecure and (args.tls_cert or args.tls_key):
        return "--tls-grpc-insecure cannot be combined with --tls-cert / --tls-key"
    if not args.tls_grpc_insecure and not (args.tls_cert and args.tls_key):
        return "--tls-grpc-listener requires either --tls-grpc-insecure or --tls-cert and --tls-key"
    return None


#: the signals ``jmp run``'s child stops on
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class _Stopped(BaseException):
    """A stop signal that came before the exporter's own receiver listened (see :func:`_serve_once`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, _frame: object) -> None:
    raise _Stopped(signum)


def _stopped_by(exc: BaseException) -> int | None:
    """The signal of a :class:`_Stopped` in ``exc`` (anyio's task groups wrap it in groups), else None."""
    if isinstance(exc, _Stopped):
        return exc.signum
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (signum := _stopped_by(inner)) is not None:
                return signum
    return None


def _serve_once(config: object, args: argparse.Namespace, bind: tuple[str, int] | None) -> int:
    """One exporter lifetime (what ``jmp run``'s child does); its exit code.

    ``_handle_child`` starts its signal receiver at its first await, after the exporter has made its
    temporary sockets' directory and while it builds the driver tree (which may probe hardware): a
    signal then took the default action, ending the process where it stood, the directory left in
    /tmp. Until that receiver replaces them, these handlers unwind the exporter (its ``with`` blocks
    remove what they made) and end it as the receiver would have."""
    from jumpstarter_cli.run import _handle_child

    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise_stopped)
    try:
        _handle_child(config, bind, args.tls_grpc_insecure, args.tls_cert, args.tls_key, args.passphrase)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        if (signum := _stopped_by(e)) is None:
            raise
        return 128 + signum
    return 1  # _handle_child always exits


def run(argv: list[str]) -> int:
    """``run [jmp run options]``: serve until a signal, the exporter's own exit code or too many rapid exits."""
    args, unknown = _parser().parse_known_args(argv)
    if unknown:
        return _exec_jmp(["run", *argv])  # options this runner does not take: the real `jmp run`
    if (problem := _usage_error(args)) is not None:
        print(f"Error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=(args.log_level or "INFO").upper())
    if args.metrics_listen is not None:
        from .metrics_http import serve_metrics

        try:
            serve_metrics(args.metrics_listen)
        except (ValueError, OSError) as e:
            print(f"Error: {e}", file=sys.stderr)
            return 2
    sys.argv = [PROG, "run", *argv]  # lease_exit reads the mode from argv, as it does under `jmp run`

    from jumpstarter.config.exporter import ExporterConfigV1Alpha1
    from jumpstarter_cli.run import _parse_listener_bind

    config = ExporterConfigV1Alpha1.load_path(Path(args.exporter_config))
    bind = _parse_listener_bind(args.listener) if args.listener is not None else None
    detection = config.failure_detection
    rapid = 0
    while True:
        started = time.monotonic()
        code = _serve_once(config, args, bind)
        if code > 128:
            # a signal ended it (SIGHUP: ExitAndReplace after the lease); `jmp run` exits 0 then too
            log.info("exporter stopped by %s", signal.Signals(code - 128).name)
            return 0
        if code != 0:
            return code
        # exit 0 = "restart me" (jmp run's parent restarts its child): restart in this process
        elapsed = time.monotonic() - started
        rapid = rapid + 1 if elapsed < detection.rapid_failure_window else 0
        if rapid >= detection.max_rapid_failures:
            print(f"Exporter failed {rapid} times within {detection.rapid_failure_window}s each. "
                  "Exiting to allow container/service restart.", file=sys.stderr)
            return 1
        log.info("exporter ended after %.1f s; restarting it", elapsed)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``run …`` is served here, everything else goes to ``jmp``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["run"]:
        return _exec_jmp(argv)
    return run(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
