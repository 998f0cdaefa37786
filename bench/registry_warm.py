"""Pod on an empty node → Ready, the snapshot in the loopback registry (issue 23, item 2).

    uv run python bench/registry_warm.py [--runs 7] [--guest tiny --guest debian] [--before DIR]

A distribution 2.8 registry (Debian's ``docker-registry``, no referrers API) on 127.0.0.1 gets
the guest's disk (``vmsidecar-oci push``). One runtime boots it cold on a cache of its own and
captures the snapshot; ``vmsidecar-oci snapshot push`` publishes it. Each run then starts
``serve`` on an EMPTY cache with the spec's ``snapshot_source`` set, as a pod on a new node does,
and polls ``GET /v1/vm`` until Ready; the run must be a ``registry_warm`` restore (asserted). What
a run includes: the image pull (download, decompression, checks), the snapshot's discovery
(referrers tag schema), download, verification, decompression and commit, QEMU's start and the
restore. Columns as in bench/warm_start.py; "cold" is the capturing boot, for scale. ``--before``
(a checkout of another revision, e.g. a ``git worktree``) starts its runtime from the same snapshot
in alternation with this checkout's (``GUEST-before`` rows).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from bytecode import compile_sources
from snapshot import MARKER, Guest, loadavg, resolve_guest  # bench/snapshot.py: the guests
from trees import tree_pythonpath
from warm_start import COLUMNS, Tree, start

from vmsidecar_runtime.oci import push_artifact

GOAL_S = {"debian": 3.0}  # the goal (Debian, pull included)
#: bench/warm_start.py's columns, and the snapshot's fetch (discovery, download, checks, commit)
COLUMNS_HERE = [*COLUMNS, ("fetch", "snapshot fetch")]
#: the runtime's log line of the fetch: after the pull, or during it ("fetched while the image was pulled")
_FETCHED = re.compile(r"fetched (?:from \S+ |while the image was pulled, )in ([0-9.]+) s")


def _fetch_seconds(log: Path) -> float | None:
    """The runtime's own figure for the snapshot's fetch (its log line)."""
    for line in log.read_text(errors="replace").splitlines():
        if match := _FETCHED.search(line):
            return float(match.group(1))
    return None


@contextlib.contextmanager
def loopback_registry(work: Path) -> Iterator[str]:
    """``docker-registry serve`` on a free loopback port; yields ``127.0.0.1:PORT``."""
    binary = shutil.which("docker-registry")
    if binary is None:
        raise SystemExit("docker-registry is not installed; apt-get install docker-registry")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (work / "storage").mkdir(parents=True)
    config = work / "config.yml"
    config.write_text(f"version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n"
                      f"    rootdirectory: {work / 'storage'}\nhttp:\n  addr: 127.0.0.1:{port}\n")
    proc = subprocess.Popen([binary, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("docker-registry did not answer within 15 s") from None
                time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def bench_guest(guest: Guest, host: str, work: Path, runs: int, before: str | None) -> list[Tree]:
    """The guest pushed, captured and its snapshot pushed once; then ``runs`` empty-node starts of
    this checkout (and of ``before``'s, a PYTHONPATH, in alternation) from that snapshot."""
    image = f"{host}/bench/{guest.name}:v1"
    started = time.monotonic()
    push_artifact(guest.disk, image)
    print(f"{guest.name}: image pushed in {time.monotonic() - started:.1f} s", flush=True)
    spec = {"image": image, "memory": guest.memory, "readiness": {"pattern": MARKER.decode()}}
    capturing = Tree(guest.name, None, work / f"{guest.name}-capture-cache")
    cold = start(capturing, guest, work / f"{guest.name}-capture", spec)
    if cold.get("boot_kind") != "cold":
        raise RuntimeError(f"{guest.name}: the capturing start was {cold.get('boot_kind')!r}, not cold")
    spec_file = work / f"{guest.name}-spec.json"
    spec_file.write_text(json.dumps(spec))
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "vmsidecar_runtime.oci.cli", "snapshot", "push", f"{host}/bench/{guest.name}",
                    "--cache", str(capturing.cache), "--spec", str(spec_file)], check=True)
    print(f"{guest.name}: cold start → Ready {cold['ready']:.2f} s (capture included); snapshot pushed in "
          f"{time.monotonic() - started:.1f} s", flush=True)
    warm_spec = {**spec, "snapshotSource": f"{host}/bench/{guest.name}"}
    sides = [Tree(guest.name, None, capturing.cache)]
    if before:
        sides.insert(0, Tree(f"{guest.name}-before", before, capturing.cache))
    for i in range(runs):
        for tree in sides if i % 2 == 0 else sides[::-1]:  # neither side always first
            tree.cache = work / f"{tree.name}-empty-cache-{i}"  # a new node each time
            result = start(tree, guest, work / f"{tree.name}-{i}", warm_spec)
            if result.get("boot_kind") != "registry_warm":
                raise RuntimeError(f"{tree.name}: run {i + 1} was {result.get('boot_kind')!r}, not registry_warm")
            result["fetch"] = _fetch_seconds(work / f"{tree.name}-{i}" / "runtime.log")
            for key, _ in COLUMNS_HERE:
                if isinstance(value := result.get(key), float):
                    tree.samples.setdefault(key, []).append(value)
            print(f"run {i + 1} {tree.name:14} " + " ".join(f"{key} {result.get(key)!s:.6}" for key, _ in COLUMNS_HERE),
                  flush=True)
            shutil.rmtree(tree.cache, ignore_errors=True)
    for tree in sides:
        tree.samples["cold"] = [float(cold["ready"])]  # type: ignore[arg-type]
    return sides


def main() -> int:
    compile_sources()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--guest", action="append", choices=["tiny", "debian"], help="repeatable; default tiny")
    p.add_argument("--before", type=Path, help="a checkout of another revision, its starts alternating with this one's")
    args = p.parse_args()
    before = tree_pythonpath(args.before.resolve()) if args.before else None
    guests = [g for name in args.guest or ["tiny"] if (g := resolve_guest(name)) is not None]
    os.environ["VMSIDECAR_INSECURE_REGISTRIES"] = "127.0.0.1"  # the loopback registry speaks plain HTTP
    trees = []
    with tempfile.TemporaryDirectory(prefix="vmsidecar-bench-registry-") as tmp:
        work = Path(tmp)
        print(f"load average at start: {loadavg()}", flush=True)
        with loopback_registry(work / "registry") as host:
            for guest in guests:
                trees += bench_guest(guest, host, work, args.runs, before)
        print(f"load average at end: {loadavg()}")
    print(f"\nmedians of {args.runs} starts on an empty cache, seconds from the spawn of `serve`")
    print(f"{'guest':14} {'cold (1 run)':>13} " + " ".join(f"{label:>19}" for _, label in COLUMNS_HERE)
          + "   min-max Ready")
    for tree in trees:
        ready = tree.samples.get("ready", [])
        row = " ".join(f"{tree.median(key) or 0:19.3f}" for key, _ in COLUMNS_HERE)
        goal = f"  (goal ≤ {GOAL_S[tree.name]:.1f} s)" if tree.name in GOAL_S else ""
        print(f"{tree.name:14} {tree.samples['cold'][0]:13.2f} {row}   {min(ready):.2f}-{max(ready):.2f}{goal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
