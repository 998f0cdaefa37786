"""Snapshot benchmark: bare QEMU, vmsidecar cold/warm/recycle and upstream's QEMU driver, side by side.

    uv run python bench/snapshot.py [--runs 5] [--guest tiny] [--guest debian] [--write-docs]

Legs, interleaved (each run does every leg once, per guest), on the same disk image:

1. bare QEMU boot → marker: ``qemu-system-*`` started directly, serial on stdout, until
   ``VMSIDECAR-READY``;
2. vmsidecar cold start → Ready: ``vmsidecar-runtime serve`` on a fresh cache (no snapshot), until
   ``GET /v1/vm`` says Ready; includes the pull into the cache and the snapshot capture at first Ready;
3. warm start → Ready: the same spec on the cache that now holds the snapshot (restored);
4. recycle → Ready: ``POST /v1/vm/recycle`` on that Ready runtime (restored);
5. upstream ``jumpstarter-driver-qemu`` 0.9.0 served in-process: ``flasher.flash`` of the disk,
   then ``power.on()`` → marker on ``console.pexpect()``.

Upstream adds ``-accel kvm`` whenever ``/dev/kvm`` is writable. Where the runtime's accel choice
says KVM does not really work (paravirtual /dev/kvm), leg 5 runs in a private mount namespace
with /dev/kvm hidden (``--upstream-leg``, internal), so both sides run TCG.

Prints the medians and ratios; ``--write-docs`` also writes docs/performance.md and docs/performance.svg.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bytecode import compile_sources  # bench/ is no package

from vmsidecar_contract.arch import host_arch
from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.process import RuntimeProcess
from vmsidecar_contract.state import VmState
from vmsidecar_runtime.accel import AccelChoice, choose_accel
from vmsidecar_runtime.backend.common import MACHINE, TCG_CPU, qemu_binary
from vmsidecar_runtime.snapshots import qemu_version

MARKER = b"VMSIDECAR-READY"
ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "performance.md"
SVG = ROOT / "docs" / "performance.svg"
GOALS = {"recycle": 0.5, "warm": 1.5}  # seconds, tiny guest (issue 12)

#: the legs in table order: key, label
LEGS = [
    ("bare", "bare QEMU boot → marker"),
    ("cold", "vmsidecar cold start → Ready"),
    ("warm", "warm start (snapshot) → Ready"),
    ("recycle", "recycle → Ready"),
    ("up_flash", "upstream flash"),
    ("up_boot", "upstream power.on → marker"),
    ("up_total", "upstream flash + power.on → marker"),
]
#: what the runtime reported about itself, per run (not legs: parts of them)
DETAILS = [
    ("cold_pull", "cold start: pull into the fresh cache (timings.pull)"),
    ("cold_ready", "cold start: QEMU launch → marker (timings.ready)"),
    ("capture", "cold start: snapshot capture (snapshot.capture_seconds)"),
    ("restore", "warm start: restore (snapshot.restore_seconds)"),
]


@dataclass(frozen=True)
class Guest:
    """One guest image and how to run it."""

    name: str
    disk: Path
    memory: str  # QEMU/spec syntax: "256M", "1G"
    timeout: float  # seconds until a boot counts as hung (TCG on a busy host is slow)


@dataclass
class Results:
    """Samples per guest and key (seconds), and facts the runtime reported."""

    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    snapshot_size: dict[str, int] = field(default_factory=dict)
    accel: str = ""
    accel_reason: str = ""

    def add(self, guest: str, key: str, seconds: float) -> None:
        self.samples.setdefault(guest, {}).setdefault(key, []).append(seconds)

    def median(self, guest: str, key: str) -> float | None:
        values = self.samples.get(guest, {}).get(key)
        return statistics.median(values) if values else None


# ---- guests ----------------------------------------------------------------------------------

def resolve_guest(name: str) -> Guest | None:
    """The guest's built disk; None (with a printed note) when it cannot be had."""
    from vmsidecar_images.build import build_image, image_dir, list_images
    from vmsidecar_images.recipe import available_recipes, load_recipe

    if name == "tiny":
        # cheap and offline: built (or reused) like bench/boot.py does
        return Guest("tiny", build_image("tiny").disk, "256M", 180.0)
    if name not in available_recipes():
        print(f"note: skipping guest {name!r}: no such recipe (have: {', '.join(available_recipes())})")
        return None
    # A Debian build bootstraps a whole system: never build it here, use what the cache holds.
    recipe = load_recipe(name)
    arch = host_arch()
    built = image_dir(name, arch, recipe.input_hash(arch=arch, label=recipe.default_label))
    if not (built / "manifest.json").is_file():
        earlier = [i for i in list_images() if i.manifest.get("name") == name and i.manifest.get("arch") == arch
                   and i.manifest.get("label") == recipe.default_label]
        if not earlier:
            print(f"note: skipping guest {name!r}: no build; run `uv run vmsidecar-image build {name}` first")
            return None
        built = earlier[0].dir  # newest first
        print(f"note: {name}: no build of the current recipe; using the newest earlier build {built}")
    return Guest(name, built / "disk.qcow2", "1G", 600.0)


