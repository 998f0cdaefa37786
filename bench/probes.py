"""What one readiness/liveness probe costs (issue 21 item 2; goal: <= 20 ms of CPU per probe).

Starts one runtime (no spec: the probes' cost does not depend on the guest) with its health-only
listener, then measures:

- httpGet: the runtime's CPU (utime + stime of its process, from /proc/PID/stat) over N requests,
  each on a new connection as the kubelet probes; /proc counts in clock ticks (10 ms), so requests
  go in batches and the median of the batch averages is printed. The kubelet's side of an httpGet
  is the kubelet's own (a Go HTTP GET from a process that runs anyway).
- exec: the old probe, ``vmsidecar-runtime ready --quiet --socket …``, M times: the CPU (user +
  sys, from wait4's rusage) and peak RSS of each probe process, plus what serving its two API
  requests cost the runtime.

    uv run python bench/probes.py [--requests 200] [--execs 10]
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bytecode import compile_sources  # bench/ is no package
from snapshot import cpu_seconds  # the runtime's own CPU (its children, QEMU, not counted)

from vmsidecar_contract.process import RuntimeProcess, clean_environ

GOAL_S = 0.020
BATCH = 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def health_answers(port: int) -> bool:
    try:
        return http_get(port, "/healthz") == 200
    except OSError:
        return False


def start_runtime(root: Path, port: int) -> RuntimeProcess:
    """A runtime without a spec, with its health-only listener on ``port``, serving."""
    rt = RuntimeProcess.start(root, cache=root / "cache", args=["--health-listen", f"127.0.0.1:{port}"],
                              env=clean_environ())
    try:
        rt.wait_serving_blocking()
        deadline = time.monotonic() + 10  # the listener starts just after the API
        while not health_answers(port):
            if time.monotonic() > deadline:
                raise SystemExit(f"the health listener did not answer within 10 s:\n{rt.log_text()[-2000:]}")
            time.sleep(0.05)
    except BaseException:
        rt.stop()
        raise
    return rt


def measure_http(pid: int, port: int, requests: int) -> list[float]:
    per_probe = []
    for _ in range(max(1, requests // BATCH)):
        before = cpu_seconds(pid)
        for i in range(BATCH):
            http_get(port, "/readyz" if i % 2 else "/healthz")
        per_probe.append((cpu_seconds(pid) - before) / BATCH)
    return per_probe


def measure_exec(pid: int, socket_path: Path, runs: int) -> tuple[list[float], list[float], list[float]]:
    exe = shutil.which("vmsidecar-runtime") or str(Path(sys.executable).parent / "vmsidecar-runtime")
    cpu, rss, runtime_side = [], [], []
    for _ in range(runs):
        before = cpu_seconds(pid)
        child = subprocess.Popen([exe, "ready", "--quiet", "--socket", str(socket_path)])
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        cpu.append(usage.ru_utime + usage.ru_stime)
        rss.append(usage.ru_maxrss / 1024)
        runtime_side.append(cpu_seconds(pid) - before)
    return cpu, rss, runtime_side


def main() -> None:
    compile_sources()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="httpGet probes (in batches of 20)")
    parser.add_argument("--execs", type=int, default=10, help="exec probes (vmsidecar-runtime ready)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="vmsidecar-probes-"))
    port = free_port()
    rt = start_runtime(root, port)
    proc = rt.proc
    try:
        time.sleep(1.0)  # start-up work done
        idle_before = cpu_seconds(proc.pid)
        time.sleep(2.0)
        idle = (cpu_seconds(proc.pid) - idle_before) / 2.0
        http = measure_http(proc.pid, port, args.requests)
        cpu, rss, runtime_side = measure_exec(proc.pid, root / "shared" / "api.sock", args.execs)
    finally:
        rt.stop(timeout=30)
        shutil.rmtree(root, ignore_errors=True)
    h, e = statistics.median(http), statistics.median(cpu)
    print(f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; runtime idle {idle * 1000:.1f} ms CPU/s")
    print(f"httpGet /healthz|/readyz on the health listener: runtime CPU per probe median {h * 1000:.2f} ms "
          f"(max batch {max(http) * 1000:.2f} ms, {len(http) * BATCH} requests) = {h / GOAL_S:.3f} x the "
          f"{GOAL_S * 1000:.0f} ms goal")
    print(f"exec vmsidecar-runtime ready: probe process CPU median {e * 1000:.0f} ms (min {min(cpu) * 1000:.0f}, "
          f"max {max(cpu) * 1000:.0f}), peak RSS median {statistics.median(rss):.0f} MB, runtime side "
          f"{statistics.median(runtime_side) * 1000:.0f} ms; {args.execs} runs = {e / GOAL_S:.1f} x the goal")
    if h > 0:
        print(f"exec / httpGet: {e / h:.0f} x")
    print(f"at one readiness probe every 2 s: httpGet {h / 2 * 1000:.2f} ms CPU/s, exec {e / 2 * 1000:.0f} ms CPU/s")


if __name__ == "__main__":
    main()
