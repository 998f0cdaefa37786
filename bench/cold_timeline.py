"""Cold start timeline: where a cold start spends what the bare QEMU boot does not, run by run.

    uv run python bench/cold_timeline.py [--runs 5] [--guest tiny|debian]
    uv run python bench/cold_timeline.py --spawn-only [--runs 15]

    uv run python bench/cold_timeline.py --running [--runs 5] [--guest tiny|debian]
    uv run python bench/cold_timeline.py --before /tmp/old-checkout [--runs 9]   # before/after, in turn

``--before DIR`` runs the cold starts of another checkout's runtime (its ``runtime/src`` and
``contract/src`` first on ``PYTHONPATH``, same venv) and of this one beside bare boots, which goes
first rotating, and prints each's median to Ready and this ÷ before.

``--running`` times the cold boots a runtime already serving makes (``snapshot: off``, or a flashed
disk, which is never captured): ``power on`` → Ready, the guest off before each, against a bare boot
in the same alternation; the process's start (its imports, the pull) is paid once per pod, not per boot.

``--spawn-only`` times the runtime's fixed cost alone, free of the guest's boot: ``serve`` on a
fresh cache until its API answers (it binds after QEMU is spawned), then QEMU's start from
``/proc``; no boot is awaited. Its median moves with the code, not with the guest's kernel under TCG.
With it, the steps of the runtime's JSON log from its event loop's start (after the interpreter and
its imports) to the guest running: to the pull, the pull, the overlay, QEMU's launch to ``cont``.

Each run boots the guest bare (as ``bench/snapshot.py``'s first leg) and with ``serve`` on a
fresh cache (its second leg), in turn first, and prints for the latter: when its QEMU was spawned (from
``/proc``, after the process started), the pull, QEMU launch → marker (``timings.ready``), the
guest's own uptime in its marker line (``VMSIDECAR-READY … uptime=``, which both boots print:
equal uptimes put a difference before the guest's kernel, or outside the guest), the capture's
pause (``snapshot.capture_seconds``) and start → Ready; then the medians, their ratio and the median
of each run's own ratio (its two boots back to back), then the ratio taken apart: the runtime's own
time (start → QEMU spawned, plus the pause) ÷ the bare boot, and launch → marker ÷ bare. The
capture comes after Ready once the guest settled (or at a claim: it then waits for the pause), so
the ratio "capture included" adds the pause to start → Ready: what a claim at Ready waits for.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from bytecode import compile_sources  # bench/ is no package
from snapshot import MARKER, Guest, bare_argv, cpu_seconds, minor_faults, resolve_guest
from trees import tree_pythonpath, with_pythonpath

from vmsidecar_contract.arch import host_arch
from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.process import RuntimeProcess, clean_environ
from vmsidecar_images.console import Console
from vmsidecar_runtime.accel import AccelChoice, choose_accel

#: the number and what follows it (" boot=…"): a read of the console can end inside the number
#: ("uptime=2" of 22.13: a bare Debian boot's uptime read as 2.00 s in one of eleven, 2026-12-02)
UPTIME = re.compile(rb"VMSIDECAR-READY image=\S+ uptime=([0-9.]+)\s")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def _child_qemu_start(parent: int) -> float | None:
    """When the guest's ``qemu-system-*`` child of ``parent`` started (seconds since boot), if there
    is one (not the ``qemu-system-* --version`` the runtime asks meanwhile)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        comm, rest = stat[stat.find("(") + 1:stat.rfind(")")], stat[stat.rfind(")") + 2:].split()
        if comm.startswith("qemu-system") and int(rest[1]) == parent and b"--version" not in argv:
            return int(rest[19]) / CLOCK_TICKS
    return None


class BareBoot(NamedTuple):
    """A bare boot to the marker: its seconds, the guest's uptime in the marker, QEMU's CPU seconds
    and minor page faults by then."""

    seconds: float
    uptime: float
    cpu: float
    minor_faults: int