# ---- leg 1: bare QEMU ------------------------------------------------------------------------

def bare_argv(guest: Guest, accel: AccelChoice, overlay: Path, cpu: str | None = None) -> list[str]:
    """QEMU with the guest hardware the runtime gives a default spec (machine, CPU, disk, serial,
    hvc0, NIC, RNG) and nothing else: the floor of a cold boot. The guests expect hvc0 and a NIC
    (Debian's consoles and networkd), so leaving them out would time a different boot. ``cpu``:
    another ``-cpu`` than the runtime's default."""
    arch = host_arch()
    return [
        qemu_binary(arch), "-nodefaults", "-no-user-config", "-display", "none",
        "-machine", MACHINE[arch], "-accel", accel.accel,
        "-cpu", cpu or ("host" if accel.accel == "kvm" else TCG_CPU[arch]),
        "-smp", "1", "-m", guest.memory,
        "-drive", f"file={overlay},if=virtio,format=qcow2",
        "-serial", "stdio",
        "-device", "virtio-serial-pci", "-chardev", "null,id=hvc0", "-device", "virtconsole,chardev=hvc0",
        "-netdev", "user,id=net0", "-device", "virtio-net-pci,netdev=net0",
        "-device", "virtio-rng-pci",
    ]


async def wait_for_marker(stream: asyncio.StreamReader, timeout: float) -> None:
    """Read until the marker; a boot that ends or hangs first is an error."""
    tail = b""  # enough to find a marker split across reads, and to show a failed boot's last words
    async with asyncio.timeout(timeout):
        while MARKER not in tail:
            chunk = await stream.read(4096)
            if not chunk:
                raise RuntimeError(f"QEMU ended before {MARKER.decode()}; last output: {tail[-400:]!r}")
            tail = (tail + chunk)[-4096:]


