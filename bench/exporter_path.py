"""The exporter path (issue 21): ``jmp shell`` → ``j vm …`` → our drivers → the runtime, what is ours.

    uv run python bench/exporter_path.py [--runs 5] [--calls 30]
    uv run python bench/exporter_path.py --before /tmp/old-checkout      # before/after, interleaved

Real processes throughout: one ``vmsidecar-runtime serve`` on the tiny guest (its snapshot captured
once), jumpstarter 0.9.0's ``jmp shell --exporter-config`` serving our ``VirtualMachine`` next to
upstream's ``MockPower`` (``mock``: the same exporter, a driver that does nothing), ``j`` inside.
Each run, per tree (this one, and ``--before``'s: its ``drivers/src``, ``contract/src`` and
``runtime/src`` first on ``PYTHONPATH`` for the runtime and for ``jmp``):

- **shell start / end**: ``jmp shell`` until its command runs, and from the command's end until
  ``jmp shell`` exits; the same with an exporter of ``mock`` alone is Jumpstarter's own. Ours
  in between: importing our driver, building its tree, claiming the VM at hand-out (start),
  recycling it for the next lease at the end (InPlaceReuse: the guest restored, Ready).
- **j --help**: Jumpstarter's client start (Python, its imports, the gRPC connection, the driver
  report, a client object per driver, ours among them); ``j`` outside a shell (it only imports
  and refuses) is its imports alone.
- **j mock read / j vm power read**: one call each, client start included: the difference is ours.
- **j vm power on → Ready**: on a Stopped VM with a fresh generation (``vmsidecar-runtime recycle
  --no-boot`` before the shell): the runtime restores the snapshot; Ready checked at once after.
- **our driver's import**: ``-X importtime`` of ``jumpstarter_driver_vmsidecar.driver`` in a
  process that already imported what ``jmp shell`` and upstream's drivers import (cumulative);
- **per call**: one Python client (``jumpstarter.utils.env``) calling ``vm.power.read()`` and
  ``mock.read()`` ``--calls`` times: the round trip without any process start.

Prints medians (n = runs) per tree and the ratio after ÷ before.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from snapshot import MARKER, loadavg, resolve_guest  # bench/snapshot.py: the guests and their spec
from trees import with_pythonpath

BIN = Path(sys.executable).parent
#: what the python client inside the shell runs: per-call medians in ms, as JSON on stdout
PER_CALL = """
import json, statistics, sys, time
from jumpstarter.utils.env import env
calls = int(sys.argv[1])
with env() as client:
    def median_ms(fn):
        fn()  # the first call of a kind opens what later ones reuse
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000
    out = {"call_vm_read": median_ms(lambda: list(client.vm.power.read())),
           "call_mock_read": median_ms(lambda: list(client.mock.read()))}
print(json.dumps(out))
"""
#: the shell's script: each step as "KEY START END" (bash's EPOCHREALTIME) into $MARKS
SCRIPT = """
set -euo pipefail
echo "inside $EPOCHREALTIME $EPOCHREALTIME" >> "$MARKS"
step() { local key=$1 s=$EPOCHREALTIME; shift; "$@" > /dev/null; echo "$key $s $EPOCHREALTIME" >> "$MARKS"; }
step j_help j --help
step j_mock_read j mock read
step j_vm_read j vm power read
step j_vm_on j vm power on
vmsidecar-runtime ready --socket "$SOCK" > /dev/null || { echo "power on returned before Ready" >&2; exit 3; }
step j_vm_read_on j vm power read
python - "$CALLS" > "$MARKS.calls" <<'PY'
{per_call}
PY
echo "end $EPOCHREALTIME $EPOCHREALTIME" >> "$MARKS"
"""
#: columns: key, label
COLUMNS = [
    ("shell_start", "shell start"),
    ("shell_end", "shell end"),
    ("mock_shell_start", "shell start, mock alone"),
    ("mock_shell_end", "shell end, mock alone"),
    ("driver_import", "our driver's import (exporter)"),
    ("j_outside", "j outside a shell"),
    ("j_help", "j --help"),
    ("j_mock_read", "j mock read"),
    ("j_vm_read", "j vm power read"),
    ("j_vm_on", "j vm power on → Ready"),
    ("call_mock_read", "per call: mock.read (ms)"),
    ("call_vm_read", "per call: vm.power.read (ms)"),
]


@dataclass
class Tree:
    """One source tree under test, with its own runtime."""

    name: str
    pythonpath: str | None
    work: Path
    samples: dict[str, list[float]] = field(default_factory=dict)
    runtime: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.work / "shared" / "api.sock"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JMP_", "JUMPSTARTER_"))}
        env["PATH"] = f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}"
        return with_pythonpath(env, self.pythonpath) | extra

    def add(self, key: str, value: float) -> None:
        self.samples.setdefault(key, []).append(value)

    def median(self, key: str) -> float | None:
        values = self.samples.get(key)
        return statistics.median(values) if values else None


def exporter_config(path: Path, socket: Path | None) -> Path:
    """An ExporterConfig with upstream's MockPower as ``mock`` and, given a socket, our VM as ``vm``."""
    export: dict = {"mock": {"type": "jumpstarter_driver_power.driver.MockPower"}}
    if socket is not None:
        export["vm"] = {"type": "jumpstarter_driver_vmsidecar.driver.VirtualMachine",
                        "config": {"socket": str(socket), "recycle": "InPlaceReuse"}}
    path.write_text(json.dumps({"apiVersion": "jumpstarter.dev/v1alpha1", "kind": "ExporterConfig",
                                "metadata": {"namespace": "default", "name": path.stem}, "endpoint": "",
                                "token": "", "export": export}))
    return path


def start_runtime(tree: Tree, disk: Path, memory: str, timeout: float) -> None:
    """``serve`` on the tree's own dirs, until Ready (a cold start: it captures the snapshot)."""
    spec = tree.work / "spec.json"
    spec.write_text(json.dumps({"image": f"file:{disk}", "memory": memory, "readiness": {"pattern": MARKER.decode()}}))
    with open(tree.work / "runtime.log", "wb") as log:
        tree.runtime = subprocess.Popen(
            [str(BIN / "vmsidecar-runtime"), "serve", "--spec", str(spec), "--shared-dir", str(tree.work / "shared"),
             "--cache-dir", str(tree.work / "cache"), "--state-dir", str(tree.work / "state"), "--grace", "5"],
            stdout=subprocess.DEVNULL, stderr=log, env=tree.env())
    runtime_cli(tree, "wait-ready", "--timeout", str(int(timeout)))


def runtime_cli(tree: Tree, *args: str) -> str:
    deadline = time.monotonic() + 60
    while not tree.socket.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{tree.name}: the runtime did not serve; see {tree.work / 'runtime.log'}")
        time.sleep(0.05)
    done = subprocess.run([str(BIN / "vmsidecar-runtime"), *args, "--socket", str(tree.socket)], env=tree.env(),
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{tree.name}: vmsidecar-runtime {' '.join(args)}: {done.stdout}{done.stderr}")
    return done.stdout


def shell(tree: Tree, config: Path, script: str, marks: Path, calls: int) -> dict[str, float]:
    """Run ``script`` in ``jmp shell``; returns each step's seconds and the shell's start and end."""
    marks.unlink(missing_ok=True)
    env = tree.env(MARKS=str(marks), SOCK=str(tree.socket), CALLS=str(calls))
    started = time.time()
    done = subprocess.run([str(BIN / "jmp"), "shell", "--exporter-config", str(config), "--", "bash", "-c", script],
                          env=env, capture_output=True, text=True, timeout=900, cwd=marks.parent)
    ended = time.time()
    if done.returncode != 0:
        raise RuntimeError(f"{tree.name}: jmp shell exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    steps = {key: (float(s), float(e)) for key, s, e in (line.split() for line in marks.read_text().splitlines())}
    result = {key: e - s for key, (s, e) in steps.items() if key not in ("inside", "end")}
    result["shell_start"] = steps["inside"][0] - started
    result["shell_end"] = ended - steps["end"][0]
    calls_file = marks.with_name(marks.name + ".calls")
    if calls_file.exists():
        result |= json.loads(calls_file.read_text())
    return result


def j_outside(tree: Tree) -> float:
    """``j`` outside a shell: its imports, then a refusal."""
    started = time.perf_counter()
    subprocess.run([str(BIN / "j")], env=tree.env(), capture_output=True, timeout=120)
    return time.perf_counter() - started


def driver_import(tree: Tree) -> float:
    """Seconds to import our driver in an exporter (``-X importtime``, cumulative, after what
    ``jmp shell`` and upstream's drivers import anyway)."""
    code = ("import jumpstarter.exporter, jumpstarter_cli.shell, jumpstarter_driver_power.driver\n"
            "import jumpstarter_driver_vmsidecar.driver")
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=tree.env(), capture_output=True,
                         text=True, timeout=120).stderr
    for line in err.splitlines():
        if line.startswith("import time:") and line.rsplit("|", 1)[1].strip() == "jumpstarter_driver_vmsidecar.driver":
            return int(line.split("|")[1]) / 1e6
    raise RuntimeError(f"{tree.name}: no import time for the driver:\n{err[-2000:]}")


def one_run(tree: Tree, calls: int) -> None:
    runtime_cli(tree, "recycle", "--no-boot")  # Stopped, a fresh generation: power on restores
    vm = shell(tree, tree.work / "vm.json", SCRIPT.replace("{per_call}", PER_CALL), tree.work / "marks", calls)
    mock = shell(tree, tree.work / "mock.json", 'echo "inside $EPOCHREALTIME $EPOCHREALTIME" >> "$MARKS"; '
                 'echo "end $EPOCHREALTIME $EPOCHREALTIME" >> "$MARKS"', tree.work / "marks-mock", calls)
    state = json.loads(runtime_cli(tree, "status", "--json"))
    if state["phase"] != "Ready" or state["snapshot"]["boot"] != "restored":
        raise RuntimeError(f"{tree.name}: after the shell: {state['phase']}, {state['snapshot']}")
    for key, value in vm.items():
        tree.add(key, value)
    tree.add("mock_shell_start", mock["shell_start"])
    tree.add("mock_shell_end", mock["shell_end"])
    tree.add("j_outside", j_outside(tree))
    tree.add("driver_import", driver_import(tree))
    runtime_cli(tree, "recycle", "--no-boot")  # no guest of this tree runs while the other tree is measured


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def print_table(trees: list[Tree], runs: int) -> None:
    print(f"\nmedians of {runs} runs (seconds unless marked)")
    print(f"{'':34}" + "".join(f"{t.name:>10}" for t in trees) + ("  after÷before" if len(trees) == 2 else ""))
    for key, label in COLUMNS:
        values = [t.median(key) for t in trees]
        ratio = f"  {values[1] / values[0]:12.2f}" if len(trees) == 2 and values[0] and values[1] else ""
        print(f"{label:34}" + "".join(f"{_fmt(v):>10}" for v in values) + ratio)
    print("\nours (medians of the differences)")
    for tree in trees:
        ours = {
            "shell start: our driver": _diff(tree, "shell_start", "mock_shell_start"),
            "shell end: our recycle": _diff(tree, "shell_end", "mock_shell_end"),
            "j vm power read - j mock read": _diff(tree, "j_vm_read", "j_mock_read"),
            "per call (ms): vm - mock": _diff(tree, "call_vm_read", "call_mock_read"),
        }
        print(f"  {tree.name}: " + "; ".join(f"{k} {_fmt(v)}" for k, v in ours.items()))


def _diff(tree: Tree, a: str, b: str) -> float | None:
    pairs = list(zip(tree.samples.get(a, []), tree.samples.get(b, []), strict=False))
    return statistics.median(x - y for x, y in pairs) if pairs else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--calls", type=int, default=30, help="calls per kind in the per-call leg")
    p.add_argument("--before", type=Path, help="a checkout of another revision, measured in alternation")
    args = p.parse_args()
    guest = resolve_guest("tiny")
    if guest is None:
        return 2
    work = Path(tempfile.mkdtemp(prefix="vmsidecar-bench-exp-"))
    trees = []
    if args.before:
        src = args.before.resolve()
        trees.append(Tree("before", os.pathsep.join(str(src / d / "src") for d in ("drivers", "contract", "runtime")),
                          work / "before"))
    trees.append(Tree("after" if args.before else "this", None, work / "this"))
    try:
        print(f"load average at start: {loadavg()}", flush=True)
        for tree in trees:
            tree.work.mkdir(parents=True)
            exporter_config(tree.work / "vm.json", tree.socket)
            exporter_config(tree.work / "mock.json", None)
            start_runtime(tree, guest.disk, guest.memory, guest.timeout)
            print(f"{tree.name}: runtime Ready, snapshot captured", flush=True)
        for i in range(args.runs):
            for tree in trees:
                one_run(tree, args.calls)
                print(f"run {i + 1} {tree.name:7} " + " ".join(
                    f"{key} {_fmt(values[-1])}" for key, values in tree.samples.items()), flush=True)
        print(f"load average at end: {loadavg()}")
        print_table(trees, args.runs)
    finally:
        for tree in trees:
            if tree.runtime is not None:
                tree.runtime.terminate()
                try:
                    tree.runtime.wait(60)
                except subprocess.TimeoutExpired:
                    tree.runtime.kill()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
