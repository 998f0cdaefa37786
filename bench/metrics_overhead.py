"""What the metrics cost a recycle (issue 22: ≤ 2 %), and what a scrape costs the runtime.

    uv run python bench/metrics_overhead.py [--rounds 15] [--scrape-interval 1]
    uv run python bench/metrics_overhead.py --before /tmp/old-checkout

Two runtimes side by side, each with the tiny guest on a cache of its own (one cold boot each
captures its snapshot): **on**, this tree, its ``/metrics`` scraped every ``--scrape-interval``
seconds throughout (Prometheus' usual 15-30 s is gentler); **off**, the runtime of the revision
before the metrics (its ``runtime/src`` and ``contract/src`` first on ``PYTHONPATH``, same venv): a
temporary git worktree of the parent of the commit that added ``metrics.py``, or ``--before DIR``.
Each round recycles one, then the other (alternating which goes first), timing ``POST
/v1/vm/recycle`` → Ready (a restore) from the client; then the medians and on ÷ off.

The scrape's CPU: the "on" runtime's utime+stime (/proc) over batches of 10 scrapes, median per scrape.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from snapshot import MARKER, cpu_seconds, loadavg, resolve_guest  # bench/snapshot.py: the guests

from vmsidecar_contract.blocking import BlockingRuntimeClient
from vmsidecar_contract.process import RuntimeProcess, clean_environ

GOAL = 1.02
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Side:
    name: str
    pythonpath: str | None
    port: int
    proc: RuntimeProcess | None = None
    recycles: list[float] = field(default_factory=list)

    def client(self) -> BlockingRuntimeClient:
        assert self.proc is not None
        return BlockingRuntimeClient(self.proc.socket)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"GET {path}: {response.status} {body[:200]!r}")
        return body
    finally:
        conn.close()


@contextlib.contextmanager
def before_tree(given: Path | None) -> Iterator[Path]:
    """The checkout without the metrics: ``given``, else a temporary worktree of the revision before them."""
    if given is not None:
        yield given.resolve()
        return
    added = subprocess.run(["git", "-C", str(ROOT), "log", "--diff-filter=A", "--format=%H", "--",
                            "runtime/src/vmsidecar_runtime/metrics.py"], capture_output=True, text=True,
                           check=True).stdout.split()
    if not added:
        sys.exit("cannot find the commit that added runtime/src/vmsidecar_runtime/metrics.py; pass --before DIR")
    with tempfile.TemporaryDirectory(prefix="metrics-off-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), f"{added[-1]}^"],
                       check=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def start(side: Side, spec: dict, work: Path) -> None:
    env = clean_environ()
    if side.pythonpath:
        env["PYTHONPATH"] = side.pythonpath
    side.proc = RuntimeProcess.start(work / side.name, spec=spec, cache=work / f"cache-{side.name}",
                                     args=["--health-listen", f"127.0.0.1:{side.port}"], env=env)
    side.proc.wait_serving_blocking()
    client = side.client()
    client.wait_ready(600)
    for _ in range(1200):  # the first Ready captures; wait for its restore to be over
        if client.state()["snapshot"].get("capture_seconds") is not None:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{side.name}: no snapshot captured; log:\n{side.proc.log_text()[-2000:]}")


def recycle(side: Side) -> None:
    started = time.monotonic()
    state = side.client().recycle()
    if state["phase"] != "Ready" or state["snapshot"]["boot"] != "restored":
        raise RuntimeError(f"{side.name}: the recycle did not restore: {state['phase']} {state['snapshot']}")
    side.recycles.append(time.monotonic() - started)


def scrape_cpu(side: Side, batches: int = 5) -> tuple[float, int]:
    """Median CPU seconds of one scrape, and the exposition's size."""
    assert side.proc is not None
    per_scrape, size = [], 0
    for _ in range(batches):
        before = cpu_seconds(side.proc.proc.pid)
        for _ in range(10):
            size = len(_get(side.port, "/metrics"))
        per_scrape.append((cpu_seconds(side.proc.proc.pid) - before) / 10)
    return statistics.median(per_scrape), size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--scrape-interval", type=float, default=1.0, help="seconds between scrapes of the 'on' runtime")
    p.add_argument("--before", type=Path, help="a checkout without the metrics (default: a temporary worktree)")
    args = p.parse_args()
    guest = resolve_guest("tiny")
    assert guest is not None
    spec = {"image": f"file:{guest.disk}", "memory": guest.memory, "readiness": {"pattern": MARKER.decode()}}
    with before_tree(args.before) as off_tree, tempfile.TemporaryDirectory(prefix="metrics-bench-") as tmp:
        work = Path(tmp)
        on = Side("on", None, _free_port())
        off = Side("off", os.pathsep.join(str(off_tree / d / "src") for d in ("runtime", "contract")), _free_port())
        stop = threading.Event()
        scrapes = [0]

        def scraper() -> None:
            while not stop.wait(args.scrape_interval):
                with contextlib.suppress(OSError, RuntimeError):
                    _get(on.port, "/metrics")
                    scrapes[0] += 1

        try:
            for side in (on, off):
                start(side, spec, work)
            _get(on.port, "/metrics")
            with contextlib.suppress(RuntimeError):
                _get(off.port, "/metrics")
                sys.exit(f"the 'off' tree {off_tree} serves /metrics: it is not a revision before the metrics")
            thread = threading.Thread(target=scraper, daemon=True)
            thread.start()
            for i in range(args.rounds):
                for side in ((on, off) if i % 2 == 0 else (off, on)):
                    recycle(side)
            stop.set()
            thread.join()
            cpu, size = scrape_cpu(on)
        finally:
            stop.set()
            for side in (on, off):
                if side.proc is not None:
                    side.proc.stop()
    m_on, m_off = statistics.median(on.recycles), statistics.median(off.recycles)
    print(f"recycle → Ready (restore), {args.rounds} rounds each, interleaved; load {loadavg()}; "
          f"'on' scraped every {args.scrape_interval:g} s ({scrapes[0]} scrapes)")
    for side in (off, on):
        print(f"  metrics {side.name:3}: median {statistics.median(side.recycles):.3f} s  "
              f"(min {min(side.recycles):.3f}, max {max(side.recycles):.3f})")
    ratio = m_on / m_off
    print(f"on ÷ off: {ratio:.3f} (goal ≤ {GOAL:.2f})")
    print(f"one scrape: {cpu * 1000:.2f} ms of the runtime's CPU (median of 5 batches of 10), {size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