async def bare_boot(guest: Guest, accel: AccelChoice, work: Path, cpu: str | None = None) -> float:
    """Seconds from starting QEMU to the marker on its serial port."""
    work.mkdir(parents=True)
    overlay = work / "overlay.qcow2"  # a fresh overlay, as the runtime boots (the base is read-only)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(guest.disk), "-F", "qcow2",
                    str(overlay)], check=True)
    started = time.monotonic()
    with open(work / "qemu.log", "wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *bare_argv(guest, accel, overlay, cpu), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log)
    try:
        assert proc.stdout is not None
        await wait_for_marker(proc.stdout, guest.timeout)
        return time.monotonic() - started
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()


# ---- legs 2-4: vmsidecar ---------------------------------------------------------------------

@asynccontextmanager
async def ready_runtime(guest: Guest, work: Path, cache: Path, res: Results,
                        leg: str) -> AsyncIterator[tuple[RuntimeProcess, VmState]]:
    """``serve`` on its own shared and state dirs under ``work``, Ready; start → Ready is recorded as ``leg``."""
    # Ready on the marker itself, as legs 1 and 5 time it (the default pattern also takes a login or
    # shell prompt, which the Debian guest shows on ttyS0 just before its marker).
    spec = {"image": f"file:{guest.disk}", "memory": guest.memory, "readiness": {"pattern": MARKER.decode()}}
    started = time.monotonic()
    # the stop is not measured; a short grace keeps the benchmark short
    with RuntimeProcess.start(work, spec=spec, cache=cache, args=["--grace", "5"]) as rt:
        await rt.wait_ready(guest.timeout, poll=0.02)
        res.add(guest.name, leg, time.monotonic() - started)
        async with RuntimeClient(rt.socket) as client:
            state = await client.wait_stored()  # a capture is stored just after Ready (not timed)
        yield rt, state


def expect_boot(state: VmState, wanted: str, leg: str) -> None:
    """Each leg measures what it says: a cold boot or a restore, never a silent fallback."""
    if state.snapshot.boot != wanted:
        raise RuntimeError(f"{leg}: snapshot.boot is {state.snapshot.boot!r}, expected {wanted!r} "
                           f"({state.snapshot.reason})")


async def cold_start(guest: Guest, work: Path, cache: Path, res: Results) -> None:
    """Leg 2 on a fresh cache: pull, cold boot, capture at Ready."""
    async with ready_runtime(guest, work, cache, res, "cold") as (_, state):
        pass  # stopped at once: what the leg measured is in the state it reported
    expect_boot(state, "cold", "cold start")
    if not state.snapshot.available or state.snapshot.capture_seconds is None:
        raise RuntimeError(f"cold start captured no snapshot: {state.snapshot}")
    res.accel, res.accel_reason = state.accel or "", state.accel_reason or ""
    res.snapshot_size[guest.name] = state.snapshot.size or 0
    res.add(guest.name, "capture", state.snapshot.capture_seconds)
    for key, value in (("cold_pull", state.timings.pull), ("cold_ready", state.timings.ready)):
        if value is not None:
            res.add(guest.name, key, value)


async def warm_start_and_recycle(guest: Guest, work: Path, cache: Path, res: Results) -> None:
    """Legs 3 and 4: start on the cache holding the snapshot, then recycle that runtime once."""
    async with ready_runtime(guest, work, cache, res, "warm") as (rt, state):
        expect_boot(state, "restored", "warm start")
        if state.snapshot.restore_seconds is not None:
            res.add(guest.name, "restore", state.snapshot.restore_seconds)
        async with RuntimeClient(rt.socket) as client:
            started = time.monotonic()
            await client.recycle()
            state = await client.wait_ready(guest.timeout, poll=0.02)
            res.add(guest.name, "recycle", time.monotonic() - started)
        expect_boot(state, "restored", "recycle")


# ---- leg 5: upstream jumpstarter-driver-qemu ----------------------------------------------------

def upstream_once(disk: Path, memory: str, timeout: float) -> dict[str, float]:
    """Flash ``disk`` into a new upstream ``Qemu`` driver, power on, wait for the marker.

    Upstream has no overlay: a pristine guest needs a new flash (a full copy) each time, so each
    call serves a new driver (a fresh temp dir) and flashes the read-only image into it.
    """
    from jumpstarter.common.utils import serve
    from jumpstarter_driver_qemu.driver import Qemu

    # same RAM and vCPUs as the runtime's spec (upstream's defaults are 512M, 2)
    driver = Qemu(mem=memory, smp=1)
    try:
        with serve(driver) as client:
            started = time.monotonic()
            client.flasher.flash(str(disk))
            flashed = time.monotonic()
            try:
                client.power.on()
                with client.console.pexpect() as console:
                    console.expect(MARKER, timeout=timeout)
                booted = time.monotonic()
            finally:
                client.power.off()
    finally:
        driver._tmp_dir.cleanup()  # upstream leaves it to the garbage collector
    return {"up_flash": flashed - started, "up_boot": booted - flashed, "up_total": booted - started}


def upstream_would_use_kvm() -> bool:
    """Upstream's own test (QemuPower.on): native arch and a writable /dev/kvm."""
    return os.access("/dev/kvm", os.R_OK | os.W_OK)


def needs_hidden_kvm(accel: AccelChoice) -> bool:
    """Upstream would pass -accel kvm where KVM does not really work (guests hang under it)."""
    return accel.accel == "tcg" and upstream_would_use_kvm()


async def upstream_leg(guest: Guest, accel: AccelChoice, work: Path) -> dict[str, float]:
    """Leg 5: in-process where upstream's accel choice is right, else re-executed with /dev/kvm hidden."""
    if not needs_hidden_kvm(accel):
        return await asyncio.to_thread(upstream_once, guest.disk, guest.memory, guest.timeout)
    work.mkdir(parents=True)
    hidden, out = work / "kvm-hidden", work / "upstream.json"
    hidden.write_bytes(b"")  # an empty REGULAR file: /dev/null (0666) would still pass access()
    script = 'mount --bind "$0" /dev/kvm && mount -o remount,bind,ro /dev/kvm && exec "$@"'
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(hidden),
            sys.executable, str(Path(__file__).resolve()), "--upstream-leg", str(out),
            "--disk", str(guest.disk), "--memory", guest.memory, "--timeout", str(guest.timeout)]
    with open(work / "upstream.log", "wb") as log:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL, stdout=log,
                                                    stderr=subprocess.STDOUT)
    try:
        await asyncio.wait_for(proc.wait(), guest.timeout + 120)
    finally:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()
    if proc.returncode != 0:
        tail = (work / "upstream.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the upstream leg failed (exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())


def upstream_leg_main(out: Path, disk: Path, memory: str, timeout: float) -> int:
    """``--upstream-leg``: one upstream run inside the namespace; results as JSON in ``out``."""
    if upstream_would_use_kvm():
        print("upstream leg: /dev/kvm is still writable here; refusing to run upstream under KVM",
              file=sys.stderr)
        return 3
    out.write_text(json.dumps(upstream_once(disk, memory, timeout)))
    return 0


# ---- the run ---------------------------------------------------------------------------------

async def one_round(guest: Guest, accel: AccelChoice, work: Path, res: Results, upstream: bool) -> None:
    """Every leg once for ``guest``; a line with this round's numbers."""
    res.add(guest.name, "bare", await bare_boot(guest, accel, work / "bare"))
    cache = work / "cache"  # fresh: no image, no snapshot
    await cold_start(guest, work / "cold", cache, res)
    await warm_start_and_recycle(guest, work / "warm", cache, res)
    if upstream:
        for key, value in (await upstream_leg(guest, accel, work / "upstream")).items():
            res.add(guest.name, key, value)
    shutil.rmtree(cache, ignore_errors=True)  # image + snapshot: ~0.45 GB a round for debian
    last = {key: res.samples[guest.name][key][-1] for key, _ in LEGS if key in res.samples[guest.name]}
    print(f"  {guest.name}: " + ", ".join(f"{k} {v:.2f}" for k, v in last.items()), flush=True)


def upstream_available() -> tuple[bool, str]:
    """Whether leg 5 can run here, and the note when it cannot."""
    try:
        import jumpstarter_driver_qemu  # noqa: F401
    except ImportError:
        return False, "jumpstarter-driver-qemu is not installed (uv sync --frozen installs the dev group)"
    return True, ""


async def bench(guests: list[Guest], runs: int, accel: AccelChoice) -> Results:
    """All rounds, interleaved: round i runs every leg of every guest once."""
    res = Results()
    upstream, why = upstream_available()
    if upstream and needs_hidden_kvm(accel) and (os.geteuid() != 0 or not shutil.which("unshare")):
        upstream, why = False, "hiding /dev/kvm from upstream needs root and unshare(1)"
    if not upstream:
        print(f"note: skipping the upstream leg: {why}")
    tmp = Path(tempfile.mkdtemp(prefix="vmsidecar-bench-"))
    try:
        for i in range(runs):
            print(f"run {i + 1}/{runs}", flush=True)
            for guest in guests:
                await one_round(guest, accel, tmp / f"{guest.name}-{i}", res, upstream)
    except BaseException:
        print(f"failed; logs kept in {tmp}", file=sys.stderr)  # runtime.log, qemu.log, upstream.log
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    return res


# ---- output ----------------------------------------------------------------------------------

def _fmt(value: float | None, unit: str = " s") -> str:
    return "—" if value is None else f"{value:.2f}{unit}"


def table_rows(res: Results, guest: str) -> list[list[str]]:
    """Leg, median, min-max, ÷ recycle, ÷ upstream total (a ratio is leg median / reference median)."""
    recycle, upstream = res.median(guest, "recycle"), res.median(guest, "up_total")
    rows = []
    for key, label in LEGS:
        values = res.samples.get(guest, {}).get(key)
        if not values:
            continue
        median = statistics.median(values)
        rows.append([
            label, _fmt(median), f"{min(values):.2f}-{max(values):.2f}",
            _fmt(median / recycle if recycle else None, "x"),
            _fmt(median / upstream if upstream else None, "x"),
        ])
    return rows


def detail_rows(res: Results, guest: str) -> list[list[str]]:
    """The runtime's own timings of the cold and warm starts (medians)."""
    rows = [[label, _fmt(res.median(guest, key))] for key, label in DETAILS if res.median(guest, key) is not None]
    if guest in res.snapshot_size:
        rows.append(["snapshot size on disk (snapshot.size)", f"{res.snapshot_size[guest] / 2**20:.1f} MiB"])
    return rows


HEADER = ["leg", "median", "min-max", "÷ recycle", "÷ upstream"]


def print_table(res: Results, guests: list[Guest], runs: int) -> None:
    """The table on stdout."""
    for guest in guests:
        print(f"\n{guest.name} ({guest.memory}, 1 vCPU, {res.accel}): medians of {runs} interleaved runs")
        rows = table_rows(res, guest.name)
        widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
        for row in [HEADER, *rows]:
            print("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))))
        for label, value in detail_rows(res, guest.name):
            print(f"  {label}: {value}")
    print(f"\naccel: {res.accel} ({res.accel_reason})")


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "--:" for i in range(len(header))) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (``state`` first)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process so far, in seconds, from /proc/PID/stat (its children not counted)."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def minor_faults(pid: int) -> int:
    """Minor page faults of one process so far (/proc/PID/stat's ``minflt``)."""
    return int(_stat_fields(pid)[7])


def cpu_model() -> str:
    """The host CPU's model name (bench/pool_scale.py says it too)."""
    return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), platform.processor() or "?")


