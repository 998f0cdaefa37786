"""Issue 21: the CLIs' client commands start fast because they import nothing heavy.

Each entry point runs as its console script under ``python -X importtime``, against a real runtime
started without a spec (no guest boots); the test reads which modules the command imported and
fails on the server (``vmsidecar_runtime.api``, ``aiohttp.web``), the OCI stack, the QEMU backends
(``qemu.qmp``), aiohttp and pydantic (what made ``--help`` take 0.6 to 0.9 s). Each command must still
do its job: exit code and output. bench/cli.py measures the times.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

#: modules a client command must not import (a prefix matches the package and its submodules)
FORBIDDEN = ("vmsidecar_runtime.api", "vmsidecar_runtime.oci", "vmsidecar_runtime.serve", "vmsidecar_runtime.backend",
             "aiohttp", "qemu.qmp", "pydantic", "jumpstarter")
#: what ``vmsidecar-oci``'s argument parser needs: the credential flags, and the host syntax they check
OCI_PARSER = {"vmsidecar_runtime.oci", "vmsidecar_runtime.oci.cli", "vmsidecar_runtime.oci.auth",
              "vmsidecar_runtime.oci.reference"}


def _argv(script: str, module: str) -> list[str]:
    """The console script as installed (what a user runs), else its module."""
    path = Path(sys.executable).with_name(script)
    return [sys.executable, "-X", "importtime", str(path)] if path.exists() else [
        sys.executable, "-X", "importtime", "-m", module]


def _run(script: str, module: str, *args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    result = subprocess.run([*_argv(script, module), *args], capture_output=True, text=True, timeout=60,
                            stdin=subprocess.DEVNULL)
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    result.stderr = "\n".join(line for line in result.stderr.splitlines() if not line.startswith("import time:"))
    return result, imported


def _heavy(imported: set[str], allowed: frozenset[str] | set[str] = frozenset()) -> list[str]:
    return sorted(m for m in imported - allowed if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))


def runtime_cli(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    return _run("vmsidecar-runtime", "vmsidecar_runtime.cli", *args)


def test_the_detector_sees_the_server_in_serve_help() -> None:
    # the control: serve imports the runtime, so an empty list below means the client did not
    result, imported = runtime_cli("serve", "--help")
    assert result.returncode == 0 and "--cache-budget" in result.stdout and "--pull-timeout" in result.stdout
    heavy = _heavy(imported)
    assert "vmsidecar_runtime.serve" in heavy and "vmsidecar_runtime.backend" in heavy and "pydantic" in heavy, heavy
    # the API (aiohttp) loads only once serve runs, in a thread while the guest boots (serve.py)
    assert "aiohttp.web" not in imported and "vmsidecar_runtime.api.server" not in imported, heavy


def test_help_of_every_entry_point_imports_nothing_heavy() -> None:
    result, imported = runtime_cli("--help")
    assert result.returncode == 0 and "wait-ready" in result.stdout and not _heavy(imported), _heavy(imported)
    for command in ("status", "power", "recycle", "pull", "flash", "dump", "wait-ready", "ready", "shutdown",
                    "console"):
        result, imported = runtime_cli(command, "--help")
        assert result.returncode == 0 and "--socket" in result.stdout, (command, result.stderr)
        assert not _heavy(imported), (command, _heavy(imported))
    for args in (["--help"], ["push", "--help"], ["pull", "--help"]):
        result, imported = _run("vmsidecar-oci", "vmsidecar_runtime.oci.cli", *args)
        assert result.returncode == 0 and "usage: vmsidecar-oci" in result.stdout, result.stderr
        assert not _heavy(imported, OCI_PARSER), (args, _heavy(imported, OCI_PARSER))
    result, imported = _run("vmsidecar-shell", "jumpstarter_driver_vmsidecar.local", "--help")
    assert result.returncode == 0 and "--ready-pattern" in result.stdout, result.stderr
    assert not _heavy(imported), _heavy(imported)


def test_the_oci_package_still_exports_its_functions() -> None:
    # its names load on first use; importing the submodule pull first must not make oci.pull a module
    code = ("import types, vmsidecar_runtime.oci.pull, vmsidecar_runtime.oci.push\n"
            "from vmsidecar_runtime.oci import PulledDisk, parse_reference, pull, push, write_layout\n"
            "assert not any(isinstance(x, types.ModuleType) for x in (pull, push, parse_reference, write_layout))\n"
            "assert pull.__module__ == 'vmsidecar_runtime.oci.pull' and PulledDisk.__name__ == 'PulledDisk'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_warm_start_imports_no_registry_stack_and_no_libvirt(tiny_image: Any, tmp_path: Path) -> None:
    # A warm start (file: image in the cache, the qemu backend) and a cold boot's look for a
    # snapshot_source it has none of load neither the registry client (requests, oras: 0.08 s) nor
    # libvirt; the same detector sees the registry once a pull needs it.
    code = """
