"""``vmsidecar-runtime serve``: the long-lived process (often PID 1 of the runtime container).

Owns the shared directory (an exclusive lock: a second live runtime is refused), handles
SIGTERM/SIGINT with a bounded graceful guest stop, reaps orphans when it is PID 1, and removes
its sockets on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from vmsidecar_contract import DEFAULT_SHARED_DIR
from vmsidecar_contract.arch import host_arch
from vmsidecar_contract.errors import HostError
from vmsidecar_contract.spec import VmSpec
from vmsidecar_contract.state import Phase

from . import audit, procs
from .backend import close_backends
from .controller import RuntimePaths, VmController
from .controller.transfers import DEFAULT_PULL_TIMEOUT_S
from .hostpaths import HostPathPolicy
from .oci.cache import DiskCache
from .perms import forbid_inspection, restrict_umask, share_dir
from .plan import stream_names
from .snapshots import SnapshotStore, qemu_version

log = logging.getLogger("vmsidecar_runtime")

#: the contract's default: the CLI's client commands find the socket there without importing this module
DEFAULT_SHARED = DEFAULT_SHARED_DIR


def data_root() -> Path:
    """``/var/lib/vmsidecar`` when writable (containers, root), else the user's data dir.

    :raise HostError: when neither exists: an unprivileged UID without a home (``setpriv --reuid``
        of a UID with no passwd entry and no ``HOME``).
    """
    system = Path("/var/lib/vmsidecar")
    with contextlib.suppress(OSError):
        system.mkdir(parents=True, exist_ok=True)
    if os.access(system, os.W_OK):
        return system
    if os.environ.get("XDG_DATA_HOME"):
        return Path(os.environ["XDG_DATA_HOME"]) / "vmsidecar"
    try:
        home = Path.home()
    except (RuntimeError, KeyError):
        raise HostError(
            f"{system} is not writable by uid {os.getuid()} and this uid has no home directory (no HOME, no passwd "
            "entry) for the image cache and instance state; give --cache-dir and --state-dir (or VMSIDECAR_CACHE_DIR "
            "and VMSIDECAR_STATE_DIR), or set XDG_DATA_HOME"
        ) from None
    return home / ".local" / "share" / "vmsidecar"


def default_paths(shared: Path | None = None, cache: Path | None = None, state: Path | None = None) -> RuntimePaths:
    """Resolve directories from arguments, ``VMSIDECAR_*_DIR`` env, then defaults.

    The image cache and the instance state never go in the shared dir (a small emptyDir).
    """
    env = os.environ
    shared = shared or Path(env.get("VMSIDECAR_SHARED_DIR", DEFAULT_SHARED))
    # the data root only when a directory is left to default (an unprivileged UID may have none)
    cache = cache or Path(env.get("VMSIDECAR_CACHE_DIR") or data_root() / "cache")
    instance = hashlib.sha256(str(shared.resolve()).encode()).hexdigest()[:12]
    state = state or Path(env.get("VMSIDECAR_STATE_DIR") or data_root() / "instances" / instance)
    return RuntimePaths(shared=shared, cache=cache, state=state, run=private_run_dir())


#: the private run directories: ``vmsidecar-<pid>-<random>`` under the temporary directory
RUN_DIR = re.compile(r"vmsidecar-(\d+)-[A-Za-z0-9_]+")


def private_run_dir() -> Path:
    """A fresh directory for QEMU's private sockets, which need short paths (108 bytes): under /tmp,
    named with this process's pid. Those of this user's runtimes that are gone (killed: nothing of
    theirs ran at their end) are removed first, with the sockets of their QEMUs; one named with this
    very pid is an earlier process's (a pod's runtime is pid 1 after every restart, /tmp kept)."""
    tmp = Path(tempfile.gettempdir())
    for old in tmp.glob("vmsidecar-*-*"):
        match = RUN_DIR.fullmatch(old.name)
        with contextlib.suppress(OSError):
            if match and old.is_dir() and old.lstat().st_uid == os.getuid() and (
                    int(match[1]) == os.getpid() or not _alive(int(match[1]))):
                shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"vmsidecar-{os.getpid()}-", dir=tmp))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


#: bytes of a unix socket's path on Linux (sockaddr_un.sun_path is 108, with the terminating NUL)
SUN_PATH_MAX = 107


def check_socket_room(paths: RuntimePaths, spec: VmSpec | None) -> None:
    """Refuse a shared dir too deep for the sockets it will hold (the API's and the spec's streams),
    before binding any, rather than dying mid-start with ``AF_UNIX path too long``.

    :raise HostError: naming the deepest socket, the limit and the longest --shared-dir that fits.
    """
    sockets = [paths.shared / "api.sock", paths.shared / "gpio.sock"]
    sockets += [paths.stream_socket(name) for name in (stream_names(spec) if spec is not None else [])]
    deepest = max(sockets, key=lambda p: len(os.fsencode(p)))
    size = len(os.fsencode(deepest))
    if size > SUN_PATH_MAX:
        raise HostError(
            f"the shared directory {paths.shared} is too deep for its sockets: a unix socket's path holds at most "
            f"{SUN_PATH_MAX} bytes (108 with the NUL), and {deepest} has {size}; pass a --shared-dir of at most "
            f"{len(os.fsencode(paths.shared)) - size + SUN_PATH_MAX} bytes (e.g. /shared/vmsidecar)"
        )


def prepare_dirs(paths: RuntimePaths) -> None:
    """Create the shared, cache and state directories, or say which one this UID cannot use.

    Checked before anything else so that an unprivileged runtime (``setpriv --reuid``, a pod's
    ``runAsUser``) fails at once with the directory and the fix, not with a traceback mid-boot.

    :raise HostError: naming the directory, the uid/gid and what to do.
    """
    for what, flag, path in (("shared", "--shared-dir", paths.shared), ("image cache", "--cache-dir", paths.cache),
                             ("state", "--state-dir", paths.state)):
        if path is paths.shared and path.is_symlink():  # the exporter may write where it points
            raise HostError(f"the shared directory {path} is a symbolic link; pass the directory itself "
                            f"({flag} {path.resolve()})")
        if path.exists() and not path.is_dir():  # (mkdir says "File exists", and no chown helps)
            raise HostError(f"the {what} directory {path} is a file, not a directory; remove it or pass another {flag}")
        try:
            path.mkdir(parents=True, exist_ok=True)
            problem = "" if os.access(path, os.W_OK | os.X_OK) else "is not writable"
        except OSError as e:
            problem = f"cannot be created ({e.strerror})"
        if problem:
            uid, gid = os.getuid(), os.getgid()
            raise HostError(
                f"the {what} directory {path} {problem} for uid {uid} gid {gid}; make it writable by this user "
                f"(chown {uid}:{gid} {path}; in a pod: an emptyDir or a volume with fsGroup {gid}) or pass another "
                f"{flag}"
            )


class JsonFormatter(logging.Formatter):
    """One JSON object per log line (``--log-format json``)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(fmt: str, level: str = "INFO") -> None:
    """Log to stderr as text or JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    audit.setup()  # JSON lines whatever the format: the audit trail is parsed by tools


@dataclass
class SharedDirLock:
    """An exclusive flock on ``<shared>/.runtime.lock`` for the life of the process."""

    path: Path
    fd: int = -1

    def acquire(self) -> None:
        """Take the lock.

        :raise HostError: when another live runtime holds it.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # never through a link: the file is truncated and written (as root, the link's target)
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise HostError(f"{self.path} is a symbolic link; something else writes into the shared directory: "
                            "give the runtime a directory of its own (--shared-dir)") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(self.fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise HostError(
                f"another vmsidecar runtime (pid {owner}) is serving {self.path.parent}; stop it or use another "
                "--shared-dir"
            ) from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, str(os.getpid()).encode())

    def release(self) -> None:
        """Drop the lock and its file."""
        if self.fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            os.close(self.fd)
            self.fd = -1