def machine_facts(res: Results, runs: int, load: tuple[str, str], note: str | None) -> list[str]:
    """The lines that say where and how the numbers were taken."""
    cpu = cpu_model()
    hidden = "hidden in a private mount namespace (upstream would pass `-accel kvm`)" \
        if needs_hidden_kvm(choose_accel("auto", host_arch())) else "left as is"
    facts = [
        f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}; {runs} interleaved runs per leg",
        f"- host: {os.cpu_count()} CPUs (`nproc`), {cpu}; Linux {platform.release()}",
        f"- accel: **{res.accel}** — {res.accel_reason}; for upstream, /dev/kvm {hidden}",
        f"- {qemu_version(host_arch())}",
        f"- load average (1 min) at start {load[0]}, at end {load[1]}",
    ]
    if note:
        facts.append(f"- note: {note}")
    return facts


LEG_NOTES = """\
- **bare QEMU boot → marker**: `qemu-system-x86_64` started directly with the guest hardware the
  runtime gives a default spec (machine, CPU model, RAM, 1 vCPU, virtio disk on a fresh qcow2
  overlay, serial on stdout, a virtio console, a user-mode NIC, virtio-rng) until the guest prints
  `VMSIDECAR-READY`. No QMP, no paused start, no sockets: the floor for any cold boot.
- **vmsidecar cold start → Ready**: `vmsidecar-runtime serve` on a fresh cache dir, from process start
  to `GET /v1/vm` phase Ready (polled every 20 ms; the spec's readiness pattern is the marker). Includes the pull (a copy into the digest-keyed
  cache and `qemu-img check`), the cold boot, and the memory snapshot capture at first Ready (the
  guest is paused, its RAM written, the same boot resumed from the snapshot).
- **warm start → Ready**: the same spec started again on the cache that now holds the snapshot:
  process start → Ready, the guest restored (`snapshot.boot == "restored"`, asserted).
- **recycle → Ready**: `POST /v1/vm/recycle` on a Ready runtime → Ready again (restored, asserted):
  what an InPlaceReuse lease change costs.
- **upstream**: `jumpstarter-driver-qemu` 0.9.0's `Qemu` driver (`mem` and `smp` set to the same
  RAM and 1 vCPU) served in-process with `jumpstarter.common.utils.serve`; `flasher.flash(disk)`
  copies the image into the driver (upstream has no overlay, so a pristine guest needs a new flash),
  then `power.on()` → the marker on `console.pexpect()`. Upstream's CPU model under TCG is
  `qemu64,+ssse3,…` (ours: `max`), and it adds a virtio-gpu, a NIC and a cloud-init vvfat disk.
  The CPU model alone moves a TCG boot: measured apart (bare QEMU, 2026-11-23, 2-3 runs each), the
  Debian guest reached its marker in ~17.3 s with upstream's model and ~21.5 s with `max` (tiny:
  no clear difference), which is why upstream's power.on → marker can beat the bare leg.
- **÷ recycle / ÷ upstream**: the leg's median divided by the recycle median / the upstream
  flash + power.on median."""