import asyncio, sys
from pathlib import Path
import vmsidecar_runtime.serve, vmsidecar_runtime.backend.qemu
from vmsidecar_contract.spec import VmSpec
from vmsidecar_runtime.controller import RuntimePaths
from vmsidecar_runtime.controller.disks import Disks
from vmsidecar_runtime.controller.snapshot_ops import SnapshotOps
from vmsidecar_runtime.oci import pull
for _ in range(2):  # the first fills the cache, the second is a warm start's cache hit
    assert pull(sys.argv[1], Path(sys.argv[2])).path.is_file()
root = Path(sys.argv[2])
paths = RuntimePaths(shared=root / "shared", cache=root / "cache", state=root / "state", run=root / "run")
ops = SnapshotOps(paths, Disks(paths))
assert asyncio.run(ops.from_source(VmSpec(image=sys.argv[1]))) is None  # no snapshot_source
if sys.argv[3] == "registry":
    from vmsidecar_runtime.oci.pull import parse_reference, reading
    with reading(parse_reference("registry.invalid/vm/x:1")):
        pass
print(" ".join(sorted(m for m in sys.modules if m.split(".")[0] in ("oras", "requests", "libvirt"))))
"""
    for case in ("file", "registry"):
        done = subprocess.run([sys.executable, "-c", code, f"file:{tiny_image.disk}", str(tmp_path / case), case],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        loaded = done.stdout.split()
        if case == "file":
            assert loaded == [], loaded
        else:
            assert "oras" in loaded and "requests" in loaded and "libvirt" not in loaded, loaded


async def test_client_commands_against_a_runtime_import_nothing_heavy(start_runtime: Any, tmp_path: Path) -> None:
    rt = await start_runtime(None)  # no spec: the runtime serves, no guest boots
    sock = str(rt.socket)
    not_a_disk = tmp_path / "not-a-disk"
    not_a_disk.write_text("hello\n")
    # (argv, exit code, a line of stdout or stderr it must print)
    cases: list[tuple[list[str], int, str]] = [
        (["status"], 0, "phase:      Stopped"),
        (["ready"], 1, "Stopped"),
        (["wait-ready", "--timeout", "1"], 2, "error: VM not Ready after 1 s (phase Stopped)"),
        (["power", "on"], 2, "error: the runtime has no VM spec yet"),
        (["recycle", "--no-boot"], 0, "generation: 1"),
        (["flash", str(not_a_disk)], 2, "error: the flashed image is not a disk image"),
        (["dump", str(tmp_path / "out.qcow2")], 2, "error: the runtime has no VM spec yet"),
        (["pull", "registry.invalid/x:1"], 2, "error: the runtime has no VM spec yet"),
        (["console"], 2, f"error: {rt.shared / 'console.sock'} is not there yet: the runtime serves a console once "
                         "its VM boots (it is Error); power it on first"),
        (["status", "--socket", str(tmp_path / "nowhere.sock")], 2,
         f"error: the vmsidecar runtime is not reachable: {tmp_path / 'nowhere.sock'} does not exist"),
    ]
    result, _ = await asyncio.to_thread(runtime_cli, "status", "--json", "--socket", sock)
    state = json.loads(result.stdout)
    assert (state["phase"], state["generation"]) == ("Stopped", 0) and "timings" in state
    for args, code, needle in cases:
        result, imported = await asyncio.to_thread(runtime_cli, *args, *(["--socket", sock] * ("--socket" not in args)))
        assert result.returncode == code, (args, result.stdout, result.stderr)
        assert needle in result.stdout + result.stderr and "Traceback" not in result.stderr, (args, result.stderr)
        assert not _heavy(imported), (args, _heavy(imported))
    result, imported = await asyncio.to_thread(runtime_cli, "shutdown", "--socket", sock)
    assert result.returncode == 0 and "runtime shutting down" in result.stdout and not _heavy(imported)
    assert await asyncio.to_thread(rt.proc.wait, 30) == 0


def test_serve_pauses_the_collector_only_while_it_starts(tmp_path: Path) -> None:
    # The runtime's start-up runs with the garbage collector paused (cli._pause_collector); a runtime
    # serving for days with it still off would never free a reference cycle. The coroutine that
    # stands in for serve() reports what the event loop runs with: the collector on, and the
    # start-up's objects frozen (the proof that it was paused, then ended).
    code = f"""
import asyncio, gc, sys
from vmsidecar_runtime import cli, serve

async def report(*args, **kwargs):
    print("enabled", gc.isenabled(), "frozen", gc.get_freeze_count())
    return 0

serve.serve = report
sys.exit(cli.main(["serve", "--shared-dir", "{tmp_path / 'shared'}", "--state-dir", "{tmp_path / 'state'}",
                   "--cache-dir", "{tmp_path / 'cache'}"]))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    assert words[:2] == ["enabled", "True"] and int(words[3]) > 10_000, result.stdout
    # a start-up that fails (a spec that is not there) leaves the collector as it found it
    code = f"""
import gc, sys
from vmsidecar_runtime import cli
code = cli.main(["serve", "--spec", "{tmp_path / 'missing.yaml'}", "--shared-dir", "{tmp_path / 'shared'}"])
print(code, gc.isenabled())
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["2", "True"], (result.stdout, result.stderr)
    assert "missing.yaml" in result.stderr, result.stderr