async def bare(guest: Guest, accel: AccelChoice, work: Path, extra_argv: Sequence[str] = (),
               pass_fds: Sequence[int] = ()) -> BareBoot:
    """Boot the guest on plain QEMU (``bare_argv``, plus ``extra_argv``) to its marker."""
    work.mkdir(parents=True)
    overlay = work / "overlay.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(guest.disk), "-F", "qcow2",
                    str(overlay)], check=True)
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(*bare_argv(guest, accel, overlay), *extra_argv,
                                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                stderr=subprocess.DEVNULL, pass_fds=pass_fds)
    assert proc.stdout is not None
    seen = b""
    try:
        async with asyncio.timeout(guest.timeout):
            while (found := UPTIME.search(seen)) is None:
                chunk = await proc.stdout.read(4096)
                if not chunk:
                    raise RuntimeError("QEMU ended before its marker")
                seen = seen[-4096:] + chunk
        seconds = time.monotonic() - started
        return BareBoot(seconds, float(found.group(1)), cpu_seconds(proc.pid), minor_faults(proc.pid))
    finally:
        proc.kill()
        await proc.wait()


async def _marker_uptime(console: Path, timeout: float) -> float:
    """The guest's uptime in its marker's line, from a console socket's scrollback and what follows."""
    con = await Console.open(console)
    try:
        return float((await con.expect(UPTIME.pattern, timeout)).group(1))
    finally:
        await con.close()


async def _ready_by_events(rt: RuntimeProcess, timeout: float) -> None:
    """Until the guest is Ready, told by the event stream: a client polling ``GET /v1/vm`` every 20 ms
    made the runtime answer 50 requests a second while the guest booted, which the bare boot is
    spared (the stream's first line says the phase it started in)."""
    async with asyncio.timeout(timeout):
        await rt.wait_serving(timeout, poll=0.02)
        async with RuntimeClient(rt.socket) as client, contextlib.aclosing(client.events(["phase"])) as events:
            await _until_ready(events, lambda: rt.log_text()[-2000:])


async def _until_ready(events: AsyncIterator[dict[str, Any]], log_tail: Callable[[], str]) -> None:
    """Read phase events until Ready; Error or Crashed is an error (with ``log_tail()``)."""
    async for event in events:
        phase = event["data"]["phase"]
        if phase == "Ready":
            return
        if phase in ("Error", "Crashed"):
            raise RuntimeError(f"the guest went {phase} instead of Ready; {log_tail()}")
    raise RuntimeError("the event stream ended before Ready")


def _cold_spec(guest: Guest) -> dict[str, object]:
    """The spec both cold legs give ``serve``: the guest's disk as a ``file:`` image, Ready at its marker."""
    return {"image": f"file:{guest.disk}", "memory": guest.memory, "readiness": {"pattern": MARKER.decode()}}


async def cold(guest: Guest, work: Path, pythonpath: str | None = None) -> dict[str, float]:
    """One cold start to Ready (``pythonpath``: another tree's runtime, ``trees.tree_pythonpath``)."""
    spec = _cold_spec(guest)
    cache = work / "cache"
    env = with_pythonpath(clean_environ(), pythonpath) if pythonpath else None
    started, since_boot = time.monotonic(), _uptime()
    with RuntimeProcess.start(work, spec=spec, cache=cache, args=["--grace", "5"], env=env) as rt:
        await _ready_by_events(rt, guest.timeout)
        total = time.monotonic() - started
        # read once the guest is Ready, from its start time in /proc: a poll of /proc while the
        # runtime starts took half of a core from it (of two) and delayed its QEMU by that
        spawned = _child_qemu_start(rt.proc.pid)
        async with RuntimeClient(rt.socket) as client:
            state = await client.wait_stored()
        # the live console, not the capture's copy of it: that ends where the guest was paused,
        # which can be inside the marker's line (its readiness pattern matches from the first digit)
        uptime = await _marker_uptime(rt.socket.parent / "console.sock", guest.timeout)
    return {"spawn": (spawned - since_boot) if spawned else float("nan"), "pull": state.timings.pull or 0.0,
            "ready": state.timings.ready or 0.0, "uptime": uptime,
            "capture": state.snapshot.capture_seconds or 0.0, "total": total}