def write_docs(res: Results, guests: list[Guest], runs: int, load: tuple[str, str], note: str | None) -> None:
    """docs/performance.md and docs/performance.svg."""
    command = f"uv run python bench/snapshot.py --runs {runs}" + "".join(f" --guest {g.name}" for g in guests)
    parts = ["# Performance: boots, snapshots, recycles", "",
             f"Measured by `{command} --write-docs` (this file and `performance.svg` are its output).", "",
             *machine_facts(res, runs, load, note), "",
             "![medians per leg](performance.svg)", ""]
    for guest in guests:
        parts += [f"## {guest.name} guest ({guest.memory} RAM, 1 vCPU)", "", disk_line(guest), "",
                  markdown_table(HEADER, table_rows(res, guest.name)), "",
                  markdown_table(["from the runtime's state (medians)", "value"], detail_rows(res, guest.name)), ""]
    parts += ["## Goals (tiny guest)", "", *goal_lines(res), "", "## What each leg measures", "", LEG_NOTES, ""]
    generated = {p.removeprefix("## ") for p in parts if p.startswith("## ")}
    DOC.write_text("\n".join(parts) + kept_sections(generated))
    SVG.write_text(svg_chart(res, guests, runs))
    print(f"wrote {DOC.relative_to(ROOT)} and {SVG.relative_to(ROOT)}")


