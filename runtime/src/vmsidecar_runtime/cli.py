"""``vmsidecar-runtime``: serve, and the client commands that talk to a serving runtime.

Human output by default, ``--json`` for scripts. Errors print one line and exit 2.

The client commands start in ~0.1 s: they import the blocking client and nothing of the runtime
(no server, no OCI code, no QEMU backend, no pydantic; tests/test_cli_imports.py); ``serve`` and its
``--help`` import the runtime (docs/decisions.md, "Issue 21 — fast CLI").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import termios
import tty
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vmsidecar_contract import DEFAULT_SHARED_DIR
from vmsidecar_contract.errors import VmsidecarError

PULL_TIMEOUT_ENV = "VMSIDECAR_PULL_TIMEOUT"


def _process_env() -> set[str]:
    """Environment that configures the process, not the VM spec."""
    from .api.listen import HEALTH_LISTEN_ENV
    from .hostpaths import ENV as HOST_PATHS_ENV  # here: the client commands import no runtime module
    from .image import limits
    from .oci.cache import BUDGET_ENV

    return {"VMSIDECAR_SHARED_DIR", "VMSIDECAR_CACHE_DIR", "VMSIDECAR_STATE_DIR", "VMSIDECAR_SOCKET_OWNER",
            "VMSIDECAR_LOG_FORMAT", "VMSIDECAR_LOG_LEVEL", HOST_PATHS_ENV, limits.MAX_DISK_SIZE_ENV,
            PULL_TIMEOUT_ENV, BUDGET_ENV, HEALTH_LISTEN_ENV}


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (e.g. 1800)")
    return value


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (argparse type)."""
    if (value := _finite(text)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds (e.g. 1800)")
    return value


def _standby(text: str) -> str:
    if text != "parked":
        raise argparse.ArgumentTypeError(f"{text!r}: --standby takes no value (a spare restore) or 'parked'")
    return text


def _grace(text: str) -> float:
    """``--grace``: seconds the guest has to stop, 0 to pull the plug at once (argparse type)."""
    if (value := _finite(text)) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds the guest has to stop "
                                         "(0 or more; 0 pulls the plug at once)")
    return value


#: what ``--log-level`` (and ``VMSIDECAR_LOG_LEVEL``) takes, in either case
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _log_level(text: str) -> str:
    """A logging level name (argparse type): ``debug`` as well as ``DEBUG``."""
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level (one of {', '.join(LOG_LEVELS)}; "
                                         "--log-level or VMSIDECAR_LOG_LEVEL)")
    return text.upper()


def _log_format(text: str) -> str:
    """``text`` or ``json`` (argparse type: it checks ``VMSIDECAR_LOG_FORMAT`` too, which a choice
    list would not, being the default)."""
    if text not in ("text", "json"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a log format (text or json; --log-format or "
                                         "VMSIDECAR_LOG_FORMAT)")
    return text


def _default_socket() -> Path:
    return Path(os.environ.get("VMSIDECAR_SHARED_DIR", DEFAULT_SHARED_DIR)) / "api.sock"


def _print_state(state: dict[str, Any], as_json: bool) -> None:
    """The state as the runtime sent it (``GET /v1/vm``, model ``VmState``)."""
    if as_json:
        print(json.dumps(state, indent=2, ensure_ascii=False))
        return
    print(f"phase:      {state['phase']}")
    print(f"generation: {state['generation']}")
    if state.get("image"):
        print(f"image:      {state['image']}")
    if state.get("image_digest"):
        print(f"digest:     {state['image_digest']}")
    if state.get("accel"):
        print(f"accel:      {state['accel']} ({state.get('accel_reason')})")
    if (readiness := state.get("readiness")) is not None:
        print(f"readiness:  {readiness['pattern']!r} on {readiness['console']} "
              f"(from the {state.get('readiness_source')})")
    t = state.get("timings") or {}
    if t.get("ready") is not None:
        print(f"boot:       first console byte {t.get('first_console_byte')} s, ready {t['ready']} s")
    for name, addr in (state.get("forwards") or {}).items():
        print(f"forward:    {name} -> {addr}")
    if state.get("last_error"):
        print(f"last error: {state['last_error']['message']}")


def _progress() -> tuple[Callable[[int, int | None], None], Callable[[], None]]:
    """A rich progress bar on a terminal; silence otherwise."""
    if not sys.stderr.isatty():
        return (lambda done, total: None), (lambda: None)
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), transient=True)
    task = bar.add_task("pulling", total=None)
    bar.start()
    return (lambda done, total: bar.update(task, completed=done, total=total)), bar.stop