async def pair(guest: Guest, accel: AccelChoice, work: Path, i: int) -> tuple[BareBoot, dict[str, float]]:
    """The ``i``-th pair of a bare boot and a cold start; which goes first alternates with ``i``, so
    neither always inherits the other's page cache, and each starts with no earlier boot's files
    being written back."""
    os.sync()
    cold_first = await cold(guest, work / f"cold-{i}") if i % 2 else None
    os.sync()
    bare_boot = await bare(guest, accel, work / f"bare-{i}")
    os.sync()
    return bare_boot, cold_first or await cold(guest, work / f"cold-{i}")


async def power_on_to_ready(client: RuntimeClient, timeout: float) -> tuple[float, float, float]:
    """Seconds from ``power on`` (the guest off) to Ready, told by the event stream; then from it to the
    boot's start (``timings.launched_at``: before its overlay and QEMU's spawn), and from that to the marker
    (``timings.ready``)."""
    async with asyncio.timeout(timeout), contextlib.aclosing(client.events(["phase"])) as events:
        first = await anext(events)  # the stream is open: no phase change can be missed
        assert first["data"]["phase"] == "Stopped", first
        started, wall = time.monotonic(), time.time()
        await client.power("on")
        await _until_ready(events, lambda: "")
        total = time.monotonic() - started
    timings = (await client.state()).timings
    assert timings.launched_at is not None and timings.ready is not None, timings
    return total, timings.launched_at - wall, timings.ready


async def main_running(runs: int, name: str) -> None:
    compile_sources()
    guest = resolve_guest(name)
    assert guest is not None
    accel = choose_accel("auto", host_arch())
    bares: list[float] = []
    boots: list[tuple[float, float, float]] = []
    with tempfile.TemporaryDirectory(prefix="bench-running-") as tmp:
        spec = {**_cold_spec(guest), "snapshot": "off"}
        with RuntimeProcess.start(Path(tmp) / "rt", spec=spec, args=["--grace", "5"]) as rt:
            await _ready_by_events(rt, guest.timeout)
            async with RuntimeClient(rt.socket) as client:
                for i in range(runs):
                    await client.power("off", graceful=False)  # (the bare boot runs beside no guest)
                    for leg in ("bare", "running") if i % 2 == 0 else ("running", "bare"):
                        os.sync()
                        if leg == "bare":
                            bares.append((await bare(guest, accel, Path(tmp) / f"bare-{i}")).seconds)
                        else:
                            boots.append(await power_on_to_ready(client, guest.timeout))
                            await client.power("off", graceful=False)
                    total, launch, ready = boots[-1]
                    print(f"run {i + 1}: bare {bares[-1]:.2f} s; power on → Ready {total:.2f} s = "
                          f"{total / bares[-1]:.2f}x (the boot began at {launch:.3f} s, then the marker at {ready:.2f})",
                          flush=True)
    med = [statistics.median(b[k] for b in boots) for k in range(3)]
    paired = statistics.median(b[0] / a for a, b in zip(bares, boots, strict=True))
    print(f"\nmedians of {runs}: bare {statistics.median(bares):.2f} s, power on → Ready {med[0]:.2f} s = "
          f"{med[0] / statistics.median(bares):.2f}x; median of the runs' own ratios {paired:.2f}x; the boot began "
          f"{med[1]:.3f} s after power on (timings.launched_at: before the overlay and the spawn), the marker "
          f"{med[2]:.2f} s after that (timings.ready)")


#: the runtime's log lines (``--log-format json --log-level debug``) that mark ``--spawn-only``'s steps
STEPS = (("loop", "Using selector"), ("pull", "phase Stopped -> Pulling"), ("pulled", "phase Pulling -> Stopped"),
         ("launch", "starting qemu"), ("running", "phase Starting -> Running"))


