"""Where a recycle's time goes: the runtime's JSON log between ``POST /v1/vm/recycle`` and Ready.

    uv run python bench/recycle_trace.py [--guest tiny] [--guest debian] [--recycles 5] [--form templated] [--standby [parked]]

One runtime per guest (a fresh cache: the cold start captures), then ``--recycles`` recycles. For
each: recycle → Ready (the API's view), then as the next lease would: recycle → its claim answered
(once a restored guest's clock is set: Ready comes before it) and → the first shell command
answered on the serial console; and every log line in between, as seconds after the POST
(``--log-format json --log-level DEBUG``: the lines carry their time). Then the medians, per guest,
of recycle → Ready, of restore_seconds (the restore up to the guest running), of the gap between
the two (what comes after the restore: the phase change), of the claim and of the first command.
``--standby``: the spec's ``standby`` (a spare restore, waited for before each recycle); ``--standby parked``: a
parked QEMU (likewise waited for; the recycle loads the snapshot into it). The recycles start once the
capture is stored (it waits for the guest to settle, as in a pool whose first lease comes later);
``--claim-at-ready`` claims at Ready instead, which captures at once (a developer's first lease).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.process import RuntimeProcess, clean_environ

sys.path.insert(0, str(Path(__file__).resolve().parent))
from footprint import _mem
from snapshot import Guest, resolve_guest  # bench/ is no package
from templating import first_answer


def _parked_qemu(state: Path) -> int | None:
    """The parked QEMU of the runtime whose state directory is ``state``: the one holding the spare's
    overlay open (an adopted one holds it at the lease's place, renamed)."""
    spare_overlay = str(state / "spare" / "overlay.qcow2")
    for proc in Path("/proc").iterdir():
        try:
            if (proc.name.isdigit() and str(state / "spare") in (proc / "cmdline").read_text(errors="replace")
                    and any(os.readlink(fd) == spare_overlay for fd in (proc / "fd").iterdir())):
                return int(proc.name)
        except OSError:
            continue
    return None


def _lines_between(log: Path, start: float, end: float) -> list[tuple[float, str]]:
    out = []
    for raw in log.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if isinstance(entry, dict) and "time" in entry and start - 0.002 <= entry["time"] <= end + 0.002:
            out.append((entry["time"] - start, f"{entry.get('logger', 'audit')}: {entry.get('message', raw)}"[:150]))
    return out


async def trace(guest: Guest, recycles: int, form: str, work: Path, verbose: bool,
                standby: bool | str = False, tb_size: int | None = None,
                claim_at_ready: bool = False) -> dict[str, list[float]]:
    env = clean_environ() | {"VMSIDECAR_SNAPSHOT_FORM": form}
    if tb_size is not None:  # TCG's translation cache: private to each QEMU, and KVM has none
        env["VMSIDECAR_TCG_TB_SIZE"] = str(tb_size)
    spec = {"image": f"file:{guest.disk}", "memory": guest.memory, "standby": standby}
    rt = RuntimeProcess.start(work / "rt", spec=spec, cache=work / "cache", env=env,
                              args=["--log-format", "json", "--log-level", "DEBUG"])
    samples: dict[str, list[float]] = {"cold": [], "recycle": [], "restore": [], "after_restore": [], "claim": [],
                                       "first_cmd": []}
    if standby == "parked":  # what the parked QEMU costs while it waits (MB)
        samples |= {"parked_rss_mb": [], "parked_pss_mb": []}
    started = time.monotonic()
    try:
        await rt.wait_ready(guest.timeout, poll=0.02)
        samples["cold"].append(time.monotonic() - started)
        async with RuntimeClient(rt.socket) as client:
            # a pool's first lease comes after its pod was Ready for a while: the capture waited for
            # the guest to settle (controller/settle.py); --claim-at-ready takes it at once instead
            snap = (await (client.claim() if claim_at_ready else client.wait_stored(300))).snapshot
            print(f"{guest.name} {form} captured {snap.captured_when} after settling {snap.settle_seconds} s, "
                  f"paused {snap.capture_seconds} s")
            for i in range(recycles):
                await asyncio.sleep(1)  # the previous guest's late agent answer and timers settle
                if standby:  # the spare restore for this recycle is made after the last Ready
                    await client.wait_spare()
                if standby == "parked" and (parked := _parked_qemu(work / "rt" / "state")) is not None:
                    rss, pss = _mem(parked)
                    samples["parked_rss_mb"].append(rss)
                    samples["parked_pss_mb"].append(pss)
                wall, started = time.time(), time.monotonic()
                await client.recycle()
                state = await client.wait_ready(guest.timeout, poll=0.005)
                took = time.monotonic() - started
                snap = state.snapshot
                assert snap.boot == "restored" and snap.restore_seconds is not None, snap
                samples["recycle"].append(took)
                # then as the next lease: its claim (answered once a restored guest's clock is set),
                # then its first command
                clock = (await client.claim()).snapshot.clock
                samples["claim"].append(time.monotonic() - started)
                samples["first_cmd"].append(await first_answer(rt.shared / "console.sock", started, 120))
                samples["restore"].append(snap.restore_seconds)
                samples["after_restore"].append(took - snap.restore_seconds)
                print(f"{guest.name} {form} recycle {i + 1}: → Ready {took:.3f} s, restore_seconds "
                      f"{snap.restore_seconds:.3f}, clock {snap.clock} at Ready, {clock} at the claim answered "
                      f"{samples['claim'][-1]:.3f} s, restored ahead {snap.restored_ahead}, first command answered "
                      f"{samples['first_cmd'][-1]:.3f} s", flush=True)
                if verbose:
                    for at, text in _lines_between(rt.log, wall, wall + took):
                        print(f"    +{at:6.3f} {text}")
    finally:
        rt.stop()
    return samples


async def main_async(args: argparse.Namespace) -> int:
    guests = [g for g in (resolve_guest(name) for name in args.guest or ["tiny"]) if g is not None]
    results = {}
    for guest in guests:
        with tempfile.TemporaryDirectory(prefix="recycle-trace-") as work:
            results[guest.name] = await trace(guest, args.recycles, args.form, Path(work), not args.quiet,
                                              args.standby, args.tb_size, args.claim_at_ready)
    print(f"\nmedians over {args.recycles} recycles, form {args.form}, standby {args.standby}, tb-size "
          f"{args.tb_size or 'default'}, load {os.getloadavg()[0]:.1f} at the end")
    for name, samples in results.items():
        print(f"{name:<8}" + ", ".join(f"{k} {statistics.median(v):.1f}" if k.endswith("_mb") else
                                       f"{k} {statistics.median(v):.3f} s" for k, v in samples.items() if v))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--guest", action="append", choices=["tiny", "debian"])
    parser.add_argument("--recycles", type=int, default=5)
    parser.add_argument("--form", choices=["templated", "stream"], default="templated")
    parser.add_argument("--quiet", action="store_true", help="medians only, no log lines")
    parser.add_argument("--standby", nargs="?", const=True, default=False, choices=[True, "parked"],
                        help="spec standby: true (a spare restore for each recycle), or 'parked' (a parked QEMU)")
    parser.add_argument("--claim-at-ready", action="store_true",
                        help="claim at once at Ready (the capture is taken then, unsettled), as a developer's first lease")
    parser.add_argument("--tb-size", type=int, help="TCG translation cache, MiB (VMSIDECAR_TCG_TB_SIZE; default the runtime's)")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