async def _reap_orphans(stop: asyncio.Event, every: float = 1.0) -> None:
    """As PID 1, reap adopted orphans (one look every ``every`` seconds) without stealing the exit
    status of our own children."""
    while not stop.is_set():
        procs.reap_orphans()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


#: seconds the API's import waits at most for the boot to be under way (``_api_modules_once_booting``)
API_IMPORT_WAIT = 0.5
#: phases of a boot not yet under way: pulling, or starting QEMU (a cold guest is not running yet)
_NOT_UNDER_WAY = frozenset({Phase.PULLING, Phase.STOPPED, Phase.STARTING})


def _api_modules() -> tuple[ModuleType, ModuleType]:
    """The API's modules (``api.server``, ``api.health``): aiohttp and the request models."""
    from .api import health, server

    return server, health


async def _api_modules_once_booting(vm: VmController) -> tuple[ModuleType, ModuleType]:
    """The API's modules, imported in a thread once the boot is under way: a cold guest running, a
    restore begun (a warm start is over in less time than the imports take: they go beside its
    restore), the boot failed, or ``API_IMPORT_WAIT`` passed (a long download must not keep the
    API down). Imported beside the work before it, on the same GIL, they made a cold start's pull
    of a ``file:`` disk twice as long (0.08 -> 0.17 s), and beside QEMU's start (the overlay, the
    spawn, the QMP set-up before ``cont``) the guest ran 28 ms later (16 starts, medians)."""
    booting = vm.spec is not None and bool(vm.spec.image)  # else nothing boots before the API asks
    with contextlib.suppress(TimeoutError):
        async with vm.events.listen({"phase", "boot"}) as events, asyncio.timeout(API_IMPORT_WAIT):
            while booting and vm.phase in _NOT_UNDER_WAY:
                if vm.phase == Phase.STARTING and vm.snapshot_info.available:
                    break  # a restore (told by its boot event otherwise, once it is under way)
                event = await events.get()
                if event.type == "boot" and event.data.get("reason") == "restore":
                    break
    return await asyncio.to_thread(_api_modules)


