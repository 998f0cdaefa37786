"""The exporter image's single-process ``jmp run`` (``jumpstarter_driver_vmsidecar.exporter_run``):
both recycle strategies through real leases against the in-test controller, standalone TCP with a
real ``jmp shell``, one process where ``jmp run`` has two, and without the CLI's kubernetes imports."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fixtures.jmp import RUNNER, VM_TYPE, exporter_config, jmp_env, start_runner, wait_listening
from fixtures.ports import free_port
from fixtures.waiting import wait_until

pytestmark = pytest.mark.timeout(600)


def _children(pid: int) -> list[str]:
    out = subprocess.run(["ps", "--ppid", str(pid), "-o", "comm="], capture_output=True, text=True).stdout
    return out.split()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_runner_does_not_import_the_cli_admin_commands() -> None:
    code = ("import sys, jumpstarter_driver_vmsidecar.exporter_run as r, jumpstarter_cli.run, "
            "jumpstarter.config.exporter, jumpstarter_driver_vmsidecar.driver; "
            "print(sum(m.startswith('kubernetes_asyncio') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0"
    # the real `jmp` does import it: the reason for this runner (fails if jumpstarter changes that)
    code = "import sys, jumpstarter_cli.jmp; print(sum(m.startswith('kubernetes_asyncio') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out) > 100


async def test_standalone_one_process_serves_jmp_shell_and_stops_on_sigterm(
    start_runtime: Any, tiny_image: Any, tmp_path: Path
) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})
    cfg = exporter_config(tmp_path / "exporter.yaml", {"socket": str(rt.socket), "recycle": "InPlaceReuse"})
    port = free_port()
    proc = start_runner(["--exporter-config", str(cfg), "--tls-grpc-listener", f"127.0.0.1:{port}",
                   "--tls-grpc-insecure"], jmp_env(), tmp_path / "runner.log")
    try:
        await rt.client().wait_ready(180)
        await asyncio.to_thread(wait_listening, proc, port, tmp_path / "runner.log")
        shell = await asyncio.to_thread(
            subprocess.run, ["jmp", "shell", "--tls-grpc", f"127.0.0.1:{port}", "--tls-grpc-insecure", "--",
                             "j", "vm", "power", "read"],
            env=jmp_env(), capture_output=True, text=True, timeout=120)
        log = (tmp_path / "runner.log").read_text(errors="replace")
        assert shell.returncode == 0, shell.stderr[-2000:] + log[-2000:]
        assert proc.poll() is None and _children(proc.pid) == [], log[-2000:]  # no supervising fork
        rss = _rss_mb(proc.pid)
        print(f"\nsingle-process exporter RSS after a session: {rss:.0f} MB")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_exit_and_replace_under_a_controller_exits_0_after_the_lease(
    start_runtime: Any, tiny_image: Any, jmpctl: Any, tmp_path: Path
) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})
    await rt.client().wait_ready(180)
    cfg = jmpctl.exporter_config({"vm": {"type": VM_TYPE, "config": {"socket": str(rt.socket)}}})
    log = tmp_path / "runner.log"
    proc = start_runner(["--exporter-config", str(cfg)], jmpctl.env(), log)
    try:
        await asyncio.to_thread(jmpctl.wait_status, "vm", "AVAILABLE", 60)
        assert _children(proc.pid) == []
        with jmpctl.lease("vm") as lease:
            result = await asyncio.to_thread(subprocess.run, lease.argv("j", "vm", "power", "read"), env=lease.env,
                                             capture_output=True, text=True, timeout=120)
            assert result.returncode == 0, result.stderr[-2000:] + log.read_text(errors="replace")[-2000:]
        released = lease.released_at
        assert await asyncio.to_thread(proc.wait, 60) == 0, log.read_text(errors="replace")[-3000:]
        assert await asyncio.to_thread(rt.proc.wait, 60) == 0, rt.log_text()[-3000:]
        assert "AVAILABLE" not in [s for t, s in jmpctl.status_log("vm") if t > released]
        print(f"\nExitAndReplace, single process: release→exit {time.monotonic() - released:.2f} s")
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_in_place_reuse_under_a_controller_stays_for_the_next_lease(
    start_runtime: Any, tiny_image: Any, jmpctl: Any, tmp_path: Path
) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})
    await rt.client().wait_ready(180)
    cfg = jmpctl.exporter_config({"vm": {"type": VM_TYPE, "config": {"socket": str(rt.socket),
                                                                       "recycle": "InPlaceReuse"}}})
    log = tmp_path / "runner.log"
    proc = start_runner(["--exporter-config", str(cfg)], jmpctl.env(), log)
    try:
        await asyncio.to_thread(jmpctl.wait_status, "vm", "AVAILABLE", 60)
        for _ in range(2):
            with jmpctl.lease("vm") as lease:
                result = await asyncio.to_thread(subprocess.run, lease.argv("j", "vm", "power", "read"),
                                                 env=lease.env, capture_output=True, text=True, timeout=120)
                assert result.returncode == 0, result.stderr[-2000:] + log.read_text(errors="replace")[-2000:]
            await asyncio.to_thread(jmpctl.wait_status, "vm", "AVAILABLE", 60, lease.released_at)
        assert proc.poll() is None and _children(proc.pid) == [], log.read_text(errors="replace")[-2000:]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_sigterm_while_the_driver_tree_is_built_stops_it_and_leaves_no_temporary_socket(tmp_path: Path) -> None:
    """jumpstarter_cli 0.9.0's ``_handle_child`` starts its signal receiver at its first await, after the
    exporter made its temporary sockets' directory and while it builds the driver tree: a SIGTERM there
    (a pod deleted as it starts; test_dashboard stops an exporter once its metrics answer) took the
    default action, and each left an empty ``jumpstarter-*`` directory in /tmp."""
    sockets, marker, log = tmp_path / "run", tmp_path / "building", tmp_path / "runner.log"
    sockets.mkdir()
    cfg = exporter_config(tmp_path / "exporter.yaml", {"marker": str(marker)}, driver="fixtures.slow_driver.SlowToBuild")
    env = jmp_env() | {"XDG_RUNTIME_DIR": str(sockets), "PYTHONPATH": str(Path(__file__).parent)}
    proc = start_runner(["--exporter-config", str(cfg), "--tls-grpc-listener", f"127.0.0.1:{free_port()}",
                         "--tls-grpc-insecure"], env, log)
    try:
        def building() -> bool:
            return (marker.exists() and any(sockets.glob("jumpstarter-*"))) or proc.poll() is not None

        wait_until(building, 60, "the exporter to build its driver tree", detail=lambda: log.read_text(errors="replace"))
        assert proc.poll() is None, log.read_text(errors="replace")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text(errors="replace")
    assert code == 0 and "exporter stopped by SIGTERM" in text, (code, text[-3000:])
    assert list(sockets.iterdir()) == [], text[-3000:]


def test_other_subcommands_go_to_jmp(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "jumpstarter_driver_vmsidecar.exporter_run", "version"],
                         env=jmp_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "0.9.0" in out.stdout + out.stderr, out
    bad = subprocess.run([*RUNNER, "--exporter-config", "x.yaml", "--tls-grpc-listener", "1234"], env=jmp_env(),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "requires either --tls-grpc-insecure" in bad.stderr