def _steps(log: str) -> dict[str, float]:
    """When each of :data:`STEPS` was logged (the epoch), the first time."""
    found: dict[str, float] = {}
    for line in log.splitlines():
        if not line.startswith("{"):
            continue
        entry = json.loads(line)
        for key, start in STEPS:
            if key not in found and entry["message"].startswith(start):
                found[key] = entry["time"]
    return found


async def spawn_only(guest: Guest, work: Path) -> dict[str, float]:
    """Seconds from ``serve``'s start to its QEMU's spawn (the runtime's fixed cost before the boot),
    and the steps of its log from its event loop's start: to the pull, the pull, to QEMU's launch
    (the overlay), the launch to the guest running (QEMU's start, QMP, ``cont``)."""
    spec = _cold_spec(guest)
    since_boot = _uptime()
    args = ["--grace", "1", "--log-format", "json", "--log-level", "debug"]
    with RuntimeProcess.start(work, spec=spec, cache=work / "cache", args=args) as rt:
        await rt.wait_serving(guest.timeout, poll=0.02)
        spawned = _child_qemu_start(rt.proc.pid)
        steps = _steps(rt.log_text())
    if spawned is None or len(steps) != len(STEPS):
        raise RuntimeError(f"no QEMU child or not every step logged once the API answered; {rt.log_text()[-2000:]}")
    return {"spawn": spawned - since_boot, "to_pull": steps["pull"] - steps["loop"],
            "pull": steps["pulled"] - steps["pull"], "overlay": steps["launch"] - steps["pulled"],
            "launch": steps["running"] - steps["launch"], "loop_to_running": steps["running"] - steps["loop"]}


async def main_spawn_only(runs: int, name: str) -> None:
    compile_sources()
    guest = resolve_guest(name)
    assert guest is not None
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-spawn-") as tmp:
        for i in range(runs):
            os.sync()
            rows.append(await spawn_only(guest, Path(tmp) / f"run-{i}"))
            r = rows[-1]
            print(f"run {i + 1}: QEMU spawned {r['spawn']:.3f} s after the start; from the event loop's start: "
                  f"the pull begun {r['to_pull']:.3f} s, the pull {r['pull']:.3f}, to QEMU's launch {r['overlay']:.3f}, "
                  f"launch → guest running {r['launch']:.3f}: {r['loop_to_running']:.3f} s", flush=True)
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    spawns = [r["spawn"] for r in rows]
    print(f"\nmedians of {runs}: QEMU spawned {med['spawn']:.3f} s after the start (min {min(spawns):.3f}, max "
          f"{max(spawns):.3f}; /proc's clock has {1 / CLOCK_TICKS:.2f} s ticks); the event loop's start → the guest "
          f"running {med['loop_to_running']:.3f} s (to the pull {med['to_pull']:.3f}, the pull {med['pull']:.3f}, "
          f"the overlay {med['overlay']:.3f}, QEMU's launch to running {med['launch']:.3f})")


async def main_before(runs: int, name: str, before: Path) -> None:
    """Bare boots and cold starts of another checkout's runtime and of this one, in turn (which goes
    first rotating), to Ready: the change's effect on the cold start beside the guest's spread."""
    compile_sources()
    guest = resolve_guest(name)
    assert guest is not None
    accel = choose_accel("auto", host_arch())
    old = tree_pythonpath(before.resolve())
    legs = ("bare", "before", "this")
    rows: dict[str, list[float]] = {leg: [] for leg in legs}
    with tempfile.TemporaryDirectory(prefix="bench-cold-before-") as tmp:
        for i in range(runs):
            for leg in legs[i % 3:] + legs[:i % 3]:
                os.sync()
                work = Path(tmp) / f"{leg}-{i}"
                if leg == "bare":
                    rows[leg].append((await bare(guest, accel, work)).seconds)
                else:
                    rows[leg].append((await cold(guest, work, old if leg == "before" else None))["total"])
            print(f"run {i + 1}: bare {rows['bare'][-1]:.2f} s, cold start → Ready before {rows['before'][-1]:.2f} s, "
                  f"this {rows['this'][-1]:.2f} s", flush=True)
    med = {leg: statistics.median(rows[leg]) for leg in legs}
    paired = statistics.median(t / b for t, b in zip(rows["this"], rows["before"], strict=True))
    print(f"\nmedians of {runs}: bare {med['bare']:.2f} s, cold start → Ready before {med['before']:.2f} s "
          f"({med['before'] / med['bare']:.2f}x bare), this {med['this']:.2f} s ({med['this'] / med['bare']:.2f}x "
          f"bare); this ÷ before {med['this'] / med['before']:.3f} (median of the runs' own {paired:.3f})")


