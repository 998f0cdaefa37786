"""Faults of the processes around a guest, for real (issue 13): the exporter SIGKILLed mid-lease, the
guest kernel panicking, console readers that never read, 50 API clients at once.

QEMU SIGKILLed is tests/test_runtime_lifecycle.py::test_qemu_killed_is_crashed_then_power_on_recovers
(both backends); the runtime SIGKILLed is ::test_runtime_killed_takes_its_qemu_along and
tests/test_faults_disk.py::test_runtime_killed_mid_flash_restarts_on_the_previous_disk.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fixtures.events import collecting
from fixtures.faults import rss_kb, wait_phase
from fixtures.jmp import PIPE_UNTIL, exporter_config, jmp_env, run_shell
from fixtures.runtime import BACKENDS, qemu_pids
from fixtures.waiting import guest_file_says, wait_until, wait_until_async
from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.errors import PROTOCOL_CODES, VmsidecarError, registry
from vmsidecar_contract.process import child_pids
from vmsidecar_images.console import PROMPT, Console

pytestmark = pytest.mark.timeout(600)

MiB = 1 << 20

LEASE_ONE = PIPE_UNTIL + r"""
j vm power on
pipe_until 'secret-2-written' work1.txt '\necho lease1-secret > /data/secret; sync; (sleep 7777 &); echo secret-$((1+1))-written\n'
pkill -KILL -P {pid}; kill -KILL {pid}  # jmp run and the exporter child it forked: nothing of it survives
"""

LEASE_TWO = PIPE_UNTIL + r"""
j vm power on
pipe_until 'check-4-done' check2.txt '\nls /data/secret; ps | grep -c "[s]leep 7777"; echo check-$((2+2))-done\n'
"""


async def test_exporter_killed_mid_lease_the_guest_runs_on_and_the_next_lease_gets_a_fresh_one(
    start_runtime: Any, tiny_image: Any, standalone_exporter: Any, tmp_path: Path
) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})
    client = rt.client()
    await client.wait_ready(240)
    cfg = exporter_config(tmp_path / "exporter.yaml", {"socket": str(rt.socket), "recycle": "InPlaceReuse"})
    first = await asyncio.to_thread(standalone_exporter, cfg)
    [qemu] = qemu_pids(str(rt.state))

    # lease 1 writes a secret, then its exporter is SIGKILLed: no close(), so no recycle from it
    script = "set -euo pipefail\n" + LEASE_ONE.replace("{pid}", str(first.proc.pid))
    shell = subprocess.Popen(["jmp", "shell", *first.shell_args, "--", "bash", "-c", script], cwd=tmp_path,
                             env=jmp_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await asyncio.to_thread(first.proc.wait, 180)  # the lease's own script SIGKILLs its exporter
    finally:
        shell.kill()  # the lease's client cannot end cleanly without its exporter: no need to wait for it
        shell.wait(10)
    assert "secret-2-written" in (tmp_path / "work1.txt").read_text(errors="replace")
    assert first.proc.wait(10) == -9
    state = await client.state()
    assert state.phase.value == "Ready" and state.generation == 0 and state.claimed
    assert qemu_pids(str(rt.state)) == [qemu]  # the guest kept running, untouched

    # the next exporter's lease claims the VM: the runtime recycles the claimed generation first
    second = await asyncio.to_thread(standalone_exporter, cfg)
    result = await asyncio.to_thread(run_shell, second.shell_args, LEASE_TWO, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:] + second.log_text()[-3000:]
    check = (tmp_path / "check2.txt").read_text(errors="replace")
    assert "lease1-secret" not in check and "No such file or directory" in check
    lines = [line.strip() for line in check.replace("\r", "").splitlines()]
    assert "0" in lines and "1" not in lines  # lease 1's process is gone too
    state = await client.state()
    assert state.generation >= 1


async def test_guest_kernel_panic_reboots_clearly_and_a_power_cycle_recovers(
    start_runtime: Any, tiny_image: Any
) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})
    client = rt.client()
    before = await client.wait_ready(240)
    con = await Console.open(rt.shared / "console.sock")
    await con.wake()
    async with collecting(client, ["boot", "phase", "guest.reset", "guest.panicked"]) as events:
        con.writer.write(b"echo c > /proc/sysrq-trigger\n")
        await con.writer.drain()
        await con.expect("Kernel panic", 60)  # the panic is on the console, for whoever watches
        await events.wait_for("boot", 120)
    kinds = [(e["type"], e["data"].get("reason")) for e in events]
    assert ("boot", "guest reboot") in kinds, kinds  # the kernel reboots (panic=-1): a new boot, stated
    state = await client.wait_ready(240)
    assert state.boot == before.boot + 1 and state.generation == before.generation
    await con.expect("VMSIDECAR-READY image=tiny ", 60)
    await con.close()

    # the owner's power cycle after a panic: Ready again
    await client.power("cycle")
    state = await client.wait_ready(240)
    assert state.phase.value == "Ready" and len(qemu_pids(str(rt.state))) == 1


async def test_a_restored_guest_that_reboots_at_once_starts_a_new_boot(start_runtime: Any, tiny_image: Any) -> None:
    """A reboot within a second of a restore is the guest's (a restore runs no firmware, whose own
    resets a power-on coalesces): it starts a new boot, with readiness watched again."""
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M"}
    first = await start_runtime(spec, name="first")
    await first.client().wait_ready(240)
    await first.client().wait_stored()
    assert first.stop() == 0
    rt = await start_runtime(spec, name="second", wait=False)
    await rt.wait_serving()
    client = rt.client()
    con = await Console.open_when_served(rt.shared / "console.sock")
    async with collecting(client, ["boot", "guest.reset"]) as events:
        before = await client.wait_ready(240, poll=0.02)
        assert before.snapshot.boot == "restored", before.snapshot
        restored_at = time.monotonic()
        await con.expect(re.escape(PROMPT), 60)  # the shell the restored boot starts
        con.writer.write(b"echo b > /proc/sysrq-trigger\n")
        await con.writer.drain()
        reset = await events.wait_for("guest.reset", 60)
        reset_after = time.monotonic() - restored_at
        boot = await events.wait_for(lambda e: e["type"] == "boot" and e["data"]["boot"] > before.boot, 60)
    assert boot["data"]["reason"] == "guest reboot", events.kinds()
    state = await client.wait_ready(240)
    assert state.boot == before.boot + 1 and state.generation == before.generation, state
    await con.expect("VMSIDECAR-READY image=tiny ", 60)
    await con.close()
    assert reset["data"]["guest"]
    print(f"the restored guest rebooted {reset_after:.2f} s after Ready")  # 0.21 s here: within the 1 s window


async def test_console_readers_that_never_read_neither_grow_the_runtime_nor_stall_the_guest(
    start_runtime: Any, tiny_image: Any
) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})
    client = rt.client()
    await client.wait_ready(240)
    pid = rt.proc.pid
    # clients that connect and never read a byte: 24 on the flooded console, 4 on the other
    stalled = []
    for path in [rt.shared / "hvc0.sock"] * 24 + [rt.shared / "console.sock"] * 4:
        s = socket.socket(socket.AF_UNIX)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(str(path))
        stalled.append(s)
    cmd = await Console.open(rt.shared / "console.sock")
    await cmd.wake()
    reader = await Console.open(rt.shared / "hvc0.sock")  # the fast console (virtio): the big flood
    await reader.drain_replay()
    base = rss_kb(pid)
    peak = base
    # a flood of a size, not a time: more than a stalled client may hold (below) on any host (a
    # loaded TCG host's guest once wrote 1.3 MiB in 20 s)
    flood = (f"yes {'flood-0123456789abcdef' * 8} | head -c {2 * MiB} > /dev/hvc0; "
             "echo flood-$((6*7))-done\n")
    cmd.writer.write(flood.encode())
    await cmd.writer.drain()
    ended = asyncio.create_task(cmd.expect("flood-42-done", 300))
    received = 0
    started = time.monotonic()
    while not ended.done():
        try:
            chunk = await asyncio.wait_for(reader.reader.read(1 << 16), 5)
        except TimeoutError:
            if ended.done():
                break
            raise AssertionError("the reading client got nothing for 5 s: the guest or the hub stalled") from None
        assert chunk, "the runtime closed the reading client"
        received += len(chunk)
        peak = max(peak, rss_kb(pid))
    await ended  # the guest finished: it was never stalled
    took = time.monotonic() - started
    grew = (peak - base) / 1024
    print(f"flood: {received / MiB:.1f} MiB to the reading client in {took:.1f} s; runtime RSS "
          f"{base / 1024:.1f} -> peak {peak / 1024:.1f} MiB (+{grew:.1f}) with 28 clients not reading")
    # more than a stalled client may hold (1 MiB + socket buffers): each must have been dropped
    assert received > 1.5 * MiB, "the flood was too small to fill the stalled clients' buffers"
    assert grew < 64, f"the runtime grew by {grew:.1f} MiB"
    assert "dropping a client that stopped reading" in rt.log_text()
    await cmd.wake()
    assert "still-here" in await cmd.run("echo still-$((0))here | tr -d 0")
    for s in stalled:
        s.close()
    await reader.close()
    await cmd.close()
    assert (await client.state()).phase.value == "Ready"


#: where a guest's line may start on hvc0: not after a digit. Not ``\b``: the shell hvc0's getty
#: starts may print its prompt after the scrollback was drained, and it ends with the terminal query
#: ESC[6n, glued to the first line (``vm# \x1b[6nL1``, a CI run's "1999 of 2000 lines")
LINE_START = rb"(?<![0-9])"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_console_lines_the_guest_writes_while_the_runtime_is_stalled_are_kept(
    start_runtime: Any, tiny_image: Any, backend: str
) -> None:
    """A runtime that gets no CPU for seconds (a busy node) loses nothing the guest wrote to hvc0
    meanwhile. QEMU drops a virtio console's output when its chardev cannot take it; behind a Unix
    socket that is after ~200 small writes (each costs ~1 KiB of the socket's buffer), where a pipe
    holds 64 KiB of them (the libvirt backend's hvc0 was on a socket: 2,000 lines, most lost)."""
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"}, backend=backend)
    await rt.client().wait_ready(240)
    cmd = await Console.open(rt.shared / "console.sock")
    hvc0 = await Console.open(rt.shared / "hvc0.sock")
    try:
        await cmd.wake()
        await hvc0.drain_replay()
        hvc0.seen.clear()  # the boot's scrollback
        lines = 2000  # ~20 KB, one write each: ten times what a socket holds, a third of a pipe
        # the guest starts writing a second from now, all of it while the runtime is stopped
        await cmd.run(f"(sleep 1; for i in $(seq 1 {lines}); do echo L$i > /dev/hvc0; done; echo sent > /tmp/sent) "
                      ">/dev/null 2>&1 & true")
        os.kill(rt.proc.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(8)  # the loop takes ~2 s under TCG
        finally:
            os.kill(rt.proc.pid, signal.SIGCONT)
        # a loaded host runs the loop slower than the stall lasts (a CI run): the lines after it are kept too
        await wait_until_async(lambda: guest_file_says(cmd, "/tmp/sent", "sent"), 120, "the guest's loop to finish",
                               interval=1)
        await hvc0.expect(LINE_START + rb"L%d\r?\n" % lines, 30)
    finally:
        await hvc0.close()
        await cmd.close()
    got = re.findall(LINE_START + rb"L(\d+)\r?\n", bytes(hvc0.seen))
    first = bytes(hvc0.seen[:80])
    assert [int(n) for n in got] == list(range(1, lines + 1)), f"hvc0 got {len(got)} of {lines} lines; began {first!r}"


#: what each of the 50 clients may do, weighted
ACTIONS = ["state"] * 3 + ["on", "off", "cycle", "flash", "dump", "recycle", "claim"]


@pytest.mark.slow
async def test_fifty_concurrent_clients_power_flash_dump_recycle(
    start_runtime: Any, tiny_image: Any, tiny_b_image: Any, tmp_path: Path
) -> None:
    images = tiny_image.disk.parent.parent
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"},
                             extra_args=["--allow-host-paths", str(images)])
    admin = rt.client()
    ready = await admin.wait_ready(240)
    flashed = {ready.image_digest}
    known = set(registry()) | set(PROTOCOL_CODES)
    outcomes: dict[str, int] = {}
    failures: list[str] = []
    rng = random.Random(13)
    plans = [[rng.choice(ACTIONS) for _ in range(4)] for _ in range(50)]
    most_qemus = 0

    async def one(n: int, plan: list[str]) -> None:
        async with RuntimeClient(rt.socket, timeout=300) as c:
            for i, action in enumerate(plan):
                try:
                    if action == "state":
                        await c.state()
                    elif action in ("on", "off", "cycle"):
                        await c.power(action, graceful=False)
                    elif action == "flash":
                        disk = rng.choice([tiny_image.disk, tiny_b_image.disk])
                        state = await c.flash_reference(f"file:{disk}", power_off=True)
                        flashed.add(state.image_digest)
                    elif action == "dump":
                        size = await c.dump(tmp_path / f"dump-{n}-{i}.qcow2")
                        assert size > 0
                        (tmp_path / f"dump-{n}-{i}.qcow2").unlink()
                    elif action == "recycle":
                        await c.recycle(boot=rng.random() < 0.5)
                    elif action == "claim":
                        await c.claim()
                    outcomes["ok"] = outcomes.get("ok", 0) + 1
                except VmsidecarError as e:
                    outcomes[e.code] = outcomes.get(e.code, 0) + 1
                    if e.code not in known or e.code == "internal_error":
                        failures.append(f"{action}: {e.code}: {e.message}")
                except Exception as e:  # anything else is a failure of the runtime
                    failures.append(f"{action}: {type(e).__name__}: {e}")

    async def count_qemus() -> None:
        nonlocal most_qemus
        while True:
            most_qemus = max(most_qemus, len(qemu_pids(str(rt.state))))
            await asyncio.sleep(0.1)  # a sample every 0.1 s while the clients run: a count over time, no event

    watcher = asyncio.create_task(count_qemus())
    started = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*(one(n, p) for n, p in enumerate(plans))), 420)
    watcher.cancel()
    print(f"50 clients, {sum(len(p) for p in plans)} requests in {time.monotonic() - started:.1f} s: {outcomes}")
    assert not failures, failures
    assert most_qemus <= 1, f"{most_qemus} QEMUs at once"
    assert rt.proc.poll() is None and await admin.healthy()

    # whatever the mix left, one recycle gives a pristine guest on the spec's image, never a mix
    state = await admin.recycle()
    state = await admin.wait_ready(240)
    assert state.image_digest == ready.image_digest and state.image_digest in flashed
    con = await Console.open(rt.shared / "console.sock")
    await con.expect("VMSIDECAR-READY image=tiny ", 60)
    await con.close()
    await wait_phase(admin, "Ready")


