"""The runtime's private libvirtd, and the one place libvirt-python is imported.

With ``libvirt_uri`` in the spec the runtime connects to that daemon (``connection``). Without one
(the runtime-container case) it starts its own libvirtd lazily, in the foreground, without systemd:
in a private mount+PID namespace whose etc/run/lib/cache/log dirs live under the runtime's run
dir. Its qemu.conf runs QEMU as the runtime's own numeric uid/gid (root: so the capability cache
stays valid, see docs/libvirt.md, "the /dev/kvm trap"; numeric: so no system user such as
``libvirt-qemu`` is needed), without security driver, cgroups or namespaces, and with QEMU's
output in a plain log file (no virtlogd needed). The runtime stops it at exit (``close_backends``);
if the runtime dies, PR_SET_PDEATHSIG and the PID namespace take the daemon and every QEMU along.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import pwd
import re
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vmsidecar_contract.errors import HostError

from ... import libvirt_emulator
from ...procs import Child, effective_capabilities, spawn
from . import nsinit

log = logging.getLogger(__name__)

FIX = ("pip install 'vmsidecar-runtime[libvirt]' (in this repository: uv sync --all-packages --all-extras), "
       "after apt-get install libvirt-dev pkg-config gcc so it can build, plus libvirt-daemon "
       "libvirt-daemon-driver-qemu for the daemon; or use backend: qemu")

#: the QEMU user and group names libvirt is built with (meson ``qemu_user``/``qemu_group``: Debian
#: libvirt-qemu/libvirt-qemu, Ubuntu libvirt-qemu/kvm, Fedora and SUSE qemu/qemu). libvirtd's QEMU
#: driver resolves its built-in pair at start-up, *before* it reads qemu.conf, and refuses to start
#: when the name is unknown ("Failed to parse user 'libvirt-qemu'"); only libvirt-daemon-system
#: creates that user. The private daemon's passwd/group therefore carry a placeholder for each
#: missing name (the runtime's own uid/gid); qemu.conf then replaces the pair with numeric ids.
BUILTIN_QEMU_USERS = ("libvirt-qemu", "qemu")
BUILTIN_QEMU_GROUPS = ("libvirt-qemu", "kvm", "qemu")

QEMU_CONF = """\
# vmsidecar private libvirtd: QEMU runs as the runtime's own uid/gid, given numerically so no
# system user (libvirt-qemu) is needed. As root, /dev/kvm access never differs between the daemon
# and QEMU and the capability cache is not re-probed on every domain start.
user = "+{uid}"
group = "+{gid}"
dynamic_ownership = 0
remember_owner = 0
security_driver = "none"
namespaces = []
cgroup_controllers = []
stdio_handler = "file"
"""

LIBVIRTD_CONF = """\
# vmsidecar private libvirtd: one root-only Unix socket in the private run dir, nothing else.
unix_sock_group = "root"
unix_sock_ro_perms = "0700"
unix_sock_rw_perms = "0700"
auth_unix_ro = "none"
auth_unix_rw = "none"
log_outputs = "3:stderr"
"""


#: the owner of the directory of libvirtd's sockets: no process's user. The runtime and libvirtd (root
#: with CAP_DAC_OVERRIDE) reach the sockets; their QEMU (root with no capability: ``libvirt_emulator``)
#: does not, where a guest escaped into it would ask libvirtd, which needs no credentials there, for a
#: domain of its own making (any emulator, any argv, none of this confinement)
SOCKET_DIR_OWNER = 65534  # nobody
#: CAP_DAC_OVERRIDE's and CAP_DAC_READ_SEARCH's bits: either lets the runtime into that directory
_CAP_DAC = (1 << 1) | (1 << 2)


def qemu_conf(uid: int, gid: int) -> str:
    """The private daemon's qemu.conf: QEMU runs as ``+uid``/``+gid`` (libvirt's numeric form)."""
    return QEMU_CONF.format(uid=uid, gid=gid)


def nss_files(uid: int, gid: int) -> tuple[str, str]:
    """The private daemon's /etc/passwd and /etc/group: the host's, plus a placeholder (``uid``/``gid``)
    for every built-in QEMU user or group name the host does not know (see ``BUILTIN_QEMU_USERS``)."""
    passwd = _read_text("/etc/passwd")
    group = _read_text("/etc/group")
    for name in BUILTIN_QEMU_USERS:
        if not _known(pwd.getpwnam, name):
            passwd += f"{name}:x:{uid}:{gid}:vmsidecar placeholder, QEMU runs as +{uid}:/nonexistent:/usr/sbin/nologin\n"
    for name in BUILTIN_QEMU_GROUPS:
        if not _known(grp.getgrnam, name):
            group += f"{name}:x:{gid}:\n"
    return passwd, group


def _read_text(path: str) -> str:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return ""
    return text if not text or text.endswith("\n") else text + "\n"


def _known(lookup: Callable[[str], Any], name: str) -> bool:
    try:
        lookup(name)
    except KeyError:
        return False
    return True


def startup_hint(stderr: list[str], namespaced: bool) -> str:
    """What to do about a private libvirtd that exited during start-up, from its last words."""
    missing = next((m for line in stderr if (m := re.search(r"Failed to parse (user|group) '([^']+)'", line))),
                   None)
    if missing is None:
        return ("the runtime needs root with CAP_SYS_ADMIN for its own daemon, otherwise set libvirt_uri to a "
                "running libvirt daemon")
    kind, name = missing.groups()
    create = (f"useradd --system --no-create-home --user-group {name}" if kind == "user"
              else f"groupadd --system {name}")
    if namespaced:
        return (f"libvirt's built-in QEMU {kind} '{name}' is unknown here and not one of the placeholders the "
                f"runtime supplies ({', '.join(BUILTIN_QEMU_USERS if kind == 'user' else BUILTIN_QEMU_GROUPS)}); "
                f"create it ({create}) or set libvirt_uri to a running libvirt daemon")
    return (f"libvirtd looks up its built-in QEMU {kind} '{name}' at start-up, before it reads qemu.conf, and "
            "without mount namespaces (no CAP_SYS_ADMIN, or VMSIDECAR_LIBVIRT_NAMESPACES=0) the runtime cannot "
            f"supply it: run the runtime as root with CAP_SYS_ADMIN, or create it in the image ({create}, or "
            "apt-get install libvirt-daemon-system) and ship the runtime's qemu.conf at /etc/libvirt/qemu.conf "
            "(docs/libvirt.md), or set libvirt_uri to a running libvirt daemon")


def import_libvirt() -> Any:
    """The ``libvirt`` module.

    :raise HostError: naming the fix when libvirt-python is not installed.
    """
    try:
        import libvirt
    except ImportError as e:
        raise HostError(f"backend libvirt needs libvirt-python, which is not installed ({e}); {FIX}") from None
    return libvirt


# ---- private daemon -------------------------------------------------------------------------
class PrivateDaemon:
    """A libvirtd owned by this runtime, in its own mount and PID namespace."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.proc: Child | None = None
        self._virtlogd: Child | None = None
        self._stderr: list[str] = []
        #: False when mount/PID namespaces are unavailable (no CAP_SYS_ADMIN): libvirtd then uses
        #: the system's /etc/libvirt, /run/libvirt … (fine in a container that is ours alone)
        self.namespaced = True

    @property
    def socket(self) -> Path:
        return self.root / "sock" / "libvirt-sock"

    def emulator(self, qemu: str) -> Path:
        """The ``<emulator>`` of this daemon's domains for the QEMU at ``qemu``: a script that runs
        it through ``libvirt_emulator`` (no capability, the boot plan's Landlock domain)."""
        script = self.root / "emulator" / Path(qemu).name
        if not script.exists():
            script.parent.mkdir(exist_ok=True)
            tree = Path(libvirt_emulator.__file__).parent.parent  # the runtime's own code (libvirt clears PYTHONPATH)
            script.write_text(
                "#!/bin/sh\n# QEMU for the runtime's private libvirtd: no capability, in the Landlock domain of\n"
                "# its boot plan (vmsidecar_runtime/libvirt_emulator.py)\n"
                f"PYTHONPATH={shlex.quote(str(tree))} exec {shlex.quote(sys.executable)} -m "
                f"{libvirt_emulator.__name__} {shlex.quote(qemu)} \"$@\"\n")
            script.chmod(0o755)
        return script

    @property
    def uri(self) -> str:
        return f"qemu+unix:///system?socket={self.socket}"

    def log_path(self, domain: str) -> Path:
        """QEMU's stdout/stderr for a domain (stdio_handler = "file")."""
        base = self.root / "log" if self.namespaced else Path("/var/log/libvirt")
        return base / "qemu" / f"{domain}.log"

    def _prepare(self) -> None:
        for sub in ("etc", "run", "lib", "cache", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "etc" / "qemu").mkdir(exist_ok=True)
        (self.root / "log" / "qemu").mkdir(exist_ok=True)
        (self.root / "etc" / "libvirtd.conf").write_text(LIBVIRTD_CONF + f'unix_sock_dir = "{self.socket.parent}"\n')
        _socket_dir(self.socket.parent)
        (self.root / "etc" / "qemu.conf").write_text(qemu_conf(os.getuid(), os.getgid()))
        (self.root / "etc" / "libvirt.conf").write_text("")
        # bound over /etc/passwd and /etc/group in the namespace (nsinit): see BUILTIN_QEMU_USERS
        (self.root / "nss").mkdir(exist_ok=True)
        passwd, group = nss_files(os.getuid(), os.getgid())
        (self.root / "nss" / "passwd").write_text(passwd)
        (self.root / "nss" / "group").write_text(group)
        self.root.chmod(0o700)

    async def start(self, timeout: float = 30.0) -> None:
        """Start libvirtd and wait until its socket answers.

        :raise HostError: when libvirtd or unshare is missing, or the daemon does not come up.
        """
        for tool, package in (("libvirtd", "libvirt-daemon libvirt-daemon-driver-qemu"),
                              ("unshare", "util-linux")):
            if shutil.which(tool) is None:
                raise HostError(f"backend libvirt without libvirt_uri starts a private libvirtd, but {tool} is "
                                f"not installed; apt-get install {package}, or set libvirt_uri to a running daemon")
        self._prepare()
        started = time.monotonic()
        self.namespaced = os.environ.get("VMSIDECAR_LIBVIRT_NAMESPACES", "1") != "0" and await _namespaces_work()
        if self.namespaced:
            argv = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc",
                    "--kill-child", sys.executable, "-m", nsinit.__name__, str(self.root)]
        else:
            argv = await self._argv_without_namespaces()
        self.proc = await spawn(*argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                                stderr=asyncio.subprocess.PIPE, start_new_session=True, die_with_parent=True)
        collector = asyncio.get_running_loop().create_task(self._collect())
        libvirt = import_libvirt()
        while True:
            if self.proc.returncode is not None:
                with contextlib.suppress(TimeoutError):  # its last words, up to EOF
                    await asyncio.wait_for(asyncio.shield(collector), 2)
                await self._stop_virtlogd()
                raise HostError(
                    f"the private libvirtd exited during start-up (code {self.proc.returncode}): "
                    f"{' | '.join(self._stderr[-4:]) or 'no output'}; {startup_hint(self._stderr, self.namespaced)}"
                )
            if self.socket.exists():
                try:
                    await asyncio.to_thread(_probe, libvirt, self.uri)
                    break
                except libvirt.libvirtError:
                    pass
            if time.monotonic() - started > timeout:
                await self.stop()
                raise HostError(f"the private libvirtd did not open {self.socket} within {timeout:.0f} s: "
                                f"{' | '.join(self._stderr[-4:]) or 'no output'}")
            await asyncio.sleep(0.05)
        log.info("private libvirtd up in %.2f s (uri %s)", time.monotonic() - started, self.uri)

    async def _argv_without_namespaces(self) -> list[str]:
        """libvirtd on the system paths, its socket still private; QEMU settings come from
        /etc/libvirt/qemu.conf (the runtime image ships ours there), QEMU output via virtlogd."""
        log.warning("mount/PID namespaces unavailable (no CAP_SYS_ADMIN?) or off (VMSIDECAR_LIBVIRT_NAMESPACES=0): "
                    "the private libvirtd uses the system's /etc/libvirt/qemu.conf, /etc/passwd (libvirt's built-in "
                    "QEMU user must exist) and /run/libvirt, and a QEMU may outlive a SIGKILLed runtime")
        conf = self.root / "etc" / "libvirtd.conf"
        conf.write_text(LIBVIRTD_CONF + f'unix_sock_dir = "{self.socket.parent}"\n')
        if shutil.which("virtlogd") is not None and not Path("/run/libvirt/virtlogd-sock").exists():
            self._virtlogd = await spawn("virtlogd", stdin=asyncio.subprocess.DEVNULL,
                                         stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                                         start_new_session=True, die_with_parent=True)
        return ["libvirtd", "--config", str(conf), "--pid-file", str(self.root / "run" / "libvirtd.pid")]

    async def _collect(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            text = line.decode(errors="replace").rstrip()
            self._stderr = [*self._stderr[-19:], text]
            log.debug("libvirtd: %s", text)

    async def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM libvirtd (via the namespace's init), then SIGKILL; the namespace dies with it."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            await self._stop_virtlogd()
            return
        # unshare ignores SIGTERM while it waits: signal its child, the namespace's init, which
        # forwards it to libvirtd (SIGKILL of unshare still takes the whole namespace down)
        init = _children(proc.pid) if self.namespaced else [proc.pid]
        with contextlib.suppress(ProcessLookupError):
            os.kill(init[0], signal.SIGTERM) if init else proc.kill()
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        await self._stop_virtlogd()
        log.info("private libvirtd stopped")

    async def _stop_virtlogd(self) -> None:
        if self._virtlogd is not None and self._virtlogd.returncode is None:
            self._virtlogd.terminate()
            await self._virtlogd.wait()


async def _namespaces_work() -> bool:
    """Whether this process may create mount and PID namespaces (root with CAP_SYS_ADMIN)."""
    probe = await spawn("unshare", "--mount", "--pid", "--fork", "true", stdout=asyncio.subprocess.DEVNULL,
                        stderr=asyncio.subprocess.DEVNULL)
    return await probe.wait() == 0


def _probe(libvirt: Any, uri: str) -> None:
    """Open and close a connection to ``uri`` (both RPCs: call it in a worker thread)."""
    libvirt.open(uri).close()


def _socket_dir(path: Path) -> None:
    """Make the directory of libvirtd's sockets, closed to their QEMU (``SOCKET_DIR_OWNER``).

    :raise HostError: when a root runtime could not enter a directory it does not own: one it owns
        is open to its QEMU, root as well, and to a guest escaped into it.
    """
    if os.geteuid() == 0 and not effective_capabilities() & _CAP_DAC:
        raise HostError("backend libvirt's private libvirtd keeps its socket in a directory its QEMU (root, with "
                        "no capability) cannot enter, and the runtime has neither CAP_DAC_OVERRIDE nor "
                        "CAP_DAC_READ_SEARCH to enter it itself (its container drops them): add DAC_OVERRIDE to the "
                        "runtime container's capabilities, set libvirt_uri to a running libvirt daemon, or use "
                        "backend: qemu")
    path.mkdir(mode=0o700, exist_ok=True)
    if os.geteuid() == 0:  # (a plain user's libvirtd fails at its start: security.md, "The private libvirtd mode needs more")
        os.chown(path, SOCKET_DIR_OWNER, SOCKET_DIR_OWNER)


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []
