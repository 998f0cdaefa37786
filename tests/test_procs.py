"""Children die with the runtime, with no Python code between fork and exec (issue 13).

``procs.spawn(die_with_parent=True)`` execs the program through ``setpriv --pdeathsig KILL``:
real processes here, a parent with busy threads SIGKILLed, its child checked in /proc.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from landlockpy import Ruleset

from fixtures.source import parse_python
from fixtures.waiting import wait_until, wait_until_async
from vmsidecar_runtime import confinement, procs
from vmsidecar_runtime.disk import run_tool

ROOT = Path(__file__).parents[1]

#: a parent with threads that keep taking locks (the case preexec_fn is unsafe in), which spawns
#: ``sleep`` from its event loop and prints the child's pid
PARENT = """
import asyncio, logging, sys, threading
from vmsidecar_runtime.procs import spawn
log = logging.getLogger("busy")
def busy():
    while True:
        log.debug("held and released")
for _ in range(4):
    threading.Thread(target=busy, daemon=True).start()
async def main():
    proc = await spawn("sleep", "600", die_with_parent=sys.argv[1] == "1")
    print(proc.pid, flush=True)
    await asyncio.Event().wait()  # until killed
asyncio.run(main())
"""


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for whatever init adopted it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def _start_parent(die_with_parent: bool) -> tuple[subprocess.Popen[str], int]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, "1" if die_with_parent else "0"],
                              stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    wait_until(lambda: _cmdline(pid)[:1] == ["sleep"], 10, "setpriv to exec sleep in place", interval=0.02)
    return parent, pid


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux")
def test_a_killed_parent_takes_its_child_along() -> None:
    parent, child = _start_parent(die_with_parent=True)
    # the recorded pid is the program's own: setpriv exec'd into it, no wrapper process is left
    assert _cmdline(child) == ["sleep", "600"]
    assert int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1]) == parent.pid
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    wait_until(lambda: not _alive(child), 10, "the child to die with its SIGKILLed parent")


def test_without_die_with_parent_the_child_survives() -> None:
    """The control: the same parent and kill, without the flag, leaves the child running."""
    parent, child = _start_parent(die_with_parent=False)
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        time.sleep(0.5)  # survival is only shown by waiting; PDEATHSIG would be sent as the parent exits
        assert _alive(child)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


async def test_spawn_refuses_preexec_fn() -> None:
    with pytest.raises(TypeError, match="preexec_fn"):
        await procs.spawn("true", preexec_fn=lambda: None)


def test_no_preexec_fn_anywhere() -> None:
    """No call in our packages passes preexec_fn (Python code between fork and exec)."""
    offenders = []
    for package in ("contract", "runtime", "drivers", "images"):
        for path in (ROOT / package / "src").rglob("*.py"):
            for node in ast.walk(parse_python(path)):
                if isinstance(node, ast.keyword) and node.arg == "preexec_fn":
                    offenders.append(f"{path.relative_to(ROOT)}:{node.value.lineno}")
                elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                        and node.slice.value == "preexec_fn" and isinstance(node.ctx, ast.Store):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


async def test_a_cancelled_tool_leaves_no_process_behind() -> None:
    """A helper program whose caller gives up (a boot cancelled during ``qemu-img create``, a dump
    during its ``convert``) is killed and reaped: nothing goes on writing a file the runtime
    abandoned, and its pipes close while the event loop still runs."""
    before = set(procs.OWN)
    task = asyncio.create_task(run_tool("sleep", "30"))
    pid = await wait_until_async(lambda: next(iter(procs.OWN - before), None), 10, "the tool to start")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not Path(f"/proc/{pid}").exists(), Path(f"/proc/{pid}/stat").read_text()
    assert pid not in procs.OWN



def test_the_pid_1_reaper_never_takes_a_child_of_ours_that_exits_before_it_is_recorded() -> None:
    """The runtime as a pod's PID 1 reaps orphans, leaving its own children (``OWN``) to asyncio and
    ``subprocess``. One that exited before its pid was recorded (``qemu-img create`` on a busy loop)
    was reaped as an orphan: asyncio said "Unknown child process pid 33, will report returncode 255"
    and a CI run's pod failed its boot ("cannot create the disk overlay … ()"). The interleaving, made
    deterministic: a child exits while it is being started, and the reaper looks then."""
    def exited(pid: int) -> None:
        wait_until(lambda: os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None, 10,
                   f"child {pid} to exit")

    with procs._starting_child():  # white box: the window between the fork and OWN.add
        ours = subprocess.Popen(["sh", "-c", "exit 3"])
        exited(ours.pid)
        procs.reap_orphans()
        procs.OWN.add(ours.pid)
    try:
        assert ours.wait(10) == 3, "the reaper took a child of ours for an orphan"
    finally:
        procs.OWN.discard(ours.pid)

    orphan = subprocess.Popen(["sh", "-c", "exit 4"])  # (not ours to the reaper: in no record)
    exited(orphan.pid)
    procs.reap_orphans()
    with pytest.raises(ChildProcessError):
        os.waitpid(orphan.pid, os.WNOHANG)  # already reaped: the reaper still does its job


def test_a_helper_that_prints_without_end_is_killed_and_its_stderr_kept_to_its_tail() -> None:
    """``run`` reads a helper's output as it comes: stdout past its bound kills the helper
    (``OutputTooLarge``), of stderr only the last bytes are kept (``qemu-img check`` prints a line per
    bad cluster: millions for a crafted disk), and either way nothing of it is left running."""
    before = set(procs.OWN)
    started = time.monotonic()
    with pytest.raises(procs.OutputTooLarge) as exc:
        procs.run("yes", max_output=1 << 16)  # prints for ever
    assert exc.value.limit == 1 << 16 and "yes printed more than 65536 bytes" in str(exc.value)
    assert time.monotonic() - started < 10 and not procs.OWN - before
    chatty = "seq 1 200000 >&2; echo last words >&2; echo answer"
    rc, out, err = procs.run("sh", "-c", chatty, max_output=1000)
    assert (rc, out) == (0, "answer\n")
    assert err.endswith("199999\n200000\nlast words\n") and len(err) == 1000, (len(err), err[:40])
    with pytest.raises(subprocess.TimeoutExpired):
        procs.run("sleep", "30", timeout=0.5)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):  # its pipes closed, still running: the same deadline
        procs.run("sh", "-c", "exec sleep 30 >/dev/null 2>&1", timeout=0.5)
    assert time.monotonic() - started < 10
    assert not procs.OWN - before


@pytest.mark.skipif(os.geteuid() != 0, reason="the capability drop concerns a runtime started by root")
def test_a_root_runtime_starts_qemu_without_capabilities_or_says_why_it_cannot() -> None:
    """Started by root, QEMU held every capability of the container; ``setpriv --bounding-set -all``
    drops them, but only with CAP_SETPCAP, and says nothing when it cannot."""
    show = ("grep", "-E", "^Cap(Prm|Eff|Bnd|Amb)", "/proc/self/status")
    out = subprocess.run(procs.die_with_parent_argv(show, no_capabilities=True), capture_output=True, text=True,
                         check=True).stdout
    assert {line.split()[1] for line in out.splitlines()} == {"0" * 16}, out
    probe = ("import logging, sys; logging.basicConfig(); from vmsidecar_runtime import procs; "
             "procs.die_with_parent_argv(('true',), no_capabilities=True)")
    without = subprocess.run(["setpriv", "--bounding-set", "-setpcap", "--", sys.executable, "-c", probe],
                             capture_output=True, text=True, timeout=60)
    assert "without CAP_SETPCAP" in without.stderr and "give the runtime container CAP_SETPCAP" in without.stderr, (
        without.stderr)


def _confined_to_system(program: str) -> Ruleset:
    """A domain that opens the system's directories and ``program``'s prefix, nothing of tmp_path."""
    ruleset = confinement.ruleset_for(confinement.tool_rules(program))
    assert ruleset is not None, "this kernel has Landlock (Linux 6.x in CI)"
    return ruleset


async def test_a_confined_child_is_in_its_domain_and_the_runtime_is_not(tmp_path: Path) -> None:
    """The domain is entered by the thread that forks the child (``procs._fork``), not by a program
    between fork and exec: the child cannot open a file outside it, while the calling thread and the
    others (the event loop's) still can, before and after."""
    secret = tmp_path / "auth.json"
    secret.write_text("s3cret")
    with contextlib.closing(_confined_to_system("cat")) as ruleset:
        rc, out, err = await asyncio.to_thread(procs.run, "cat", str(secret), confine=ruleset)
    assert (rc, out) == (1, "") and "Permission denied" in err, (rc, out, err)
    with contextlib.closing(_confined_to_system("cat")) as ruleset:
        child = await procs.spawn("cat", str(secret), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  die_with_parent=True, confine=ruleset)
    out_b, err_b = await child.communicate()
    assert (child.returncode, out_b) == (1, b"") and b"Permission denied" in err_b, (child.returncode, err_b)
    assert secret.read_text() == "s3cret"  # the loop's thread
    assert await asyncio.to_thread(secret.read_text) == "s3cret"  # a worker thread, the one run() used among them
    rc, out, _ = await asyncio.to_thread(procs.run, "cat", str(secret))
    assert (rc, out) == (0, "s3cret")


@pytest.mark.parametrize("confined", [False, True], ids=["unconfined", "confined"])
async def test_a_child_that_dies_with_its_parent_outlives_the_call_that_started_it(confined: bool) -> None:
    """PDEATHSIG follows the thread that forked: the thread that forks a child (to enter its domain)
    must live as long as the child, or the kernel kills the child as that thread ends."""
    with contextlib.closing(_confined_to_system("sleep")) if confined else contextlib.nullcontext() as ruleset:
        child = await procs.spawn("sleep", "600", die_with_parent=True, confine=ruleset)
    try:
        await asyncio.sleep(0.5)  # survival is only shown by waiting
        assert _alive(child.pid) and child.returncode is None
    finally:
        child.kill()
    assert await asyncio.wait_for(child.wait(), 10) == -signal.SIGKILL
    assert child.pid not in procs.OWN


async def test_a_signal_to_a_child_that_ended_reaches_no_other_process() -> None:
    """Signals go through the child's pidfd: once it ended (its pid free for another process) a
    signal raises ProcessLookupError, as asyncio's Process does, instead of reaching whoever has the pid."""
    child = await procs.spawn("true")
    assert await asyncio.wait_for(child.wait(), 10) == 0
    with pytest.raises(ProcessLookupError):
        child.send_signal(signal.SIGTERM)


async def test_a_spawn_cancelled_before_it_returns_leaves_no_process_behind() -> None:
    """The child is started (its pid recorded) before ``spawn`` has connected its pipes and returned
    it: a caller cancelled in between (a boot given up as QEMU starts) never holds the child to kill
    it, so ``spawn`` kills and reaps it itself."""
    before = set(procs.OWN)
    task = asyncio.create_task(procs.spawn("sleep", "30", stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    while not (started := procs.OWN - before):
        await asyncio.sleep(0)  # the first step of the loop once the child is recorded: spawn is connecting its pipes
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    [pid] = started
    assert not Path(f"/proc/{pid}").exists(), Path(f"/proc/{pid}/stat").read_text()
    assert pid not in procs.OWN