async def _console(socket: Path) -> None:
    """Attach the terminal to a console socket; Ctrl-] detaches."""
    import asyncio  # here: only this command runs an event loop

    reader, writer = await asyncio.open_unix_connection(str(socket))
    loop = asyncio.get_running_loop()
    stdin_fd = sys.stdin.fileno()
    interactive = sys.stdin.isatty()
    saved = termios.tcgetattr(stdin_fd) if interactive else None
    done = asyncio.Event()

    def on_stdin() -> None:
        data = os.read(stdin_fd, 1024)
        if not data or (interactive and b"\x1d" in data):
            done.set()
            return
        writer.write(data)

    async def pump_out() -> None:
        while chunk := await reader.read(4096):
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
        done.set()

    if interactive:
        tty.setraw(stdin_fd)
        print("[attached; Ctrl-] to detach]\r", file=sys.stderr)
    async def pump_in() -> None:  # an input epoll refuses (a regular file, /dev/null, /dev/zero)
        while data := await asyncio.to_thread(os.read, stdin_fd, 65536):
            writer.write(data)
            await writer.drain()  # (an endless one goes at the console's pace, not into memory)
        done.set()

    reading: asyncio.Task[None] | None = None
    try:
        loop.add_reader(stdin_fd, on_stdin)
    except PermissionError:
        reading = asyncio.create_task(pump_in())
    out = asyncio.create_task(pump_out())
    try:
        await done.wait()
    finally:
        if reading is None:
            loop.remove_reader(stdin_fd)
        else:
            reading.cancel()
        out.cancel()
        writer.close()
        if saved is not None:
            termios.tcsetattr(stdin_fd, termios.TCSADRAIN, saved)


def _client_command(args: argparse.Namespace) -> int:
    # here, not at the top: serve (a warm start) has no use for an HTTP client (http.client: ~20 ms)
    from vmsidecar_contract.blocking import BlockingRuntimeClient, unavailable

    client = BlockingRuntimeClient(args.socket)
    if args.command == "status":
        _print_state(client.state(), args.json)
    elif args.command == "power":
        graceful = None if args.action in ("on", "reset") else not args.hard
        _print_state(client.power(args.action, graceful=graceful, timeout=args.timeout), args.json)
    elif args.command == "recycle":
        _print_state(client.recycle(boot=not args.no_boot), args.json)
    elif args.command == "pull":
        update, finish = _progress()
        try:
            state = client.flash_reference(args.reference, power_off=args.power_off, progress=update)
        finally:
            finish()
        _print_state(state, args.json)
    elif args.command == "flash":
        _print_state(client.flash(Path(args.file), power_off=args.power_off), args.json)
    elif args.command == "dump":
        size = client.dump(Path(args.file), fmt=args.format)
        print(json.dumps({"file": args.file, "bytes": size}) if args.json else f"wrote {size} bytes to {args.file}")
    elif args.command == "wait-ready":
        _print_state(client.wait_ready(args.timeout), args.json)
    elif args.command == "ready":
        current = client.state() if client.healthy() else None
        if not args.quiet:
            print(current["phase"] if current else "runtime not reachable")
        return 0 if current is not None and current["phase"] == "Ready" else 1
    elif args.command == "shutdown":
        client.shutdown()
        print(json.dumps({"status": "shutting-down"}) if args.json else "runtime shutting down")
    elif args.command == "console":
        import asyncio  # here: only this command runs an event loop

        path = Path(args.socket).parent / ("console.sock" if args.stream == "ttyS0" else f"{args.stream}.sock")
        try:
            asyncio.run(_console(path))
        except (FileNotFoundError, ConnectionRefusedError) as e:
            if client.healthy():  # the runtime is there: its VM has not booted yet
                raise VmsidecarError(
                    f"{path} is not there yet: the runtime serves a console once its VM boots (it is "
                    f"{client.state()['phase']}); power it on first (vmsidecar-runtime power on)") from e
            raise unavailable(path, e) from e
    return 0


