"""Warm start (issue 21): ``vmsidecar-runtime serve`` on a cache that holds the guest's snapshot → Ready.

    uv run python bench/warm_start.py [--runs 9] [--guest tiny|debian]
    uv run python bench/warm_start.py --before /tmp/old-checkout     # before/after, interleaved

One cold start per tree captures the snapshot into that tree's own cache; then each run starts
``serve`` on it and polls ``GET /v1/vm`` every 10 ms until Ready (a restore, asserted). Where the
time goes comes from the runtime's own log (``--log-format json``, times relative to the spawn):

- **boot begins**: the first phase change (process start, imports, the controller set up);
- **QEMU spawned**: ``starting qemu-system-…`` (the cache lookup, the snapshot's key and checks,
  the overlay, the boot plan);
- **runtime Ready**: the phase change to Ready (QEMU's start, the restore, ``cont``);
- **API up**: the API socket exists; **Ready seen**: a client saw Ready (what the goal is about:
  ≤ 0.5 s, process start included);
- **restore**: ``snapshot.restore_seconds`` (the controller's own: checks, launch, restore);
- **CPU**: the runtime process's CPU seconds (user + system, all its threads) when Ready is seen:
  what its work costs, which a busy machine stretches less than the wall time.

``--before DIR`` runs the runtime of another checkout (its ``runtime/src`` and ``contract/src``
first on ``PYTHONPATH``, same venv) in alternation with this one, and prints both with the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bytecode import compile_sources
from snapshot import MARKER, Guest, cpu_seconds, loadavg, resolve_guest  # the guests, their spec
from trees import tree_pythonpath, with_pythonpath

from vmsidecar_contract.blocking import BlockingRuntimeClient, RuntimeUnavailableError

GOAL_S = 0.5
#: columns: key, label
COLUMNS = [
    ("boot", "boot begins"),
    ("spawn", "QEMU spawned"),
    ("ready_rt", "runtime Ready"),
    ("sock", "API up"),
    ("ready", "Ready seen"),
    ("restore", "restore (runtime's)"),
    ("cpu", "runtime CPU"),
]


@dataclass
class Tree:
    """One runtime source tree under test."""

    name: str
    pythonpath: str | None
    cache: Path
    samples: dict[str, list[float]] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        return with_pythonpath(dict(os.environ), self.pythonpath)

    def median(self, key: str) -> float | None:
        values = self.samples.get(key)
        return statistics.median(values) if values else None


def _spec(guest: Guest) -> dict:
    return {"image": f"file:{guest.disk}", "memory": guest.memory, "readiness": {"pattern": MARKER.decode()}}


def start(tree: Tree, guest: Guest, work: Path, spec_doc: dict | None = None) -> dict[str, float | str | None]:
    """One ``serve`` from spawn to Ready (of ``spec_doc``, default the guest's from its file);
    returns the seconds of each column and the boot kind."""
    work.mkdir(parents=True)
    spec = work / "spec.json"
    spec.write_text(json.dumps(spec_doc or _spec(guest)))
    sock = work / "shared" / "api.sock"
    log = work / "runtime.log"
    argv = [sys.executable, "-m", "vmsidecar_runtime.cli", "serve", "--spec", str(spec), "--shared-dir",
            str(work / "shared"), "--cache-dir", str(tree.cache), "--state-dir", str(work / "state"),
            "--grace", "5", "--log-format", "json"]
    with open(log, "wb") as err:
        t0 = time.time()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=tree.env())
    result: dict[str, float | str | None] = {}
    try:
        deadline = t0 + guest.timeout
        while not sock.exists():
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{tree.name}: no API socket (exit {proc.returncode}); log {log}")
            time.sleep(0.002)
        result["sock"] = time.time() - t0
        client = BlockingRuntimeClient(sock)
        while True:
            try:
                state = client.state()
            except RuntimeUnavailableError:  # the socket may exist a moment before it answers
                state = None
            if state is not None and state.get("phase") == "Ready":
                result["cpu"] = cpu_seconds(proc.pid)
                break
            if time.time() > deadline:
                raise RuntimeError(f"{tree.name}: not Ready within {guest.timeout:.0f} s; log {log}")
            time.sleep(0.01)
        result["ready"] = time.time() - t0
        snapshot = state.get("snapshot") or {}
        result["boot_kind"] = snapshot.get("boot")
        result["restore"] = snapshot.get("restore_seconds")
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for line in log.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        message, at = str(entry.get("message", "")), float(entry.get("time", 0)) - t0
        if message.startswith("phase ") and "boot" not in result:
            result["boot"] = at
        elif message.startswith("starting qemu-system") and "spawn" not in result:
            result["spawn"] = at
        elif message.endswith("-> Ready") and "ready_rt" not in result:
            result["ready_rt"] = at
    return result


def capture(tree: Tree, guest: Guest, work: Path) -> None:
    """The cold start that puts the snapshot into the tree's cache."""
    result = start(tree, guest, work)
    if result.get("boot_kind") != "cold":
        raise RuntimeError(f"{tree.name}: the first start was {result.get('boot_kind')!r}, not a cold boot")
    print(f"{tree.name}: snapshot captured (cold start → Ready {result['ready']:.2f} s)", flush=True)


def _fmt(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "—"


def print_table(trees: list[Tree], runs: int) -> None:
    print(f"\nmedians of {runs} warm starts, seconds from the spawn of `serve` (min-max under Ready seen)")
    print(f"{'tree':10} " + " ".join(f"{label:>19}" for _, label in COLUMNS) + f" {'÷ goal':>7}")
    for tree in trees:
        ready = tree.samples.get("ready", [])
        row = " ".join(f"{_fmt(tree.median(key)):>19}" for key, _ in COLUMNS)
        goal = tree.median("ready")
        print(f"{tree.name:10} {row} {goal / GOAL_S if goal else 0:7.2f}")
        if ready:
            print(f"{'':10} Ready seen: min {min(ready):.3f}, max {max(ready):.3f}")
    if len(trees) == 2 and (before := trees[0].median("ready")) and (after := trees[1].median("ready")):
        print(f"\nafter ÷ before (Ready seen): {after / before:.2f}")


def main() -> int:
    compile_sources()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--guest", choices=["tiny", "debian"], default="tiny")
    p.add_argument("--before", type=Path, help="a checkout of another revision, measured in alternation")
    args = p.parse_args()
    guest = resolve_guest(args.guest)
    if guest is None:
        return 2
    with tempfile.TemporaryDirectory(prefix="vmsidecar-bench-warm-") as tmp:
        work = Path(tmp)
        trees = []
        if args.before:
            src = args.before.resolve()
            trees.append(Tree("before", tree_pythonpath(src),
                              work / "cache-before"))
        trees.append(Tree("after" if args.before else "this", None, work / "cache-this"))
        print(f"load average at start: {loadavg()}", flush=True)
        for tree in trees:
            capture(tree, guest, work / f"{tree.name}-capture")
        for i in range(args.runs):
            for tree in trees:
                result = start(tree, guest, work / f"{tree.name}-{i}")
                if result.get("boot_kind") != "restored":
                    raise RuntimeError(f"{tree.name}: run {i + 1} was {result.get('boot_kind')!r}, not a restore")
                for key, _ in COLUMNS:
                    if isinstance(value := result.get(key), float):
                        tree.samples.setdefault(key, []).append(value)
                print(f"run {i + 1} {tree.name:7} " + " ".join(f"{key} {_fmt(result.get(key))}"  # type: ignore[arg-type]
                                                              for key, _ in COLUMNS), flush=True)
        print(f"load average at end: {loadavg()}")
        print_table(trees, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
