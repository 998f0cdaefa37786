"""The emulator the runtime's private libvirtd starts for its domains: QEMU with no capability, in
the Landlock domain of its boot plan (``python -m vmsidecar_runtime.libvirt_emulator QEMU [ARG ...]``).

libvirt 9.0 starts the private daemon's QEMU as root (qemu.conf ``user = "+0"``: docs/libvirt.md,
"the /dev/kvm trap") with every capability of the runtime's container, and outside the Landlock
domain the runtime gives a QEMU it forks itself (``confinement.py``): libvirtd forks this one. So
the private daemon's domains name as their ``<emulator>`` a script in the daemon's directory
(``PrivateDaemon.emulator``) that runs this module, which

- enters a Landlock domain: what every confined program may open (``confinement.system_rules``),
  QEMU's prefix, the directories libvirt keeps its QEMU's files in (the daemon's private ones,
  :data:`LIBVIRT_DIRS`), /dev/kvm (:data:`KVM`), and the boot plan's own files, which the domain
  XML hands over in :data:`RULES_ENV` (``<qemu:env>``: libvirt gives QEMU no other variable of the
  runtime's). libvirt's probes of the emulator (no domain) get all but the plan's files;
- execs QEMU through ``setpriv`` with no capability (``confinement.NO_CAPABILITIES``).

An external daemon (``libvirt_uri``) starts its QEMU its own way, confined by its own security
driver; this module is the private daemon's only. It is not in ``backend.libvirt``, whose package
imports the spec (pydantic): 0.15 s more before each QEMU.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from landlockpy import AccessFS

from .confinement import NO_CAPABILITIES, READ_WRITE, Rule, program_rules, ruleset_for

#: the boot plan's rules, ``[[path, access], ...]`` (:func:`encode_rules`)
RULES_ENV = "VMSIDECAR_QEMU_RULES"
#: where libvirt keeps what it gives its QEMU (a domain's master key, a probe's monitor socket and
#: pid file): the QEMU driver's directories in the private daemon's own (bound over libvirt's paths
#: in its namespace by ``nsinit``); not libvirtd's configuration, capability cache or sockets (its
#: log reaches QEMU as a descriptor)
LIBVIRT_DIRS = ("/var/lib/libvirt/qemu", "/run/libvirt/qemu")
LIBVIRT_ACCESS = (READ_WRITE | AccessFS.READ_DIR | AccessFS.MAKE_REG | AccessFS.MAKE_DIR | AccessFS.MAKE_SOCK
                  | AccessFS.REMOVE_FILE | AccessFS.REMOVE_DIR)
#: /dev/kvm for every QEMU of libvirt's, a TCG guest's and a probe's too: libvirt keeps its probe
#: of the emulator only while what the probe found about KVM is what its QEMU user may open, so a
#: probe kept from /dev/kvm re-ran at every domain's start (docs/libvirt.md, "the /dev/kvm trap":
#: createXML 5-10 s here, against 0.3 s)
KVM = "/dev/kvm"


def encode_rules(rules: list[Rule]) -> str:
    """``rules`` as :data:`RULES_ENV`'s value."""
    return json.dumps([[str(rule.path), int(rule.access)] for rule in rules])


def decode_rules(text: str) -> list[Rule]:
    """:func:`encode_rules`' inverse."""
    return [Rule(Path(path), AccessFS(access)) for path, access in json.loads(text)]


def rules(qemu: str, given: str) -> list[Rule]:
    """What the QEMU at ``qemu`` may open: the module's docstring; ``given``: :data:`RULES_ENV`."""
    return program_rules(qemu, [*(Rule(Path(d), LIBVIRT_ACCESS) for d in LIBVIRT_DIRS), Rule(Path(KVM), READ_WRITE),
                                *decode_rules(given)])


def main(argv: list[str]) -> None:
    """Enter the domain, then become QEMU (``argv``: its path, then libvirt's arguments)."""
    qemu, *arguments = argv
    ruleset = ruleset_for(rules(qemu, os.environ.pop(RULES_ENV, "[]")))  # None: off, or no Landlock (said)
    if ruleset is not None:
        ruleset.restrict()
        ruleset.close()
    setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
    os.execv(setpriv, [setpriv, *NO_CAPABILITIES, "--", qemu, *arguments])


if __name__ == "__main__":
    main(sys.argv[1:])