async def main(runs: int, name: str) -> None:
    compile_sources()
    guest = resolve_guest(name)
    assert guest is not None
    accel = choose_accel("auto", host_arch())
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as tmp:
        for i in range(runs):
            bare_boot, cold_start = await pair(guest, accel, Path(tmp), i)
            seconds, uptime = bare_boot.seconds, bare_boot.uptime
            row = {"bare": seconds, "bare_uptime": uptime, **cold_start}
            rows.append(row)
            print(f"run {i + 1}: bare {seconds:.2f} s (guest uptime {uptime:.2f}); cold: QEMU spawned at "
                  f"{row['spawn']:.2f} s, pull {row['pull']:.2f}, launch → marker {row['ready']:.2f} (guest uptime "
                  f"{row['uptime']:.2f}), capture pause {row['capture']:.2f}, start → Ready {row['total']:.2f} s "
                  f"= {row['total'] / seconds:.2f}x ({(row['total'] + row['capture']) / seconds:.2f}x capture included)", flush=True)
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    included = statistics.median(r["total"] + r["capture"] for r in rows)
    # each run's two boots are minutes apart at most: their ratio is blind to a slow quarter of an
    # hour that moves both medians (the host's load), so it is printed beside the ratio of medians
    paired = statistics.median(r["total"] / r["bare"] for r in rows)
    paired_included = statistics.median((r["total"] + r["capture"]) / r["bare"] for r in rows)
    print(f"\nmedians of {runs}: bare {med['bare']:.2f} s, cold start → Ready {med['total']:.2f} s = "
          f"{med['total'] / med['bare']:.2f}x ({included / med['bare']:.2f}x with the capture's pause); median of the "
          f"runs' own ratios {paired:.2f}x ({paired_included:.2f}x with the pause); QEMU spawned {med['spawn']:.2f} s after the start, pull "
          f"{med['pull']:.2f}, launch → marker {med['ready']:.2f} (bare {med['bare']:.2f}), guest uptime at the "
          f"marker {med['uptime']:.2f} (bare {med['bare_uptime']:.2f}), capture pause {med['capture']:.2f}")
    # The ratio above is the sum of two parts with different noise: what the runtime does before and
    # around the guest (its start to QEMU's spawn, the pause: the code's, steady) and the guest's boot
    # from QEMU's launch (TCG's, moving by ±0.5 s here from one boot to the next, bare or not).
    fixed = statistics.median(r["spawn"] + r["capture"] for r in rows)
    print(f"taken apart: the runtime's own time (start → QEMU spawned, plus the pause) {fixed:.2f} s = "
          f"{fixed / med['bare']:.1%} of the bare boot's median; launch → marker ÷ bare "
          f"{med['ready'] / med['bare']:.2f}x (medians), the guest's uptime at its marker ÷ bare's "
          f"{med['uptime'] / med['bare_uptime']:.2f}x")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--guest", choices=["tiny", "debian"], default="tiny")
    p.add_argument("--spawn-only", action="store_true", help="time serve's start → its QEMU's spawn, no boot")
    p.add_argument("--running", action="store_true", help="time a serving runtime's cold boots (power on → Ready)")
    p.add_argument("--before", type=Path, help="a checkout of another revision: its cold starts beside this one's")
    args = p.parse_args()
    if args.before:
        asyncio.run(main_before(args.runs, args.guest, args.before))
    else:
        asyncio.run((main_spawn_only if args.spawn_only else main_running if args.running else main)(
            args.runs, args.guest))