def _warn_of_unknown_variables() -> None:
    """A ``VMSIDECAR_*`` variable no vmsidecar program reads is most likely a typo of one that does."""
    import logging

    from vmsidecar_contract.envvars import unknown

    for name, near in unknown(os.environ):
        logging.getLogger("vmsidecar_runtime").warning(
            "%s is set, but no vmsidecar program reads it%s", name,
            f"; did you mean {near}?" if near else " (vmsidecar-runtime serve --help names the runtime's)")


def _serve_command(args: argparse.Namespace) -> int:
    # here, not at the top: the client commands must not pay for the runtime (docs/decisions.md, issue 21)
    import asyncio

    from vmsidecar_contract.spec import spec_from_sources

    from .hostpaths import HostPathPolicy
    from .image import limits
    from .oci.cache import configure_budget
    from .serve import default_paths, serve, setup_logging

    setup_logging(args.log_format, args.log_level)
    _warn_of_unknown_variables()
    configure_budget(args.cache_budget)
    if args.max_disk_size is not None:
        try:
            limits.configure(limits.parse_size(args.max_disk_size))
        except ValueError:
            raise limits.setting_error(limits.MAX_DISK_SIZE_FLAG, args.max_disk_size) from None
    limits.max_disk_size()  # a bad VMSIDECAR_MAX_DISK_SIZE stops the runtime now, not at its first flash
    from .oci import auth as registry_auth  # here: the client commands need no registry code

    # a wrong auth file or unscoped credentials stop the runtime now, not at its first pull
    registry_auth.configure(auth_file=args.registry_auth, insecure=args.insecure_registry,
                            lease=args.lease_registry)
    overrides: dict[str, Any] = {"image": args.image, "arch": args.arch, "cpus": args.cpus, "memory": args.memory,
                                 "accel": args.accel, "backend": args.backend, "cpu": args.cpu,
                                 "snapshot_source": args.snapshot_source, "standby": args.standby}
    ready = {k: v for k, v in {"pattern": args.ready_pattern, "console": args.ready_console,
                               "timeout": args.ready_timeout}.items() if v is not None}
    overrides["readiness"] = ready or None  # merged field by field over the file's and env's
    spec_given = args.spec or any(v is not None for v in overrides.values()) or any(
        k.startswith("VMSIDECAR_") and k not in _process_env() | registry_auth.PROCESS_ENV for k in os.environ)
    spec = spec_from_sources(Path(args.spec) if args.spec else None, overrides) if spec_given else None
    host_paths = HostPathPolicy.from_sources(args.allow_host_paths)
    if args.health_listen:
        from .api.listen import parse_listen

        parse_listen(args.health_listen)  # a bad address stops the runtime now, not after it pulled and booted
    paths = default_paths(  # (last: it makes the private run directory)
        Path(args.shared_dir) if args.shared_dir else None,
        Path(args.cache_dir) if args.cache_dir else None,
        Path(args.state_dir) if args.state_dir else None,
    )
    try:
        runtime = serve(spec, paths, allow_extra_args=args.allow_extra_args, host_paths=host_paths,
                        grace=args.grace, pull_timeout=args.pull_timeout, health_listen=args.health_listen)
        _collect_again()
        return asyncio.run(runtime)
    finally:
        shutil.rmtree(paths.run, ignore_errors=True)  # (serve removes it too: this is for an exit before)


#: whether ``main`` paused the garbage collector for the runtime's start-up (``_collect_again`` ends it)
_collector_paused = False


def _pause_collector() -> None:
    """Pause the garbage collector while the runtime imports and prepares: what that makes (a few
    hundred modules, pydantic's models) lives until the process exits, so a collection then frees
    nothing, and they took 0.045 s of the 0.39 s before QEMU starts (docs/performance.md)."""
    global _collector_paused
    if gc.isenabled():
        gc.disable()
        _collector_paused = True


def _collect_again() -> None:
    """End the pause before the event loop runs; what the start-up made is frozen out of every later
    collection rather than scanned again by each."""
    global _collector_paused
    if _collector_paused:
        _collector_paused = False
        gc.enable()
        gc.freeze()


