"""QEMU and qemu-img in Landlock domains of their own: the files a guest that escapes into QEMU,
or an image that takes qemu-img over, can open.

QEMU runs as the runtime's UID (a UID of its own would need CAP_SETUID: no privilege beyond
/dev/kvm), so without more it could open whatever that UID can: the registry auth file, every
image and snapshot in the cache, the state directory's next overlay, a standby spare's disk. The
runtime builds a Landlock ruleset for each QEMU from its boot plan (:func:`qemu_rules`) and QEMU
starts in it: the thread that forks it enters the domain first (``procs._fork``; a domain is the
thread's, not the runtime's other threads'):

- read and execute: the system's program and library directories, QEMU's own prefix;
- read: the few files under /etc the C library and slirp read, /proc and /sys, the disk's backing
  chain as the runtime made it (``BootPlan.disk_chain``: never what the overlay's header, which
  QEMU writes, names), the firmware code, the spec's kernel and initrd;
- read and write: its own disk (the overlay), its UEFI vars, a templated restore's RAM file (QEMU
  7.2 opens it read-write to map it privately: docs/security.md row 15), /dev/kvm and the
  character devices every program writes (/dev/null ...);
- make sockets in its private run directory (its QMP and console sockets).

Nothing else: not another file of the cache or the state directory, not the auth file wherever it
is mounted. The scopes (Landlock ABI 6) also keep it from signalling the runtime or reaching an
abstract Unix socket outside its domain, and Landlock keeps any process in the domain from
ptracing one outside it. Files QEMU is given later (a capture's new overlay, the migration stream)
come as descriptors over QMP, never as paths. The QEMU of the private libvirtd (which libvirtd
forks) enters the same domain on its way there, with libvirt's directories for it (``libvirt_emulator``).

qemu-img (:func:`tool_rules`) opens only the disks its call names: a check of an image only that
image, an overlay's creation the overlay and what it stands on, a dump the lease's disk chain and
the dump's file.

A kernel without Landlock (Linux < 5.13, or not in the LSM list, or a seccomp profile that refuses
its syscalls) runs them unconfined, said once in the log; rights a kernel's ABI lacks are left out
(landlockpy's best effort: with ABI < 3 truncation is not confined). ``VMSIDECAR_QEMU_CONFINEMENT=off``
runs them unconfined on purpose: for an administrator's ``extra_args`` that name host files.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from landlockpy import AccessFS, AccessNet, LandlockError, Ruleset, Scope

if TYPE_CHECKING:  # (not at run time: ``libvirt_emulator`` imports this module before each QEMU, without pydantic)
    from .plan import BootPlan

log = logging.getLogger(__name__)

#: what the domain confines: every filesystem right up to ABI 3 (later ones, such as ABI 11's
#: connect to a Unix socket by path, are left to a later release that can test them)
HANDLED = (AccessFS.EXECUTE | AccessFS.WRITE_FILE | AccessFS.READ_FILE | AccessFS.READ_DIR
           | AccessFS.REMOVE_DIR | AccessFS.REMOVE_FILE | AccessFS.MAKE_CHAR | AccessFS.MAKE_DIR
           | AccessFS.MAKE_REG | AccessFS.MAKE_SOCK | AccessFS.MAKE_FIFO | AccessFS.MAKE_BLOCK
           | AccessFS.MAKE_SYM | AccessFS.REFER | AccessFS.TRUNCATE)
SCOPES = Scope.ABSTRACT_UNIX_SOCKET | Scope.SIGNAL

READ = AccessFS.READ_FILE
READ_TREE = AccessFS.READ_FILE | AccessFS.READ_DIR
RUN = READ_TREE | AccessFS.EXECUTE
READ_WRITE = AccessFS.READ_FILE | AccessFS.WRITE_FILE | AccessFS.TRUNCATE

#: programs, libraries, locales, QEMU's ROMs and firmware (Debian: /usr/share/qemu, seabios, OVMF)
SYSTEM_DIRS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin")
#: what the C library's loader and resolver and slirp (its DNS forwarder) read; not /etc as a whole,
#: where a pod may mount the pool's credentials (/etc/containers/auth.json)
ETC_FILES = ("ld.so.cache", "ld.so.preload", "localtime", "resolv.conf", "hosts", "host.conf",
             "nsswitch.conf", "gai.conf", "services", "protocols")
#: the library directories of crypto and TLS settings QEMU's libraries look for
ETC_DIRS = ("gnutls", "gcrypt")
DEVICES_RW = ("/dev/null", "/dev/zero", "/dev/full")
DEVICES_READ = ("/dev/random", "/dev/urandom")

#: setpriv's options that leave a program started by root no capability at all: root's exec
#: grants what the bounding set holds, which pod runtimes fill (CAP_DAC_OVERRIDE, CAP_CHOWN,
#: CAP_NET_RAW, CAP_SETUID ...: a guest escaped into a root QEMU had them; upstream's pools run the
#: runtime as root)
NO_CAPABILITIES = ("--inh-caps", "-all", "--ambient-caps", "-all", "--bounding-set", "-all")


@dataclass(frozen=True)
class Rule:
    """``access`` granted on ``path`` (a file, or a directory and everything under it)."""

    path: Path
    access: AccessFS


def system_rules() -> list[Rule]:
    """What every confined program may open: its programs and libraries, what the C library reads."""
    rules = [Rule(Path(p), RUN) for p in SYSTEM_DIRS]
    rules += [Rule(Path(p), RUN) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p.startswith("/")]
    rules += [Rule(Path("/etc", name), READ) for name in ETC_FILES]
    rules += [Rule(Path("/etc", name), READ_TREE) for name in ETC_DIRS]
    rules += [Rule(Path("/proc"), READ_TREE), Rule(Path("/sys"), READ_TREE)]
    rules += [Rule(Path(p), READ_WRITE) for p in DEVICES_RW]
    return rules + [Rule(Path(p), READ) for p in DEVICES_READ]


def program_rules(program: str, extra: Iterable[Rule]) -> list[Rule]:
    """What ``program`` may open: what every confined program may, its own prefix
    (:func:`program_rule`) and ``extra``; existing paths only (a rule opens its path)."""
    rules = [*system_rules(), program_rule(program), *extra]
    return [rule for rule in rules if rule.path.exists()]


def qemu_rules(plan: BootPlan, emulator: str) -> list[Rule]:
    """Everything the QEMU of ``plan`` may open (the module's docstring), existing paths only."""
    return program_rules(emulator, plan_rules(plan))


def plan_rules(plan: BootPlan) -> list[Rule]:
    """What the QEMU of ``plan`` may open beyond what every confined program may and its prefix:
    /dev/kvm (KVM only), its disk and backing chain, firmware, kernel and initrd, a restore's RAM
    file, sockets in its run directory."""
    rules = []
    if plan.accel == "kvm":
        rules.append(Rule(Path("/dev/kvm"), READ_WRITE))
    rules.append(Rule(plan.disk, READ_WRITE))
    rules += [Rule(p, READ) for p in plan.disk_chain]
    if plan.firmware is not None:
        rules += [Rule(plan.firmware.code, READ), Rule(plan.firmware.vars, READ_WRITE)]
    rules += [Rule(Path(p), READ) for p in (plan.spec.kernel, plan.spec.initrd) if p]
    if plan.ram is not None and plan.ram.fd is None:  # a restore's RAM file (a capture's is a memfd)
        rules.append(Rule(plan.ram.path, READ_WRITE))
    rules.append(Rule(plan.run_dir, AccessFS.MAKE_SOCK))
    return rules


def tool_rules(program: str, *, read: Iterable[Path] = (), write: Iterable[Path] = ()) -> list[Rule]:
    """What ``program`` (qemu-img) may open: the files ``read``, read-only, and ``write``,
    read-write (each existing; a backing file it needs is one of ``read``)."""
    return program_rules(program, [*(Rule(p, READ) for p in read), *(Rule(p, READ_WRITE) for p in write)])


def program_rule(program: str) -> Rule:
    """``program``'s own prefix, to run it and read what it ships: a QEMU built into /opt/qemu has
    its ROMs in /opt/qemu/share (bin/..); one on ``PATH`` by its name is looked up there."""
    path = shutil.which(program) or program
    return Rule(Path(path).resolve().parent.parent, RUN)


#: ``off``: QEMU and qemu-img run without their domains (an administrator's ``extra_args`` that
#: open host files)
ENV = "VMSIDECAR_QEMU_CONFINEMENT"


def wanted() -> bool:
    """Whether QEMU and qemu-img are confined (the default), or the administrator turned it off (``ENV``)."""
    if os.environ.get(ENV, "landlock") == "off":
        _warn_unconfined(f"{ENV}=off")
        return False
    return True


@functools.cache
def _warn_unconfined(why: str) -> None:
    log.warning("QEMU and qemu-img run without a Landlock domain (%s): a guest that escapes into QEMU, "
                "or an image that takes qemu-img over, can open any file the runtime's user can, the "
                "registry auth file included; run on a kernel with "
                "Landlock (Linux >= 5.13 with landlock in its LSM list) and let the pod's seccomp "
                "profile allow the landlock_* syscalls", why)


def ruleset_for(rules: list[Rule]) -> Ruleset | None:
    """A ruleset granting ``rules`` and nothing else, for a child to enter (``procs``'s ``confine``);
    None when confinement is off or this kernel cannot confine (said in the log, once)."""
    if not wanted():
        return None
    try:
        # (no network right is handled: slirp binds the forwards and connects for the guest)
        ruleset = Ruleset(handled_fs=HANDLED, handled_net=AccessNet.NONE, scoped=SCOPES)
    except LandlockError as e:
        _warn_unconfined(e.strerror or str(e))
        return None
    try:
        for rule in rules:
            ruleset.allow_path(rule.path, rule.access)
    except BaseException:
        ruleset.close()
        raise
    return ruleset


@contextlib.contextmanager
def domain(rules: list[Rule]) -> Iterator[Ruleset | None]:
    """:func:`ruleset_for` ``rules``, for a child started within (``procs``'s ``confine``); closed
    at the end, once the child holds its own copy."""
    ruleset = ruleset_for(rules)
    try:
        yield ruleset
    finally:
        if ruleset is not None:
            ruleset.close()
