"""Templated vs full-stream snapshots (issue 23), side by side, tiny and Debian guests.

    uv run python bench/templating.py [--runs 3] [--instances 3] [--guest tiny] [--guest debian] [--tb-size MiB]

Per guest, the two forms interleaved run by run (``VMSIDECAR_SNAPSHOT_FORM``), each run on a fresh
cache of its own:

1. cold start → Ready of one runtime (the image is a ``file:`` one, already in the page cache),
   which captures: ``snapshot.capture_seconds`` (the pause, the save, the seal and the commit) and
   the snapshot's size on disk;
2. recycle → Ready (``POST /v1/vm/recycle`` until ``GET /v1/vm`` says Ready), and recycle → the
   first shell command answered on the serial console (a restored guest's code is retranslated
   by TCG: its first answer comes later than Ready);
3. warm start → Ready: a second runtime on that cache (its first restore hashes the snapshot's
   files, the RAM file included, before QEMU sees them);
4. ``--instances`` runtimes on that cache at once (the first plus warm starts, all restored from
   the one snapshot): RSS and PSS of their QEMU processes, summed (PSS shares the pages several
   processes map: a template's unwritten pages count once over all instances), then the CPU
   their QEMU processes use over ``IDLE_S`` seconds while nobody uses the guests (% of one core,
   summed: what idle instances cost a node).

Prints medians per leg and the ratios templated ÷ stream.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.process import RuntimeProcess, clean_environ
from vmsidecar_images.console import PROMPT, Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
from snapshot import Guest, cpu_seconds, resolve_guest  # bench/ is no package

FORMS = ("templated", "stream")
LEGS = [
    ("cold", "cold start → Ready (the capture follows once the guest settled) (s)"),
    ("capture", "capture (snapshot.capture_seconds)"),
    ("size_mb", "snapshot on disk (MB)"),
    ("recycle", "recycle → Ready (s)"),
    ("warm", "warm start → Ready, a new runtime on the cache (s)"),
    ("first_cmd", "recycle → first shell command answered (s)"),
    ("qemu_rss_mb", "N instances: QEMU RSS, total (MB)"),
    ("qemu_pss_mb", "N instances: QEMU PSS, total (MB)"),
    ("idle_cpu_pct", "N instances, idle: QEMU CPU, total (% of a core)"),
]
#: how long the idle instances' CPU is counted
IDLE_S = 10.0


def _qemu_pids(runtime_pid: int) -> list[int]:
    out = subprocess.run(["ps", "--ppid", str(runtime_pid), "-o", "pid=,comm="], capture_output=True,
                         text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "qemu" in line]


async def _idle_cpu_pct(runtimes: list[RuntimeProcess]) -> float:
    pids = [pid for rt in runtimes for pid in _qemu_pids(rt.proc.pid)]
    before, started = sum(cpu_seconds(pid) for pid in pids), time.monotonic()
    await asyncio.sleep(IDLE_S)
    return (sum(cpu_seconds(pid) for pid in pids) - before) / (time.monotonic() - started) * 100


def _qemu_mem(runtime_pid: int) -> tuple[float, float]:
    """(RSS, PSS) in MB of the runtime's QEMU child, from smaps_rollup."""
    rss = pss = 0
    for pid in _qemu_pids(runtime_pid):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key == "Rss":
                rss += int(rest.split()[0])
            elif key == "Pss":
                pss += int(rest.split()[0])
    return rss / 1024, pss / 1024


async def first_answer(console: Path, started: float, timeout: float) -> float:
    """Seconds from ``started`` until the guest's shell answers a command on ``console``."""
    con = await Console.open(console)
    try:
        # the snapshot is taken at the readiness marker, which the guest may print before its shell
        # runs: what is typed before the prompt is lost, so a newline every 0.2 s until a prompt
        # answers, then one command
        while True:
            con.seen.clear()
            con.writer.write(b"\n")
            try:
                await con.expect(re.escape(PROMPT), 0.2)
                break
            except TimeoutError:
                if time.monotonic() > started + timeout:
                    raise
        await con.run("echo answered", timeout=max(started + timeout - time.monotonic(), 1))
        return time.monotonic() - started
    finally:
        await con.close()