def _serve_arguments(s: argparse.ArgumentParser) -> None:
    """The options of ``serve``; their defaults come from the runtime's modules."""
    from .api.listen import HEALTH_LISTEN_ENV, HEALTH_LISTEN_FLAG
    from .controller.transfers import DEFAULT_PULL_TIMEOUT_S  # here: only serve pays for these imports
    from .image import limits
    from .oci.cache import BUDGET_ENV, DEFAULT_BUDGET
    from .serve import DEFAULT_SHARED

    s.add_argument("--spec", help="VM spec file (YAML or JSON); also VMSIDECAR_SPEC")
    s.add_argument("--image", help="image reference (OCI, oci-layout:DIR[:TAG], file:PATH)")
    s.add_argument("--arch")
    s.add_argument("--cpus", type=int)
    s.add_argument("--cpu", metavar="MODEL", help="QEMU CPU model (default host under KVM, max under TCG); also VMSIDECAR_CPU")
    s.add_argument("--snapshot-source", metavar="REGISTRY/REPO",
                   help="repository of snapshot artifacts to start from on an empty cache (docs/oci.md); "
                        "also VMSIDECAR_SNAPSHOT_SOURCE")
    s.add_argument("--memory")
    s.add_argument("--accel", choices=["auto", "kvm", "tcg"])
    s.add_argument("--backend", choices=["qemu", "libvirt"])
    s.add_argument("--ready-pattern", metavar="REGEX",
                   help="regex on the console that makes the guest Ready ('' = as soon as it runs); default: "
                        "the image's io.vmsidecar.readiness.pattern, else VMSIDECAR-READY, a login or a shell "
                        "prompt; also VMSIDECAR_READY_PATTERN")
    s.add_argument("--ready-console", choices=["ttyS0", "hvc0"], help="console to watch (VMSIDECAR_READY_CONSOLE)")
    s.add_argument("--ready-timeout", type=float, metavar="SECONDS",
                   help="seconds from power-on before the guest is in Error (VMSIDECAR_READY_TIMEOUT)")
    s.add_argument("--shared-dir", help=f"sockets for the exporter (default {DEFAULT_SHARED}, VMSIDECAR_SHARED_DIR)")
    s.add_argument("--cache-dir", help="image cache (default /var/lib/vmsidecar/cache, VMSIDECAR_CACHE_DIR)")
    s.add_argument("--state-dir", help="overlay, logs, flashed disks (VMSIDECAR_STATE_DIR)")
    s.add_argument("--cache-budget", metavar="SIZE",
                   help="what the image cache (disks and memory snapshots) may hold; past it the least recently "
                        f"used go, never what a VM uses (e.g. 20GiB; default {DEFAULT_BUDGET >> 30}GiB; also "
                        f"{BUDGET_ENV})")
    s.add_argument("--log-format", type=_log_format, metavar="{text,json}",
                   default=os.environ.get("VMSIDECAR_LOG_FORMAT", "text"),
                   help="text (default) or json lines (VMSIDECAR_LOG_FORMAT)")
    s.add_argument("--log-level", type=_log_level, metavar="LEVEL", default=os.environ.get("VMSIDECAR_LOG_LEVEL", "info"),
                   help=f"one of {', '.join(LOG_LEVELS)} (default info; VMSIDECAR_LOG_LEVEL)")
    s.add_argument("--allow-extra-args", action="store_true", help="accept extra_args in specs sent over the API")
    s.add_argument("--allow-host-paths", action="append", default=[], metavar="DIR",
                   help="let API callers name host paths (file:, oci-layout:, kernel, initrd) under DIR; "
                        "repeatable; also VMSIDECAR_ALLOW_HOST_PATHS=DIR[:DIR]")
    s.add_argument("--standby", nargs="?", const=True, default=None, type=_standby, metavar="parked",
                   help="spec standby: alone, true: a spare restore runs during each lease for the next recycle "
                        "(a second idle guest); 'parked': a paused QEMU waits, the recycle only loads the "
                        "snapshot (docs/operations.md); also VMSIDECAR_STANDBY=true|parked")
    s.add_argument("--grace", type=_grace, default=30.0, metavar="SECONDS",
                   help="seconds for a graceful guest stop on SIGTERM (default 30; 0: at once)")
    s.add_argument("--pull-timeout", type=_seconds, metavar="SECONDS",
                   default=os.environ.get(PULL_TIMEOUT_ENV, str(DEFAULT_PULL_TIMEOUT_S)),
                   help=f"deadline of one pull or flash, start to end (default {DEFAULT_PULL_TIMEOUT_S:.0f}; "
                        f"also {PULL_TIMEOUT_ENV})")
    s.add_argument(limits.MAX_DISK_SIZE_FLAG, metavar="SIZE",
                   help="largest disk a pull or flash may bring: its virtual size and its bytes on the host once "
                        f"decompressed (e.g. 64G, 512M; default 64G; also {limits.MAX_DISK_SIZE_ENV})")
    s.add_argument("--registry-auth", type=Path, metavar="FILE",
                   help="containers-auth.json / Docker config.json: registry credentials, each sent only to the "
                        "registry its entry names (default VMSIDECAR_REGISTRY_AUTH_FILE, REGISTRY_AUTH_FILE, then "
                        "podman's and Docker's files; docs/oci.md)")
    s.add_argument("--insecure-registry", action="append", default=[], metavar="HOST[:PORT]",
                   help="a registry spoken to in plain HTTP (repeatable; also VMSIDECAR_INSECURE_REGISTRIES); "
                        "none by default, not even loopback")
    s.add_argument("--lease-registry", action="append", default=[], metavar="HOST[:PORT][/NAMESPACE]",
                   help="lend the pool's credentials to a lease's flash (j vm storage flash oci://…) of the "
                        "repositories under this scope (repeatable; also VMSIDECAR_LEASE_REGISTRIES); "
                        "by default a lease's flash uses them only for the spec's image's repository")
    s.add_argument(HEALTH_LISTEN_FLAG, metavar="HOST:PORT", default=os.environ.get(HEALTH_LISTEN_ENV) or None,
                   help="also serve GET /healthz, /readyz and /metrics, and nothing else, on this TCP "
                        "address for httpGet probes and scrapes (e.g. 0.0.0.0:8081 in a pod; default: none; "
                        f"also {HEALTH_LISTEN_ENV})")


