"""``vmsidecar-shell``: a VM and a ``jmp shell`` on it, on a developer's machine, no container engine.

Starts ``vmsidecar-runtime serve`` as a child process on a private shared directory, waits until
the guest is Ready, then does what ``jmp shell --exporter-config`` does (serve the exporter
config on a local socket, ``launch_shell``) with a ``VirtualMachine`` driver exported as ``vm``.
``-- COMMAND`` runs a command in that shell instead of an interactive one, and its exit code is
ours: jumpstarter 0.9.0's ``jmp shell --exporter-config`` drops it and always exits 0. When the
shell ends, the runtime and the guest are stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vmsidecar_contract.errors import VmsidecarError
from vmsidecar_contract.process import RuntimeProcess, RuntimeStartError, child_pids

if TYPE_CHECKING:
    from vmsidecar_contract.client import RuntimeClient

#: the largest readiness timeout a spec or image may set (seconds)
MAX_READY_TIMEOUT = 3600.0
#: seconds allowed for pulling the image before the readiness timeout starts
PULL_ALLOWANCE = 600.0


def _exporter_config(path: Path, socket: Path, recycle: str) -> Path:
    import yaml  # here and below: --help and argument errors answer without jumpstarter, aiohttp, yaml

    path.write_text(yaml.safe_dump({
        "apiVersion": "jumpstarter.dev/v1alpha1",
        "kind": "ExporterConfig",
        "metadata": {"namespace": "default", "name": "vmsidecar-local"},
        "endpoint": "",
        "token": "",
        "export": {"vm": {"type": "jumpstarter_driver_vmsidecar.driver.VirtualMachine",
                          "config": {"socket": str(socket), "recycle": recycle}}},
    }))
    return path


def _in_container() -> bool:
    return Path("/run/.containerenv").exists() or Path("/.dockerenv").exists()


def tcg_notice(reason: str | None, in_container: bool) -> str:
    """The one line that says the guest runs without KVM, and how to get KVM."""
    how = ("pass the device: podman run --device /dev/kvm … (docker run --device /dev/kvm …)" if in_container
           else "use a host with working KVM (/dev/kvm, CPU flag vmx or svm; your user in group kvm)")
    return f"vmsidecar: the guest runs on TCG, without KVM, so it is slower ({reason or 'no KVM'}); for KVM {how}"


async def _say_accel(client: RuntimeClient, deadline: float) -> None:
    """Once the runtime has chosen the accelerator: one line on stderr when it is TCG."""
    while time.monotonic() < deadline:
        state = await client.state()
        if state.accel is not None:
            if state.accel == "tcg":
                print(tcg_notice(state.accel_reason, _in_container()), file=sys.stderr)
            return
        if state.phase.value in ("Ready", "Error", "Crashed"):
            return
        await asyncio.sleep(0.2)


async def _wait_ready(runtime: RuntimeProcess, timeout: float) -> float:
    started = time.monotonic()
    try:
        await runtime.wait_serving()
    except RuntimeStartError as e:
        raise SystemExit(f"error: {e}") from None
    from vmsidecar_contract.client import RuntimeClient

    async with RuntimeClient(runtime.socket) as client:
        try:
            await _say_accel(client, started + timeout)
            await client.wait_ready(timeout)
        except VmsidecarError as e:
            raise SystemExit(f"error: {e.message}") from None
    return time.monotonic() - started


def build_parser() -> argparse.ArgumentParser:
    """Arguments (exposed for docs)."""
    p = argparse.ArgumentParser(prog="vmsidecar-shell", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image", help="image reference (OCI, oci-layout:DIR[:TAG], file:PATH)")
    p.add_argument("--spec", help="VM spec file (YAML/JSON) instead of --image")
    p.add_argument("--memory", default=None)
    p.add_argument("--cpus", type=int, default=None)
    p.add_argument("--cpu", metavar="MODEL", help="QEMU CPU model (default host under KVM, max under TCG)")
    p.add_argument("--snapshot-source", metavar="REGISTRY/REPO",
                   help="start from the snapshot artifact published there (vmsidecar-oci snapshot push) when "
                        "the local cache has none: Ready without booting")
    p.add_argument("--recycle", choices=["ExitAndReplace", "InPlaceReuse"], default="ExitAndReplace")
    p.add_argument("--ready-pattern", metavar="REGEX",
                   help="regex on the console that makes the guest Ready ('' = as soon as it runs); default: the "
                        "image's io.vmsidecar.readiness.pattern, else VMSIDECAR-READY, a login or a shell prompt")
    p.add_argument("--ready-console", choices=["ttyS0", "hvc0"], help="console the pattern appears on")
    p.add_argument("--ready-timeout", type=float, metavar="SECONDS",
                   help="seconds from power-on until the guest must be Ready (default: the image's, else 300)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, overlay) afterwards")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND to run in the shell")
    return p


#: what ends the shell as its own end would: a `kill` or `timeout` (SIGTERM), the terminal closed (SIGHUP)
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@dataclass
class _EndBySignal:
    """The handler of :data:`ENDING_SIGNALS`: ends what the shell started, then the process.

    It does the ending itself instead of raising into whatever the main thread runs: an exception
    raised inside anyio's portal as the exporter's session starts can leave the shell waiting on the
    portal's thread for good (seen in CI: no exit within 60 s, the runtime never told to stop). In
    order: the command the shell runs gets the same signal (it would go on as an orphan), the
    runtime stops its guest, what is left of the command gets SIGHUP (an interactive bash ignores
    SIGTERM), the work directory and the exporter's socket go, and the process exits with 128 + the
    signal's number.
    """

    runtime: RuntimeProcess
    work: Path
    keep: bool
    #: the exporter's socket, once it serves
    session_socket: Path | None = None

    def __call__(self, signum: int, _frame: object) -> None:
        for ending in ENDING_SIGNALS:  # a second signal must not cut the ending short
            signal.signal(ending, signal.SIG_IGN)
        self._signal_command(signum)
        self.runtime.stop_in_handler()
        # the session is over, as when a terminal closes: an interactive bash ignores SIGTERM
        self._signal_command(signal.SIGHUP)
        if not self.keep:
            shutil.rmtree(self.work, ignore_errors=True)
        if self.session_socket is not None:
            _remove_socket(self.session_socket)
        os._exit(128 + signum)

    def _signal_command(self, signum: int) -> None:
        """``signum`` to the shell or command ``launch_shell`` started (every child but the runtime)."""
        for pid in child_pids(os.getpid()):
            if pid != self.runtime.proc.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)


def _remove_socket(path: Path) -> None:
    """The exporter's socket, and the directory jumpstarter made for it (``TemporarySocket``:
    ``jumpstarter-*``) if nothing else is in it."""
    with contextlib.suppress(OSError):
        path.unlink()
    if path.parent.name.startswith("jumpstarter-"):
        with contextlib.suppress(OSError):
            path.parent.rmdir()


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.image and not args.spec:
        print("error: give --image REF or --spec FILE (./scripts/run passes the tiny guest)", file=sys.stderr)
        return 2
    if importlib.util.find_spec("vmsidecar_runtime") is None:
        print("error: vmsidecar-shell starts the runtime as a local process, and vmsidecar-runtime is not "
              "installed here; install jumpstarter-driver-vmsidecar[local] (or run it from a checkout: ./scripts/run)",
              file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="vmsidecar-local-"))
    options: list[str] = []
    for flag, value in (("--image", args.image), ("--memory", args.memory), ("--cpus", args.cpus),
                        ("--cpu", args.cpu), ("--snapshot-source", args.snapshot_source),
                        ("--ready-pattern", args.ready_pattern), ("--ready-console", args.ready_console),
                        ("--ready-timeout", args.ready_timeout)):
        if value is not None:
            options += [flag, str(value)]
    try:
        runtime = RuntimeProcess.start(work, spec=Path(args.spec) if args.spec else None, args=options)
    except RuntimeStartError as e:
        shutil.rmtree(work, ignore_errors=True)
        print(f"error: {e}", file=sys.stderr)
        return 2
    shared, log = runtime.shared, runtime.log
    ending = _EndBySignal(runtime, work, args.keep)
    for signum in ENDING_SIGNALS:
        signal.signal(signum, ending)
    try:
        print(f"vmsidecar: booting the guest (log {log}) …", file=sys.stderr)
        # the runtime enforces the readiness timeout (the guest goes to Error); ours only adds the pull
        wait = (args.ready_timeout or MAX_READY_TIMEOUT) + PULL_ALLOWANCE
        seconds = asyncio.run(_wait_ready(runtime, wait))
        print(f"vmsidecar: guest ready in {seconds:.1f} s; try `j vm console start-console` "
              "(Ctrl-B three times to leave), `j vm power cycle`, `j vm storage flash FILE`", file=sys.stderr)
        from jumpstarter.common.utils import launch_shell
        from jumpstarter.config.exporter import ExporterConfigV1Alpha1

        config = ExporterConfigV1Alpha1.load_path(
            _exporter_config(work / "exporter.yaml", shared / "api.sock", args.recycle))
        os.environ["PATH"] = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"  # `j` for the shell
        os.environ["VMSIDECAR_SHARED_DIR"] = str(shared)  # `vmsidecar-runtime status` in the shell finds this VM
        with config.serve_unix() as path:
            ending.session_socket = Path(path)
            return launch_shell(path, "vmsidecar", allow=[], unsafe=True, use_profiles=False,
                                command=tuple(command) or None)
    except KeyboardInterrupt:
        return 130
    finally:
        runtime.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
