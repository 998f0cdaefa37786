"""Memory per instance: N tiny guests at once, each with its runtime and exporter (issue 14).

    uv run python bench/footprint.py                    # 10 instances, single-process exporter
    uv run python bench/footprint.py --exporter jmp     # `jmp run` (parent + forked child) instead
    VMSIDECAR_TCG_TB_SIZE=0 uv run python bench/footprint.py   # QEMU's default TCG cache (1 GiB)

Each instance is what the pod runs, as plain processes: ``vmsidecar-runtime serve`` (its QEMU as a
child) and the exporter in standalone TCP mode. All start at once; once every guest is Ready and
every exporter has served one ``jmp shell -- j vm power read``, the script prints per-process RSS
and PSS (PSS shares pages between the processes that map them: the fair figure for a fork),
medians over the instances, totals, and how much of the host's memory the whole set takes
(MemAvailable before and after: on a machine shared with other work this is noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from vmsidecar_contract.process import RuntimeProcess, RuntimeStartError, clean_environ

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
#: issue 14's goal: runtime + exporter, RSS, per instance
GOAL_MB = 150


@dataclass
class Instance:
    index: int
    root: Path
    port: int
    runtime: RuntimeProcess | None = None
    exporter: subprocess.Popen[bytes] | None = None
    ready_s: float = 0.0
    mem: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def socket(self) -> Path:
        return self.root / "shared" / "api.sock"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _mem(pid: int) -> tuple[float, float]:
    """(RSS, PSS) in MB from smaps_rollup."""
    rss = pss = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key == "Rss":
            rss = int(rest.split()[0])
        elif key == "Pss":
            pss = int(rest.split()[0])
    return rss / 1024, pss / 1024


def _children(pid: int) -> list[tuple[int, str]]:
    out = subprocess.run(["ps", "--ppid", str(pid), "-o", "pid=,comm="], capture_output=True, text=True).stdout
    return [(int(p), c) for p, c in (line.split(None, 1) for line in out.splitlines() if line.strip())]


def _mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _exporter_config(inst: Instance) -> Path:
    path = inst.root / "exporter.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "ExporterConfig",
        "metadata": {"namespace": "default", "name": f"fp{inst.index}"}, "endpoint": "", "token": "",
        "export": {"vm": {"type": "jumpstarter_driver_vmsidecar.driver.VirtualMachine",
                          "config": {"socket": str(inst.socket), "recycle": "InPlaceReuse"}}},
    }))
    return path


def _start(inst: Instance, image: str, memory: str, cache: Path, exporter: str, snapshot: str) -> None:
    (inst.root / "shared").mkdir(parents=True)
    inst.runtime = RuntimeProcess.start(inst.root, spec={"image": image, "memory": memory, "snapshot": snapshot},
                                        cache=cache, env=clean_environ(keep=["VMSIDECAR_TCG_TB_SIZE"]))
    run = ([sys.executable, "-m", "jumpstarter_driver_vmsidecar.exporter_run"] if exporter == "single"
           else [str(BIN / "jmp")])
    run += ["run", "--exporter-config", str(_exporter_config(inst)), "--tls-grpc-listener",
            f"127.0.0.1:{inst.port}", "--tls-grpc-insecure"]
    with open(inst.root / "exporter.log", "wb") as fh:
        inst.exporter = subprocess.Popen(run, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"})


async def _ready(inst: Instance, started: float, timeout: float) -> None:
    assert inst.runtime
    try:
        await inst.runtime.wait_ready(timeout)
    except RuntimeStartError as e:
        raise SystemExit(f"instance {inst.index}: {e}") from None
    inst.ready_s = time.monotonic() - started


def _session(inst: Instance) -> None:
    shell = subprocess.run([str(BIN / "jmp"), "shell", "--tls-grpc", f"127.0.0.1:{inst.port}", "--tls-grpc-insecure",
                            "--", "j", "vm", "power", "read"], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"})
    if shell.returncode != 0:
        raise SystemExit(f"instance {inst.index}: jmp shell failed: {shell.stderr[-1500:]}")


def _measure(inst: Instance) -> None:
    assert inst.runtime and inst.exporter
    inst.mem["runtime"] = _mem(inst.runtime.proc.pid)
    qemu = [p for p, c in _children(inst.runtime.proc.pid) if c.startswith("qemu-system")]
    inst.mem["qemu"] = _mem(qemu[0]) if qemu else (0.0, 0.0)
    parts = [inst.exporter.pid] + [p for p, _ in _children(inst.exporter.pid)]
    mems = [_mem(p) for p in parts]
    inst.mem["exporter"] = (sum(r for r, _ in mems), sum(p for _, p in mems))
    inst.mem["exporter processes"] = (float(len(parts)), float(len(parts)))


def _stop(instances: list[Instance]) -> None:
    # every process signalled first, then waited for: the guests stop in parallel
    exporters = [i.exporter for i in instances if i.exporter and i.exporter.poll() is None]
    runtimes = [i.runtime for i in instances if i.runtime]
    for p in exporters:
        p.send_signal(signal.SIGTERM)
    for rt in runtimes:
        rt.terminate()
    for p in exporters:
        try:
            p.wait(90)
        except subprocess.TimeoutExpired:
            p.kill()
    for rt in runtimes:
        rt.stop(timeout=90)


def _tiny_image() -> str:
    out = subprocess.run([str(BIN / "vmsidecar-image"), "build", "tiny"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.strip()
    return f"file:{out}/disk.qcow2"


async def main_async(args: argparse.Namespace) -> int:
    image = args.image or _tiny_image()
    work = Path(tempfile.mkdtemp(prefix="vmsidecar-footprint-"))
    instances = [Instance(i, work / f"i{i}", _free_port()) for i in range(args.n)]
    available_before = _mem_available_mb()
    started = time.monotonic()
    try:
        for inst in instances:
            # a cache each, as each pod has its own volume (and concurrent snapshot captures of
            # one key into a shared cache are not what we measure here)
            _start(inst, image, args.memory, inst.root / "cache", args.exporter, args.snapshot)
        await asyncio.gather(*(_ready(i, started, args.ready_timeout) for i in instances))
        all_ready = time.monotonic() - started
        for inst in instances:
            await asyncio.to_thread(_session, inst)
        await asyncio.sleep(args.settle)
        for inst in instances:
            _measure(inst)
        available_after = _mem_available_mb()
    finally:
        if 'available_after' not in locals():
            print(f"failed; logs in {work}", file=sys.stderr)
        _stop(instances)
    tb = os.environ.get("VMSIDECAR_TCG_TB_SIZE", "64 (default)")
    print(f"{args.n} instances ({args.exporter} exporter, guest {args.memory}, snapshot {args.snapshot}, "
          f"TCG tb-size {tb} MiB), "
          f"all Ready after {all_ready:.1f} s; ready times median {statistics.median(i.ready_s for i in instances):.1f} s")
    print(f"{'process':<20}{'RSS median MB':>15}{'PSS median MB':>15}{'RSS total MB':>14}")
    for key in ("runtime", "exporter", "qemu"):
        rss = [i.mem[key][0] for i in instances]
        pss = [i.mem[key][1] for i in instances]
        print(f"{key:<20}{statistics.median(rss):>15.1f}{statistics.median(pss):>15.1f}{sum(rss):>14.0f}")
    print(f"(exporter processes per instance: {int(instances[0].mem['exporter processes'][0])})")
    ours = [i.mem["runtime"][0] + i.mem["exporter"][0] for i in instances]
    ours_pss = [i.mem["runtime"][1] + i.mem["exporter"][1] for i in instances]
    total = [sum(v[0] for k, v in i.mem.items() if k != "exporter processes") for i in instances]
    print(f"runtime + exporter per instance: RSS median {statistics.median(ours):.1f} MB, "
          f"PSS median {statistics.median(ours_pss):.1f} MB (goal ≤ {GOAL_MB} MB RSS: "
          f"{'meets' if statistics.median(ours) <= GOAL_MB else 'misses'})")
    print(f"all processes, all instances: RSS {sum(total):.0f} MB; host MemAvailable "
          f"{available_before:.0f} → {available_after:.0f} MB ({available_before - available_after:.0f} MB used; "
          "shared machine: other work moves this)")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=10, help="instances at once (default 10)")
    p.add_argument("--exporter", choices=["single", "jmp"], default="single",
                   help="single: exporter_run.py (the exporter image's entrypoint); jmp: `jmp run`")
    p.add_argument("--image", help="guest image reference (default: the tiny guest)")
    p.add_argument("--memory", default="256M")
    p.add_argument("--snapshot", choices=["auto", "off"], default="auto",
                   help="auto: guests are restored from their memory snapshot after the first Ready (the "
                        "default in a spec); off: every guest stays the one that booted (TCG's cache as filled by a boot)")
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument("--settle", type=float, default=3, help="seconds after the sessions before measuring")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