def build_parser(*, serve_options: bool = True) -> argparse.ArgumentParser:
    """The argument parser (exposed for docs and tests); without ``serve_options`` for the client
    commands, which then import nothing of the runtime."""
    p = argparse.ArgumentParser(prog="vmsidecar-runtime", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the runtime (pull, boot, serve the API)")
    if serve_options:
        _serve_arguments(s)

    def client_parser(name: str, help_: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help_)
        c.add_argument("--socket", default=str(_default_socket()), help="runtime API socket")
        c.add_argument("--json", action="store_true", help="machine-readable output")
        return c

    client_parser("status", "show the VM state")
    c = client_parser("power", "power on|off|reset|cycle")
    c.add_argument("action", choices=["on", "off", "reset", "cycle"])
    c.add_argument("--hard", action="store_true", help="off/cycle without ACPI power-down")
    c.add_argument("--timeout", type=_seconds, default=60.0, metavar="SECONDS")
    c = client_parser("recycle", "back to pristine (InPlaceReuse)")
    c.add_argument("--no-boot", action="store_true")
    c = client_parser("pull", "pull an image by reference and flash it")
    c.add_argument("reference")
    c.add_argument("--power-off", action="store_true")
    c = client_parser("flash", "flash a local image file")
    c.add_argument("file")
    c.add_argument("--power-off", action="store_true")
    c = client_parser("dump", "dump the disk to a file")
    c.add_argument("file")
    c.add_argument("--format", choices=["qcow2", "raw"], default="qcow2")
    c = client_parser("wait-ready", "wait until the guest is Ready")
    c.add_argument("--timeout", type=_seconds, default=300.0, metavar="SECONDS")
    c = client_parser("ready", "exit 0 when the guest is Ready, 1 otherwise (a readiness probe)")
    c.add_argument("--quiet", action="store_true")
    client_parser("shutdown", "stop the guest and the runtime")
    c = client_parser("console", "attach to a console (Ctrl-] detaches)")
    c.add_argument("--stream", default="ttyS0", choices=["ttyS0", "hvc0"])
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    argv = sys.argv[1:] if argv is None else argv
    serving = "serve" in argv  # anywhere (even as a file name): the whole parser, slower, still right
    if serving:
        _pause_collector()
    try:
        return _main(argv, serving)
    finally:
        _collect_again()


def _main(argv: list[str], serving: bool) -> int:
    args = build_parser(serve_options=serving).parse_args(argv)
    try:
        if args.command == "serve":
            return _serve_command(args)
        try:
            return _client_command(args)
        except KeyboardInterrupt:
            return 130
        except TimeoutError as e:  # wait-ready's deadline: a verdict, not a crash
            print(f"error: {e}", file=sys.stderr)
            return 2
    except VmsidecarError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