async def one_run(guest: Guest, form: str, instances: int, work: Path, tb_size: int | None) -> dict[str, float]:
    cache = work / "cache"
    env = clean_environ() | {"VMSIDECAR_SNAPSHOT_FORM": form}
    if tb_size is not None:  # TCG's translation cache: private to each QEMU, and KVM has none
        env["VMSIDECAR_TCG_TB_SIZE"] = str(tb_size)
    spec = {"image": f"file:{guest.disk}", "memory": guest.memory}
    started = time.monotonic()
    runtimes = [RuntimeProcess.start(work / "rt0", spec=spec, cache=cache, env=env)]
    try:
        await runtimes[0].wait_ready(guest.timeout, poll=0.02)
        result = {"cold": time.monotonic() - started}
        async with RuntimeClient(runtimes[0].socket) as client:
            snap = (await client.wait_stored(300)).snapshot  # stored just after Ready
        assert snap.form == form and snap.capture_seconds is not None and snap.size, snap
        result |= {"capture": snap.capture_seconds, "size_mb": snap.size / 2**20}
        async with RuntimeClient(runtimes[0].socket) as client:
            started = time.monotonic()
            await client.recycle()
            state = await client.wait_ready(guest.timeout, poll=0.01)
            result["recycle"] = time.monotonic() - started
        assert state.snapshot.boot == "restored", state.snapshot
        result["first_cmd"] = await first_answer(runtimes[0].shared / "console.sock", started, 120)
        started = time.monotonic()
        runtimes.append(RuntimeProcess.start(work / "rt1", spec=spec, cache=cache, env=env))
        state = await runtimes[1].wait_ready(guest.timeout, poll=0.02)
        result["warm"] = time.monotonic() - started  # its first restore hashes the snapshot's files once
        runtimes += [RuntimeProcess.start(work / f"rt{i}", spec=spec, cache=cache, env=env) for i in range(2, instances)]
        for rt in runtimes[1:]:
            state = await rt.wait_ready(guest.timeout)
            assert state.snapshot.boot == "restored", state.snapshot
        await asyncio.sleep(2)  # restored guests settle (vmgenid reseed, timers) before counting pages
        mem = [_qemu_mem(rt.proc.pid) for rt in runtimes]
        result["qemu_rss_mb"] = sum(r for r, _ in mem)
        result["qemu_pss_mb"] = sum(p for _, p in mem)
        result["idle_cpu_pct"] = await _idle_cpu_pct(runtimes)
        return result
    finally:
        for rt in runtimes:
            rt.stop()


async def main_async(args: argparse.Namespace) -> int:
    guests = [g for g in (resolve_guest(name) for name in args.guest or ["tiny"]) if g is not None]
    samples: dict[tuple[str, str, str], list[float]] = {}
    for guest in guests:
        for run in range(args.runs):
            for form in FORMS:
                with tempfile.TemporaryDirectory(prefix="templating-") as work:
                    result = await one_run(guest, form, args.instances, Path(work), args.tb_size)
                print(f"{guest.name} run {run + 1} {form}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()),
                      flush=True)
                for key, value in result.items():
                    samples.setdefault((guest.name, form, key), []).append(value)
    print(f"\nmedians over {args.runs} run(s), {args.instances} instances, load {os.getloadavg()[0]:.1f} at the end"
          + (f", TCG tb-size {args.tb_size} MiB" if args.tb_size is not None else ""))
    print(f"{'guest':<8}{'leg':<46}{'templated':>11}{'stream':>11}{'ratio':>8}")
    for guest in guests:
        for key, label in LEGS:
            t = statistics.median(samples[(guest.name, "templated", key)])
            s = statistics.median(samples[(guest.name, "stream", key)])
            print(f"{guest.name:<8}{label:<46}{t:>11.3f}{s:>11.3f}{t / s if s else float('nan'):>8.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--guest", action="append", choices=["tiny", "debian"])
    parser.add_argument("--tb-size", type=int, help="TCG translation cache, MiB (VMSIDECAR_TCG_TB_SIZE; default the runtime's)")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
