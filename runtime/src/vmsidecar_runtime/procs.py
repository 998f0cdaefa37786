"""Child processes: one way to start them, so the PID-1 reaper knows which ones are ours, and
with an environment that holds nothing but what programs need to run (:func:`child_env`)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from landlockpy import LandlockError, Ruleset

from vmsidecar_contract.errors import HostError

from .confinement import NO_CAPABILITIES
from .threads import current_abort

log = logging.getLogger(__name__)

#: pids started through ``spawn`` and not yet waited for; the reaper leaves these to asyncio
OWN: set[int] = set()
#: children being started whose pid is not in ``OWN`` yet, under ``_STARTING_LOCK`` with the reaper's
#: look: a child of ours that exits before its pid is recorded (``qemu-img create`` on a busy loop)
#: looked like an orphan, was reaped, and asyncio then reported it "returncode 255" (a CI run's pod)
_starting = 0
_STARTING_LOCK = threading.Lock()


@contextlib.contextmanager
def _starting_child() -> Iterator[None]:
    global _starting
    with _STARTING_LOCK:
        _starting += 1
    try:
        yield
    finally:
        with _STARTING_LOCK:
            _starting -= 1


def reap_orphans() -> None:
    """As PID 1: reap the adopted orphans that have exited, never a child of ours (``OWN``, or one
    being started: then this look waits for the next)."""
    with _STARTING_LOCK, contextlib.suppress(ChildProcessError, OSError):
        while not _starting:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            # asyncio and subprocess wait for the processes started here; everything else is an orphan
            if info is None or info.si_pid in OWN:
                break
            os.waitpid(info.si_pid, os.WNOHANG)

#: util-linux's setpriv sets PR_SET_PDEATHSIG(SIGKILL) on itself and execs the program: the kernel
#: kills the child when the runtime dies, however it dies, and no Python code runs between fork and
#: exec (``preexec_fn`` is not safe in a process with threads: the child may inherit a lock that
#: another thread held at fork time and deadlock before exec)
DEATH_SIGNAL = ("--pdeathsig", "KILL")

#: the runtime's environment may hold secrets (registry credentials, the auth file's path, whatever
#: the pod injects); QEMU, qemu-img, libvirtd and their helpers need none of it, and a guest that
#: escapes into QEMU would read /proc/self/environ first. Only these pass to a child:
CHILD_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
             "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME",  # libvirt's session paths
             "LD_LIBRARY_PATH", "PYTHONPATH")  # a QEMU or libvirt built into a prefix; nsinit is Python
#: and variables starting with these (locale; libvirt's own debug settings)
CHILD_ENV_PREFIXES = ("LC_", "LIBVIRT_")


def child_env() -> dict[str, str]:
    """The runtime's environment reduced to :data:`CHILD_ENV` and :data:`CHILD_ENV_PREFIXES`."""
    return {k: v for k, v in os.environ.items() if k in CHILD_ENV or k.startswith(CHILD_ENV_PREFIXES)}


@functools.cache
def _util_linux(program: str, why: str) -> str:
    """The path of a util-linux ``program`` the runtime execs children through."""
    path = shutil.which(program)
    if path is None:
        raise HostError(f"{program} is not installed; apt-get install util-linux ({why})")
    return path




#: CAP_SETPCAP's bit: dropping from the bounding set needs it (setpriv says nothing when it fails)
_CAP_SETPCAP = 1 << 8


@functools.cache
def _warn_capabilities_kept() -> None:
    log.warning("the runtime runs as root without CAP_SETPCAP: QEMU cannot be started without the "
                "container's capabilities (a guest escaped into it would hold them); give the runtime "
                "container CAP_SETPCAP, or run it as a user other than root")