@pytest.mark.parametrize("when", ["at_ready", "command_running"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_vmsidecar_shell_ended_by_a_signal_stops_its_runtime_guest_and_command_and_removes_its_files(
    tiny_image: Any, image_cache: Path, sig: signal.Signals, when: str
) -> None:
    """A terminal closed (SIGHUP) or a `kill`/`timeout` (SIGTERM) ended vmsidecar-shell and left its
    runtime, the guest's QEMU and its work directory behind (its `finally` never ran); later, the
    command it ran went on as an orphan, and a signal landing as the exporter's session started
    left the shell waiting on its portal (CI: no exit within 60 s). The signal comes as soon as the
    guest is Ready (the session starting), or once the command runs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMSIDECAR_")}
    env["VMSIDECAR_CACHE_DIR"] = str(image_cache)  # the suite's common key: a restore
    command = ["sleep", f"{random.randint(100000, 999999)}.5"]  # its command line is this test's alone
    shell = subprocess.Popen(
        [sys.executable, "-m", "jumpstarter_driver_vmsidecar.local", "--image", f"file:{tiny_image.disk}",
         "--memory", "256M", "--", *command], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        assert shell.stderr is not None
        lines = []
        while not any("guest ready" in line for line in lines):
            line = shell.stderr.readline()
            assert line, "".join(lines)[-3000:]
            lines.append(line)
        work = Path(re.search(r"\(log (\S+)/runtime\.log\)", "".join(lines)).group(1))  # type: ignore[union-attr]
        assert work.is_dir()
        mine = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline_names(int(pid), str(work))]
        assert len(mine) >= 2, mine  # the runtime and its QEMU
        if when == "command_running":
            wait_until(lambda: _running(command), 60, f"{command} to start in the shell")
        shell.send_signal(sig)
        assert shell.wait(60) != 0
        deadline = time.monotonic() + 30
        while (left := [pid for pid in mine if _cmdline_names(int(pid), str(work))]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"still running after the shell ended: {left}"
        assert not work.exists()
        wait_until(lambda: not _running(command), 10, f"{command} to end with the shell")
    finally:
        if shell.poll() is None:
            shell.kill()
        for pid in _running(command):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_vmsidecar_shell_ended_by_a_signal_ends_its_interactive_bash(
    tiny_image: Any, image_cache: Path, sig: signal.Signals
) -> None:
    """An interactive bash on a terminal ignores SIGTERM: a `kill` of vmsidecar-shell left it
    running on the terminal, over an exporter and a runtime that were gone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMSIDECAR_")}
    env["VMSIDECAR_CACHE_DIR"] = str(image_cache)  # the suite's common key: a restore
    env["SHELL"] = "/bin/bash"
    primary, secondary = os.openpty()
    shell = subprocess.Popen(
        [sys.executable, "-m", "jumpstarter_driver_vmsidecar.local", "--image", f"file:{tiny_image.disk}",
         "--memory", "256M"], env=env, stdin=secondary, stdout=secondary, stderr=secondary, start_new_session=True)
    os.close(secondary)
    seen = b""
    try:
        deadline = time.monotonic() + 240
        while b"guest ready" not in seen and time.monotonic() < deadline:
            if select.select([primary], [], [], 1)[0]:
                seen += os.read(primary, 4096)
        assert b"guest ready" in seen, seen[-3000:]
        bash = wait_until(lambda: [pid for pid in child_pids(shell.pid) if _cmdline_names(pid, "--norc")], 60,
                          "the interactive bash to start")
        shell.send_signal(sig)
        assert shell.wait(60) != 0
        wait_until(lambda: not any(_cmdline_names(pid, "--norc") for pid in bash), 10, f"bash {bash} to end")
    finally:
        if shell.poll() is None:
            shell.kill()
        os.close(primary)


def _running(command: list[str]) -> list[int]:
    """The processes (not zombies) whose command line is exactly ``command``."""
    wanted = "\0".join(command).encode() + b"\0"
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes() == wanted:
                found.append(int(pid))
        except OSError:
            pass
    return found


def _cmdline_names(pid: int, text: str) -> bool:
    """Whether process ``pid`` runs (not a zombie) with ``text`` in its command line."""
    try:
        return text in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
