"""Recycle → Ready of a big, dirty guest (issue 23): the tiny guest with ``--memory`` (2G), of which
``--dirty-mb`` (1536) are written before Ready, templated vs full-stream, next to the small one.

    uv run python bench/dirty_recycle.py [--runs 2] [--recycles 3] [--standby [parked]]

The big guest's readiness is a pattern its boot does not print: once the guest's shell answers on
the console, the script fills a tmpfs with ``dd`` and then prints the pattern, so the snapshot
taken at Ready holds that much written RAM. The small guest is the tiny one as usual (256M, Ready
at its own marker). Per form and run, on fresh caches, both runtimes are started (each cold start
captures) and left serving side by side; then ``--recycles`` recycles of each, alternated (which
goes first alternating), each timed POST → Ready. This host slows down for seconds at a time (every
step of a recycle stretched alike, QEMU's QMP greeting 0.057 s where 0.030, no steal time): the
small guest's recycles all done before the big one's let such a spell fall on one side only
(big ÷ small 1.71x in one run, 1.14x alone right after; alternated, 1.04-1.08x the same morning).
Prints medians and the ratio big ÷ small per form (the goal: within 20 %). ``--standby``: the
spec's ``standby``, each recycle switching to a spare restore made since the last (both runtimes'
spares waited for); ``--standby parked``: loading the snapshot into a parked QEMU started since the last.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.process import RuntimeProcess, clean_environ
from vmsidecar_images.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
from snapshot import Guest, resolve_guest  # bench/ is no package

FORMS = ("templated", "stream")
#: printed after the fill; the typed command spells it with arithmetic so its echo does not match
DONE = "DIRTY-FILLED-2"


async def _dirty(console: Path, megabytes: int, timeout: float) -> None:
    con = await Console.open_when_served(console, timeout)
    try:
        await con.expect("VMSIDECAR-READY", timeout)
        await con.wake()
        # random bytes (zero pages would cost a full-stream save nothing), 64 MB made once and copied:
        # /dev/urandom under TCG is slow
        chunks = max(megabytes // 64, 1)
        con.writer.write(f"mkdir -p /mnt/fill && mount -t tmpfs -o size={megabytes + 128}m fill /mnt/fill && "
                         f"dd if=/dev/urandom of=/mnt/fill/1 bs=1M count=64 2>/dev/null && "
                         f"for i in $(seq 2 {chunks}); do cp /mnt/fill/1 /mnt/fill/$i; done; "
                         f"echo DIRTY-FILLED-$((1+1))\n".encode())
        await con.writer.drain()
    finally:
        await con.close()


async def captured(guest: Guest, form: str, memory: str, dirty_mb: int, work: Path,
                   standby: bool | str = False) -> tuple[RuntimeProcess, float]:
    """A runtime serving ``guest`` with ``memory``, ``dirty_mb`` written before Ready, its capture
    stored; and the capture's pause."""
    env = clean_environ() | {"VMSIDECAR_SNAPSHOT_FORM": form}
    spec: dict[str, object] = {"image": f"file:{guest.disk}", "memory": memory, "standby": standby}
    if dirty_mb:
        spec["readiness"] = {"pattern": DONE, "timeout": 900}
    rt = RuntimeProcess.start(work / "rt", spec=spec, cache=work / "cache", env=env)
    try:
        if dirty_mb:
            await _dirty(rt.shared / "console.sock", dirty_mb, 300)
        await rt.wait_ready(900, poll=0.05)
        async with RuntimeClient(rt.socket) as client:
            state = await client.wait_stored(300)  # the capture is stored just after Ready
        assert state.snapshot.form == form and state.snapshot.available, state.snapshot
    except BaseException:
        rt.stop()
        raise
    paused = state.snapshot.capture_seconds or 0.0
    print(f"  captured {form} {memory}: {paused} s, {(state.snapshot.size or 0) / 2**20:.0f} MB", flush=True)
    return rt, paused


async def side_by_side(guest: Guest, form: str, memory: str, dirty_mb: int, recycles: int, work: Path,
                       standby: bool | str = False) -> dict[str, list[float]]:
    """The small guest and the big one (``memory``, ``dirty_mb`` written) serving side by side,
    ``recycles`` recycles of each alternated: {"small": seconds to Ready, "big": …, "restore_small":
    each one's ``restore_seconds`` (QEMU's start to the guest running), "restore_big": …,
    "capture_small": [the capture's pause], "capture_big": […]}."""
    runtimes: dict[str, RuntimeProcess] = {}
    out: dict[str, list[float]] = {}
    try:
        for size, mem, dirty in (("small", guest.memory, 0), ("big", memory, dirty_mb)):
            runtimes[size], paused = await captured(guest, form, mem, dirty, work / size, standby)
            out[f"capture_{size}"] = [paused]
        async with RuntimeClient(runtimes["small"].socket) as small, RuntimeClient(runtimes["big"].socket) as big:
            clients = {"small": small, "big": big}
            for i in range(recycles):
                for size in ("small", "big") if i % 2 == 0 else ("big", "small"):
                    await asyncio.sleep(1)
                    if standby:  # both: the other's spare is not made during this recycle
                        for client in clients.values():
                            await client.wait_spare(120)
                    started = time.monotonic()
                    await clients[size].recycle()
                    state = await clients[size].wait_ready(120, poll=0.005)
                    out.setdefault(size, []).append(time.monotonic() - started)
                    out.setdefault(f"restore_{size}", []).append(state.snapshot.restore_seconds or 0.0)
                    assert state.snapshot.boot == "restored" and state.snapshot.restored_ahead == (standby is True), \
                        state.snapshot
        return out
    finally:
        for rt in runtimes.values():
            rt.stop()


async def main_async(args: argparse.Namespace) -> int:
    tiny = resolve_guest("tiny")
    assert tiny is not None
    samples: dict[tuple[str, str], list[float]] = {}
    for run in range(args.runs):
        for form in FORMS:
            with tempfile.TemporaryDirectory(prefix="dirty-recycle-") as work:
                out = await side_by_side(tiny, form, args.memory, args.dirty_mb, args.recycles, Path(work), args.standby)
            for size in ("small", "big"):
                print(f"run {run + 1} {form} {size}: " + ", ".join(f"{t:.3f}" for t in out[size])
                      + " (restore_seconds " + ", ".join(f"{t:.3f}" for t in out[f"restore_{size}"]) + ")", flush=True)
                samples.setdefault((form, size), []).extend(out[size])
    print(f"\nrecycle → Ready, medians of {args.runs} x {args.recycles}; big = {args.memory}, {args.dirty_mb} MB "
          f"written; standby {args.standby}; load {os.getloadavg()[0]:.1f} at the end")
    for form in FORMS:
        small, big = statistics.median(samples[(form, "small")]), statistics.median(samples[(form, "big")])
        print(f"{form:<10} small {small:.3f} s  big {big:.3f} s  big ÷ small {big / small:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--recycles", type=int, default=3)
    parser.add_argument("--memory", default="2G")
    parser.add_argument("--dirty-mb", type=int, default=1536)
    parser.add_argument("--standby", nargs="?", const=True, default=False, choices=[True, "parked"],
                        help="spec standby: true (each recycle switches to a spare), or 'parked' (a parked QEMU)")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
