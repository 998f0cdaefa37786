"""The one launcher of a ``vmsidecar-runtime serve`` process: start, wait until it serves, stop.

``vmsidecar-shell`` (the drivers' ``local``), bench/ and the tests all start runtimes through
:class:`RuntimeProcess`. It runs the ``vmsidecar-runtime`` console script of this Python
environment, as a user would: the contract imports nothing of the runtime. Importing this module
costs only the standard library; the async client (aiohttp, pydantic) loads when an async wait
needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from .blocking import BlockingRuntimeClient, RuntimeUnavailableError

if TYPE_CHECKING:
    from .state import VmState

#: seconds a runtime is given to serve its API (the imports and the bind; no guest needed),
#: generous because a loaded machine (TCG guests of other runtimes) slows the imports
SERVE_TIMEOUT_S = 60.0
#: seconds ``stop`` waits after the signal before it kills (the runtime's ``--grace`` is shorter)
STOP_TIMEOUT_S = 60.0
#: how much of the runtime's log an error message quotes
LOG_TAIL_CHARS = 3000


def child_pids(parent: int) -> list[int]:
    """The processes whose parent is ``parent`` (from each one's ``/proc/PID/stat``)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:  # the name before ")" may hold anything
            found.append(int(entry))
    return found


class RuntimeStartError(RuntimeError):
    """The runtime exited, or did not serve in time; the message ends with its log's tail."""


def runtime_command() -> list[str]:
    """The ``vmsidecar-runtime`` console script installed with this Python, else the one on PATH."""
    beside = Path(sys.executable).with_name("vmsidecar-runtime")
    found = str(beside) if beside.exists() else shutil.which("vmsidecar-runtime")
    if found is None:
        raise RuntimeStartError(f"vmsidecar-runtime is not installed next to {sys.executable} nor on PATH; install "
                                "vmsidecar-runtime (or jumpstarter-driver-vmsidecar[local]) in this environment")
    return [found]


def clean_environ(keep: Iterable[str] = ()) -> dict[str, str]:
    """This process's environment without the runtime's ``VMSIDECAR_*`` settings, but those in ``keep``:
    a variable left in the caller's shell would otherwise configure the runtime behind its argv."""
    kept = set(keep)
    return {k: v for k, v in os.environ.items() if not k.startswith("VMSIDECAR_") or k in kept}


class RuntimeProcess:
    """One ``vmsidecar-runtime serve`` process with its own shared and state directories."""

    def __init__(self, proc: subprocess.Popen[bytes], shared: Path, state: Path, log: Path) -> None:
        self.proc = proc
        self.shared = shared
        self.state = state
        self.log = log

    @classmethod
    def start(cls, root: Path, *, spec: Path | Mapping[str, Any] | None = None, cache: Path | None = None,
              args: Sequence[str] = (), env: Mapping[str, str] | None = None,
              command: Sequence[str] | None = None, cwd: Path | None = None) -> Self:
        """Start ``serve`` and return at once (then ``wait_serving`` or ``wait_ready``).

        Its sockets go to ``root/shared``, its overlay and logs to ``root/state``, its output to
        ``root/runtime.log``; a spec given as a mapping is written to ``root/spec.json``. ``cache``
        None: the runtime's default cache. ``args``: more ``serve`` options. ``env`` None: this
        process's environment (see ``clean_environ``). ``command``: the runtime's command line up
        to ``serve`` when not ``runtime_command()`` (another installation, behind ``setpriv``).
        """
        root.mkdir(parents=True, exist_ok=True)
        shared, state, log = root / "shared", root / "state", root / "runtime.log"
        argv = [*(command or runtime_command()), "serve", "--shared-dir", str(shared), "--state-dir", str(state)]
        if cache is not None:
            argv += ["--cache-dir", str(cache)]
        if isinstance(spec, Mapping):
            spec_file = root / "spec.json"
            spec_file.write_text(json.dumps(spec))
            spec = spec_file
        if spec is not None:
            argv += ["--spec", str(spec)]
        argv += args
        with open(log, "wb") as fh:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                    env=None if env is None else dict(env), cwd=cwd)
        return cls(proc, shared, state, log)

    @property
    def socket(self) -> Path:
        """The API socket."""
        return self.shared / "api.sock"

    def log_text(self) -> str:
        """Everything the runtime wrote (stdout and stderr)."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def _log_says(self) -> str:
        return f"its log {self.log} ends:\n{self.log_text()[-LOG_TAIL_CHARS:]}"

    def _exited(self, what: str) -> RuntimeStartError:
        return RuntimeStartError(f"vmsidecar-runtime exited with {self.proc.returncode} {what}; {self._log_says()}")

    def _check(self, deadline: float, timeout: float) -> None:
        """Raise once the process has exited or the deadline has passed."""
        if self.proc.poll() is not None:
            raise self._exited("before it served")
        if time.monotonic() > deadline:
            raise RuntimeStartError(f"vmsidecar-runtime did not serve {self.socket} within {timeout:g} s; "
                                    f"{self._log_says()}")

    async def wait_serving(self, timeout: float = SERVE_TIMEOUT_S, *, poll: float = 0.05) -> None:
        """Until the socket exists and ``/healthz`` answers; :class:`RuntimeStartError` if it exits or is late."""
        from .client import RuntimeClient

        deadline = time.monotonic() + timeout
        async with RuntimeClient(self.socket, timeout=10) as probe:
            while not (self.socket.exists() and await probe.healthy()):
                self._check(deadline, timeout)
                await asyncio.sleep(poll)

    def wait_serving_blocking(self, timeout: float = SERVE_TIMEOUT_S, *, poll: float = 0.05) -> None:
        """``wait_serving`` for a caller without an event loop."""
        probe = BlockingRuntimeClient(self.socket, timeout=10)
        deadline = time.monotonic() + timeout
        while not (self.socket.exists() and probe.healthy()):
            self._check(deadline, timeout)
            time.sleep(poll)

    async def wait_ready(self, timeout: float, *, poll: float = 0.25) -> VmState:
        """Until it serves and the guest is Ready, ``timeout`` seconds from now in all; a timeout, or the
        runtime exiting, quotes its log."""
        from .client import RuntimeClient

        deadline = time.monotonic() + timeout
        await self.wait_serving(timeout, poll=poll)
        async with RuntimeClient(self.socket) as client:
            try:
                return await client.wait_ready(max(1.0, deadline - time.monotonic()), poll=poll)
            except TimeoutError as e:
                raise TimeoutError(f"{e}; {self._log_says()}") from None
            except RuntimeUnavailableError:
                if self.proc.poll() is None:
                    raise
                raise self._exited("while the guest booted") from None

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` without waiting (to stop many at once; then ``stop`` each)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
        """Signal (the guest gets the runtime's graceful stop), wait, kill if it hangs; the exit code."""
        self.terminate(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        return self.proc.returncode

    def stop_in_handler(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """``stop`` for a signal handler: it waits with ``os.waitpid``, not the ``Popen``'s ``wait``,
        whose lock the interrupted main thread may hold (inside ``poll``, while it waits for the
        runtime to serve); the ``Popen`` keeps no exit code (the handler's process is ending)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        try:
            while not os.waitpid(self.proc.pid, os.WNOHANG)[0]:
                if time.monotonic() > deadline:
                    os.kill(self.proc.pid, signal.SIGKILL)
                    os.waitpid(self.proc.pid, 0)
                    return
                time.sleep(0.05)
        except ChildProcessError:  # reaped already
            pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