def kept_sections(generated: set[str]) -> str:
    """The sections of docs/performance.md that other benchmarks own (CLI start, probes, …), kept as
    they are: this script rewrites only its own."""
    if not DOC.exists():
        return ""
    sections = DOC.read_text().split("\n## ")[1:]
    kept = [s for s in sections if s.split("\n", 1)[0] not in generated]
    return "".join("\n## " + s.rstrip("\n") + "\n" for s in kept)


def disk_line(guest: Guest) -> str:
    """Which build was measured (recipes change; the cache keeps each build under its input hash)."""
    return (f"Disk: `{guest.disk.parent.name}/{guest.disk.name}` "
            f"({guest.disk.stat().st_size / 2**20:.1f} MiB qcow2, from `vmsidecar-image build {guest.name}`).")


def goal_lines(res: Results) -> list[str]:
    """Recycle ≤ 0.5 s, warm start ≤ 1.5 s, on the tiny guest."""
    lines = []
    for key, limit in GOALS.items():
        median = res.median("tiny", key)
        label = dict(LEGS)[key]
        if median is None:
            lines.append(f"- {label} ≤ {limit} s: not measured")
        else:
            verdict = "met" if median <= limit else "**not met**"
            lines.append(f"- {label} ≤ {limit} s: median {median:.2f} s — {verdict}")
    return lines