async def serve(spec: VmSpec | None, paths: RuntimePaths, *, allow_extra_args: bool = False,
                host_paths: HostPathPolicy | None = None, grace: float = 30.0,
                pull_timeout: float = DEFAULT_PULL_TIMEOUT_S, health_listen: str | None = None) -> int:
    """Run the runtime until SIGTERM/SIGINT or ``POST /v1/shutdown``; returns the exit code.

    ``health_listen`` (``HOST:PORT``): also serve ``/healthz`` and ``/readyz``, and nothing else, on TCP
    for the kubelet's httpGet probes (``api/health.py``).

    A warm start (the guest restored from a snapshot in the cache) is over in less time than
    importing the API takes (aiohttp alone: its CA store, its client): the API's modules load in
    a thread while the guest boots, and the API answers once both are done. ``qemu --version``
    (part of a snapshot's key) runs meanwhile too.
    """
    forbid_inspection()  # before the first thread and the first credential read
    restrict_umask()
    threading.Thread(target=qemu_version, args=(spec.arch if spec is not None else host_arch(),), daemon=True).start()
    lock = SharedDirLock(paths.shared / ".runtime.lock")
    try:
        prepare_dirs(paths)
        check_socket_room(paths, spec)
        lock.acquire()
        await asyncio.to_thread(DiskCache(paths.cache).evict)  # a budget lowered since the last run
        # a capture's staging left by a runtime that was killed holds its guest's RAM
        await asyncio.to_thread(SnapshotStore(paths.cache).remove_abandoned_staging)
    except HostError:
        shutil.rmtree(paths.run, ignore_errors=True)  # the private run dir default_paths made
        raise
    try:
        share_dir(paths.shared)
    except PermissionError:
        # a volume mounted as the shared dir itself and owned by someone else (a Kubernetes emptyDir
        # is root's, 0777): its mode stays the volume's; the sockets in it are 0660 all the same
        log.warning("cannot set mode 2770 on %s (owned by uid %d, not by this uid %d); mount the volume one "
                    "level up (/shared) so the runtime creates the directory itself", paths.shared,
                    paths.shared.stat().st_uid, os.geteuid())
    vm = VmController(spec, paths, allow_extra_args=allow_extra_args, host_paths=host_paths,
                      pull_timeout=pull_timeout)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = None
    health = None
    reaper = asyncio.create_task(_reap_orphans(stop)) if os.getpid() == 1 else None
    started = time.monotonic()
    try:
        await vm.start()
        api, health_api = await _api_modules_once_booting(vm)
        runner = await api.serve_api(vm, paths.shared / "api.sock")
        log.info("serving %s (state %s, cache %s)", paths.shared / "api.sock", paths.state, paths.cache)
        if health_listen:
            health, bound = await health_api.serve_health(vm, health_listen)
            log.info("health probes and metrics on http://%s:%d (/healthz, /readyz, /metrics only)", *bound)
        shutdown_wait = asyncio.create_task(vm.shutdown_requested.wait())
        stop_wait = asyncio.create_task(stop.wait())
        await asyncio.wait({shutdown_wait, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        shutdown_wait.cancel()
        stop_wait.cancel()
        log.info("stopping after %.0f s", time.monotonic() - started)
        try:
            await asyncio.wait_for(vm.close(), grace)
        except TimeoutError:
            log.error("guest did not stop within %.0f s; killed", grace)
        await close_backends()  # the private libvirtd, if a libvirt boot started one
        return 0
    finally:
        stop.set()
        if health is not None:
            await health.cleanup()
        if runner is not None:
            await runner.cleanup()
        (paths.shared / "api.sock").unlink(missing_ok=True)
        if reaper is not None:
            reaper.cancel()
        shutil.rmtree(paths.run, ignore_errors=True)
        lock.release()