@functools.cache  # (the runtime's capabilities do not change: read once, not at every QEMU's start)
def effective_capabilities() -> int:
    """The runtime's effective capability set (/proc/self/status ``CapEff``, a bit per capability)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def _can_drop_bounding_set() -> bool:
    return bool(effective_capabilities() & _CAP_SETPCAP)


def die_with_parent_argv(argv: tuple[str, ...], *, no_capabilities: bool = False) -> tuple[str, ...]:
    """``argv`` prefixed so that the kernel SIGKILLs the program when its parent *thread* dies;
    ``no_capabilities``: and so that, started by root, it holds none (said in the log once when the
    runtime cannot: without CAP_SETPCAP, root's exec gets the bounding set back)."""
    why = "the runtime starts QEMU through `setpriv --pdeathsig KILL` so that no guest outlives it"
    drop: tuple[str, ...] = ()
    if no_capabilities and os.geteuid() == 0:
        drop = NO_CAPABILITIES
        if not _can_drop_bounding_set():
            _warn_capabilities_kept()
    return (_util_linux("setpriv", why), *DEATH_SIGNAL, *drop, "--", *argv)


def _fork(argv: tuple[str, ...], confine: Ruleset | None,
          then: Callable[[subprocess.Popen[bytes]], None] | None = None,
          **kwargs: Any) -> tuple[subprocess.Popen[bytes], int | None]:
    """``subprocess.Popen(argv, **kwargs)`` (the environment :func:`child_env` unless ``env`` is
    given), its pid recorded, forked by a thread of its own which first enters the Landlock domain
    of ``confine`` (when given) and runs ``then`` with the child before it ends; the child, once it
    started, and, when ``then`` takes it over (waits for it on that thread), a pidfd of it to signal
    it by (None on a kernel without pidfds, < 5.3).

    A domain confines the thread that enters it and the children it forks from then on, never the
    runtime's other threads, and the child starts in it with nothing of ours between fork and exec
    (a ``python -I -S`` that entered it took 10 ms of each QEMU's and qemu-img's start). A thread of
    its own also because PDEATHSIG follows the thread that forked: :func:`spawn`'s waits there for
    its child's end.

    :raise HostError: the domain could not be entered; nothing was started (never unconfined once
        the runtime chose to confine it).
    """
    started: queue.SimpleQueue[tuple[subprocess.Popen[bytes], int | None] | BaseException] = queue.SimpleQueue()
    kwargs.setdefault("env", child_env())

    def fork() -> None:
        try:
            if confine is not None:
                try:
                    confine.restrict()  # this thread only (no TSYNC), with no_new_privs
                except (LandlockError, OSError) as e:
                    raise HostError(f"cannot enter the Landlock domain made for {os.path.basename(argv[0])} "
                                    f"({e}); it was not started") from None
            with _starting_child():
                proc = subprocess.Popen(argv, **kwargs)
                OWN.add(proc.pid)
        except BaseException as e:
            started.put(e)
            return
        if then is None:
            started.put((proc, None))
            return
        try:
            pidfd: int | None = os.pidfd_open(proc.pid)  # before it can be reaped: only ``then`` waits for it
        except OSError:
            pidfd = None
        started.put((proc, pidfd))
        then(proc)

    threading.Thread(target=fork, name=f"child-{os.path.basename(argv[0])}", daemon=True).start()
    got = started.get()
    if isinstance(got, BaseException):
        raise got
    return got


class Child:
    """A child started by :func:`spawn`: what the runtime uses of asyncio's ``Process`` (``pid``,
    ``returncode``, the ``stdout`` and ``stderr`` readers, ``wait``, ``communicate``, the signals).

    The thread that forked it waits for it and tells the loop (``exited``); signals go through a
    pidfd, so none reaches a process that took the pid of a child reaped meanwhile (by pid, as
    asyncio does, on a kernel without pidfds)."""

    def __init__(self, proc: subprocess.Popen[bytes], pidfd: int | None, exited: asyncio.Future[int]) -> None:
        self.pid = proc.pid
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self._pidfd = pidfd
        self._exited = exited
        exited.add_done_callback(self._reaped)  # first: before any waiter resumes

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    def _reaped(self, _: asyncio.Future[int]) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    async def _connect(self, proc: subprocess.Popen[bytes]) -> None:
        loop = asyncio.get_running_loop()
        for name in ("stdout", "stderr"):
            if (pipe := getattr(proc, name)) is not None:
                reader = asyncio.StreamReader(loop=loop)
                await loop.connect_read_pipe(functools.partial(asyncio.StreamReaderProtocol, reader), pipe)
                setattr(self, name, reader)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    async def communicate(self) -> tuple[bytes, bytes]:
        """All of stdout and stderr (empty when not piped), then the child's end."""
        async def read(reader: asyncio.StreamReader | None) -> bytes:
            return await reader.read() if reader is not None else b""

        out, err = await asyncio.gather(read(self.stdout), read(self.stderr))
        await self.wait()
        return out, err

    def send_signal(self, sig: int) -> None:
        """:raise ProcessLookupError: the child has ended."""
        if self._exited.done():
            raise ProcessLookupError(self.pid)
        if self._pidfd is None:
            os.kill(self.pid, sig)
        else:
            signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


async def spawn(*argv: str, die_with_parent: bool = False, no_capabilities: bool = False,
                confine: Ruleset | None = None, **kwargs: Any) -> Child:
    """Start ``argv`` (list exec, never a shell), its pid recorded, forked by a thread of its own
    that waits for it (:func:`_fork`); ``stdin``, ``stdout``, ``stderr`` and the rest as
    ``asyncio.create_subprocess_exec`` takes them.

    ``die_with_parent`` makes the kernel kill the child when the runtime dies, however it dies;
    ``no_capabilities`` with it: a child of a root runtime runs with no capability (QEMU: it needs
    none; libvirt's helpers do); ``confine``: the child runs in that Landlock domain
    (``confinement.py``; the caller closes the ruleset once the child started).
    The child gets :func:`child_env` unless ``env`` is given (:func:`_fork`).
    PDEATHSIG follows the thread that forked, not the process: that thread lives until the child
    has ended. setpriv execs the program in place, so ``proc.pid`` is the program's pid (QEMU's,
    libvirt's unshare's).

    :raise HostError: when ``die_with_parent`` is asked for and setpriv is not installed, or the
        domain of ``confine`` could not be entered.
    :raise TypeError: on ``preexec_fn``, which this runtime never uses (see ``DEATH_SIGNAL``).
    """
    if "preexec_fn" in kwargs:
        raise TypeError("spawn() takes no preexec_fn: Python code between fork and exec is unsafe with threads")
    if die_with_parent and sys.platform == "linux":
        argv = die_with_parent_argv(argv, no_capabilities=no_capabilities)
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[int] = loop.create_future()

    def wait_for(proc: subprocess.Popen[bytes]) -> None:
        returncode = proc.wait()
        OWN.discard(proc.pid)
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(exited.set_result, returncode)

    proc, pidfd = _fork(argv, confine, wait_for, **kwargs)
    child = Child(proc, pidfd, exited)
    try:
        await child._connect(proc)
    except BaseException:  # cancelled before the caller holds the child: nobody else could stop it
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        await child.wait()
        raise
    return child


def inherited_path(fd: int) -> Path:
    """The path a child given ``fd`` (``pass_fds``: the same number) opens it by: ``/proc/self`` is
    the child when the child opens it (QEMU's memfd RAM, its console pipes)."""
    return Path(f"/proc/self/fd/{fd}")


#: the stack of a helper held to ``max_memory``, and of each of its threads (QEMU runs its block
#: layer's work on coroutines with stacks of their own)
THREAD_STACK = 2 << 20
#: what :func:`run` keeps of a helper's output by default: far more than the helpers print about an
#: honest input, far less than a hostile one can make them print (below)
MAX_OUTPUT = 1 << 20


class OutputTooLarge(Exception):
    """A helper printed more than :func:`run` keeps on its standard output (it was killed)."""

    def __init__(self, program: str, limit: int) -> None:
        super().__init__(f"{program} printed more than {limit} bytes")
        self.program, self.limit = program, limit


def run(*argv: str, timeout: float | None = None, max_output: int = MAX_OUTPUT,
        max_memory: int | None = None, confine: Ruleset | None = None) -> tuple[int, str, str]:
    """Run a helper program to completion from a worker thread: ``(rc, stdout, stderr)``; past
    ``timeout`` seconds it is killed. ``max_memory``: the bytes of heap and private mappings the
    kernel lets it take (RLIMIT_DATA, through util-linux's ``prlimit``, which sets the limit on
    itself and execs the program in place, like setpriv: no Python between fork and exec). Thread
    stacks are such mappings, 8 MiB each by default (qemu-img's I/O pool grows to 64 threads under
    load: 512 MiB, which failed an honest check in a CI run): with ``max_memory`` the default stack
    is :data:`THREAD_STACK` (RLIMIT_STACK, which glibc takes as the threads' default).

    Its output is read as it comes, never whole: ``qemu-img check`` prints a line per cluster whose
    refcount is off, and a crafted qcow2 of a few KB makes that gigabytes (``subprocess``'s
    ``communicate`` would hold them all in the runtime). Of stderr the last ``max_output`` bytes are
    kept (where the verdict is); stdout is the answer, and past ``max_output`` bytes the program is
    killed and :class:`OutputTooLarge` raised.

    The pid is recorded like :func:`spawn`'s, because the PID-1 reaper would otherwise collect
    the child first and ``subprocess`` would then report a failed ``qemu-img check`` as rc 0.
    The child gets :func:`child_env`.

    Run for work that may be given up (:func:`.threads.current_abort`), the program is killed when
    it is: nothing keeps reading an image the runtime abandoned until its own deadline.

    ``confine``: the program runs in that Landlock domain (:func:`_fork`; the caller closes the
    ruleset).

    :raise FileNotFoundError: when the program is not installed.
    :raise HostError: ``max_memory`` asked for and prlimit is not installed, or the domain of
        ``confine`` could not be entered.
    :raise subprocess.TimeoutExpired: past ``timeout`` (the program killed and reaped).
    :raise OutputTooLarge: past ``max_output`` bytes of stdout (the program killed and reaped).
    :raise threads.Abandoned: the work was given up (the program killed and reaped).
    """
    program = os.path.basename(argv[0])
    if max_memory is not None:
        why = "the runtime holds qemu-img to a memory bound through `prlimit --data` while it reads an image"
        prlimit = _util_linux("prlimit", why)
        argv = (prlimit, f"--data={max_memory}", f"--stack={THREAD_STACK}", "--", *argv)
    proc, _ = _fork(argv, confine, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    abort = current_abort()
    # the hook runs on the thread that gives the work up; Popen.kill polls first and does not signal
    # a child already reaped (bpo-38630), whose pid another process may have by then
    unhook = abort.on_set(proc.kill) if abort is not None else None
    try:
        out, err = _communicate_bounded(proc, timeout, max_output, program)
        if abort is not None:
            abort.check()  # killed for it: its rc and output say nothing of the image
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        if unhook is not None:
            unhook()
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()
        OWN.discard(proc.pid)
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def _communicate_bounded(proc: subprocess.Popen[bytes], timeout: float | None, limit: int,
                         program: str) -> tuple[bytes, bytes]:
    """``communicate``, bounded: both pipes of ``proc`` to their end and then its exit, within
    ``timeout`` seconds; all of stdout (at most ``limit`` bytes), the tail of stderr."""
    assert proc.stdout is not None and proc.stderr is not None
    deadline = None if timeout is None else time.monotonic() + timeout
    out = bytearray()
    err: collections.deque[bytes] = collections.deque()
    err_size = 0
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        selector.register(proc.stderr, selectors.EVENT_READ)
        while selector.get_map():
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                raise subprocess.TimeoutExpired(proc.args, timeout or 0)
            for key, _ in selector.select(wait):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fileobj)
                elif key.fileobj is proc.stdout:
                    out += chunk
                    if len(out) > limit:
                        raise OutputTooLarge(program, limit)
                else:
                    err.append(chunk)
                    err_size += len(chunk)
                    while err_size - len(err[0]) >= limit:
                        err_size -= len(err.popleft())
    # its pipes closed, it may still run (a daemon's fork, say): the same deadline
    proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    tail = b"".join(err)
    return bytes(out), tail[-limit:]


#: the kernel's PF_EXITING (include/linux/sched.h), in /proc/PID/stat's flags: set as a process
#: enters do_exit, before the kernel frees its memory
PF_EXITING = 0x4


def exiting_or_gone(pid: int) -> bool:
    """Whether process ``pid`` has entered its exit in the kernel, or is gone: it runs no code of its
    own any more (``QemuBackend.quit``; the tests' count of QEMUs running a guest)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    fields = stat.rsplit(")", 1)[1].split()  # after the command's name, which may hold anything
    return fields[0] in ("Z", "X") or bool(int(fields[6]) & PF_EXITING)  # state (3), flags (9)


def threads_cpu_seconds(pid: int, name_prefix: str) -> float | None:
    """The CPU time (user + system, seconds) used so far by the threads of ``pid`` whose name starts
    with ``name_prefix`` (QEMU names its vCPU threads "CPU <n>/TCG" or "CPU <n>/KVM" with
    ``-name debug-threads=on``); None when the process is gone or has no such thread."""
    total, found = 0, False
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            if not (task / "comm").read_text().startswith(name_prefix):
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (stat fields 14 and 15)
        found = True
    return total / os.sysconf("SC_CLK_TCK") if found else None
