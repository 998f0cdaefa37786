"""CLI start time (issue 21): every entry point and client command, as installed.

    uv run python bench/cli.py               # 7 runs each
    uv run python bench/cli.py --runs 15 --top 10

Starts one ``vmsidecar-runtime serve`` without a spec (no guest boots) for the commands that need
a runtime, then for each command: the median wall time of N runs (with its peak RSS) and, from one
more run under ``python -X importtime``, the total import time and the 10 modules that cost most
(cumulative: each including what it imports). Ratios are against the goal: 0.25 s. The commands
that talk to the runtime also include its answer; ``--help`` is the start alone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bytecode import compile_sources  # bench/ is no package

from vmsidecar_contract.process import RuntimeProcess

BIN = Path(sys.executable).parent
GOAL_S = 0.25


def _commands(sock: str, work: Path) -> list[tuple[str, list[str]]]:
    (work / "not-a-disk").write_text("hello\n")
    rt = [str(BIN / "vmsidecar-runtime")]
    return [
        ("vmsidecar-runtime --help", [*rt, "--help"]),
        ("vmsidecar-runtime status --help", [*rt, "status", "--help"]),
        ("vmsidecar-runtime status", [*rt, "status", "--socket", sock]),
        ("vmsidecar-runtime status --json", [*rt, "status", "--json", "--socket", sock]),
        ("vmsidecar-runtime ready", [*rt, "ready", "--socket", sock]),
        ("vmsidecar-runtime power on (refused)", [*rt, "power", "on", "--socket", sock]),
        ("vmsidecar-runtime recycle --no-boot", [*rt, "recycle", "--no-boot", "--socket", sock]),
        ("vmsidecar-runtime flash (refused)", [*rt, "flash", str(work / "not-a-disk"), "--socket", sock]),
        ("vmsidecar-runtime dump (refused)", [*rt, "dump", str(work / "out"), "--socket", sock]),
        ("vmsidecar-runtime pull (refused)", [*rt, "pull", "registry.invalid/x:1", "--socket", sock]),
        ("vmsidecar-runtime console --help", [*rt, "console", "--help"]),
        ("vmsidecar-runtime shutdown --help", [*rt, "shutdown", "--help"]),
        ("vmsidecar-runtime serve --help", [*rt, "serve", "--help"]),
        ("vmsidecar-oci --help", [str(BIN / "vmsidecar-oci"), "--help"]),
        ("vmsidecar-shell --help", [str(BIN / "vmsidecar-shell"), "--help"]),
    ]


def _wall(argv: list[str]) -> tuple[float, float]:
    """Seconds and peak RSS (MB) of one run."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, _, usage = os.wait4(proc.pid, 0)
    proc.returncode = 0  # reaped here, for wait4's rusage of this one child
    return time.perf_counter() - start, usage.ru_maxrss / 1024


def _imports(argv: list[str], top: int) -> tuple[float, list[tuple[float, str]]]:
    """Total import time (s: the top-level imports' cumulative) and the ``top`` modules by cumulative time."""
    err = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True,
                         timeout=60).stderr
    rows, total = [], 0.0
    for line in err.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = line.split("|")
            if cumulative.strip().isdigit():
                rows.append((int(cumulative) / 1e6, name.strip()))
                total += rows[-1][0] if not name.startswith("  ") else 0  # top level: one space
    return total, sorted(rows, reverse=True)[:top]


def main() -> int:
    compile_sources()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vmsidecar-bench-cli-"))
    runtime = RuntimeProcess.start(work, cache=work / "cache")
    sock = runtime.socket
    try:
        runtime.wait_serving_blocking()
        print(f"{'command':40} {'median s':>9} {'min s':>7} {'/goal':>6} {'RSS MB':>7} {'imports s':>9}")
        tops = []
        for name, argv in _commands(str(sock), work):
            runs = [_wall(argv) for _ in range(args.runs)]
            times = [t for t, _ in runs]
            median = statistics.median(times)
            total, top = _imports(argv, args.top)
            tops.append((name, top))
            print(f"{name:40} {median:9.3f} {min(times):7.3f} {median / GOAL_S:6.2f} {runs[-1][1]:7.0f} {total:9.3f}")
        print(f"\ntop {args.top} imports by cumulative time (s)")
        for name, top in tops:
            print(f"  {name}: " + ", ".join(f"{module} {s:.3f}" for s, module in top))
    finally:
        runtime.stop(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