def svg_chart(res: Results, guests: list[Guest], runs: int) -> str:
    """A horizontal bar chart of the medians, one block per guest, each on its own scale."""
    bar_h, gap, label_w, bar_w, width = 18, 6, 260, 440, 800
    colours = {"bare": "#888888", "cold": "#d9822b", "warm": "#2b8cd9", "recycle": "#2bb673",
               "up_flash": "#b0b0d8", "up_boot": "#8c8cc8", "up_total": "#6464b4"}
    y, body = 30, []
    body.append(f'<text x="10" y="20" font-weight="bold">Seconds to a ready guest (medians of {runs} runs, '
                f'{_esc(res.accel)})</text>')
    for guest in guests:
        medians = [(key, label, res.median(guest.name, key)) for key, label in LEGS]
        shown = [(k, lbl, m) for k, lbl, m in medians if m is not None]
        if not shown:
            continue
        top = max(m for _, _, m in shown)
        y += 20
        body.append(f'<text x="10" y="{y}" font-weight="bold">{_esc(guest.name)} ({guest.memory})</text>')
        y += 8
        for key, label, median in shown:
            w = max(1.0, bar_w * median / top)
            body.append(f'<text x="{label_w - 8}" y="{y + 13}" text-anchor="end">{_esc(label)}</text>')
            body.append(f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{colours[key]}"/>')
            body.append(f'<text x="{label_w + w + 6:.1f}" y="{y + 13}">{median:.2f} s</text>')
            y += bar_h + gap
    return svg_document(width, y + 10, body, font_size=12)


def svg_document(width: int, height: int, body: list[str], *, font_size: int) -> str:
    """An SVG document of ``body``'s elements on a white ground (bench/pool_scale.py draws one too)."""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="{font_size}">\n'
            f'<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n")


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


@contextmanager
def _quiet_jumpstarter() -> Iterator[None]:
    """Upstream logs each driver call at INFO; keep the table readable."""
    import logging

    previous = logging.getLogger().level
    logging.getLogger().setLevel(logging.WARNING)
    try:
        yield
    finally:
        logging.getLogger().setLevel(previous)


def main() -> int:
    """Entry point."""
    compile_sources()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--guest", action="append", choices=["tiny", "debian"],
                   help="repeatable; default tiny (debian: when its build exists)")
    p.add_argument("--write-docs", action="store_true", help="write docs/performance.md and docs/performance.svg")
    p.add_argument("--note", help="a line for docs/performance.md (e.g. how busy the machine was)")
    # internal: one upstream run, re-executed inside a mount namespace with /dev/kvm hidden
    p.add_argument("--upstream-leg", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--disk", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--memory", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=300.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.upstream_leg:
        with _quiet_jumpstarter():
            return upstream_leg_main(args.upstream_leg, args.disk, args.memory, args.timeout)

    guests = [g for name in dict.fromkeys(args.guest or ["tiny"]) if (g := resolve_guest(name))]
    if not guests:
        print("no guest to measure", file=sys.stderr)
        return 2
    accel = choose_accel("auto", host_arch())
    print(f"accel: {accel.accel} ({accel.reason}); upstream /dev/kvm "
          f"{'hidden' if needs_hidden_kvm(accel) else 'as is'}", flush=True)
    load_start = loadavg()
    with _quiet_jumpstarter():
        res = asyncio.run(bench(guests, args.runs, accel))
    load = (load_start, loadavg())
    print_table(res, guests, args.runs)
    if args.write_docs:
        write_docs(res, guests, args.runs, load, args.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
