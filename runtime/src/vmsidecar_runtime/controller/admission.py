"""What a spec sent over the API may not do that the runtime's own configuration may.

An API caller is a lease holder (docs/security.md): it may not add QEMU arguments, name a libvirt
URI that runs a program or names a host file, or name host paths the administrator did not allow.
The runtime's own ``--spec`` file may do all three. Once a lease has claimed the VM, a spec may not
name a ``snapshot_source`` other than the pool's (:func:`admit_snapshot_source`).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from vmsidecar_contract.errors import SpecError
from vmsidecar_contract.spec import VmSpec

from ..hostpaths import HostPathPolicy


def admit_api_spec(spec: VmSpec, current: VmSpec | None, *, host_paths: HostPathPolicy,
                   allow_extra_args: bool) -> None:
    """:raise SpecError: extra_args, or a new libvirt URI that is not plain (:func:`plain_libvirt_uri`),
        without ``--allow-extra-args``.
    :raise HostPathError: a new host path the administrator did not allow."""
    if spec.extra_args and not allow_extra_args:
        raise SpecError("extra_args may only be set by an administrator; start the runtime with "
                        "--allow-extra-args or put them in the runtime's own --spec file")
    uri = spec.libvirt_uri
    if uri is not None and uri != (current.libvirt_uri if current else None) and not allow_extra_args \
            and not plain_libvirt_uri(uri):
        raise SpecError(f"libvirt_uri {uri[:200]!r} may only be set by an administrator: its ext transport or "
                        "its parameters (command=, socket=, netcat=, keyfile=, …) make libvirt run a program or "
                        "open a host file; put it in the runtime's own --spec file (or VMSIDECAR_LIBVIRT_URI), "
                        "or start the runtime with --allow-extra-args; over the API only a URI with no "
                        "parameters, like qemu:///system or qemu+ssh://user@host/system")
    host_paths.check_spec(spec, current)


#: a libvirt URI's scheme whose transport connects (local socket, TCP, TLS, ssh), not ``ext``
_PLAIN_SCHEME = re.compile(r"[a-z][a-z0-9]*(\+(unix|tcp|tls|ssh|libssh|libssh2))?")


def plain_libvirt_uri(uri: str) -> bool:
    """Whether ``uri`` only connects: no ``ext`` transport and no parameters at all (libvirt's
    ``command``, ``netcat``, ``socket``, ``keyfile``, ``known_hosts``… choose what it runs or opens)."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return False
    return bool(_PLAIN_SCHEME.fullmatch(parts.scheme)) and not parts.query and not parts.fragment \
        and "?" not in uri


def admit_snapshot_source(spec: VmSpec, pools: str | None) -> None:
    """A spec sent once a lease has claimed the VM may keep the pool's snapshot source (``pools``: the
    runtime's own spec's) or name none, never bring one: what a source publishes under the pool's
    key is restored and cached for the next leases (docs/security.md row 40).

    :raise SpecError: another source.
    """
    if spec.snapshot_source is not None and spec.snapshot_source != pools:
        theirs = f"the pool's is {pools!r}" if pools else "the pool names none"
        raise SpecError(f"snapshot_source {spec.snapshot_source[:200]!r} is not the pool's ({theirs}): a snapshot is "
                        "read only from the source the pool's configuration names, never one a lease's spec "
                        "brings (it would be the next leases' guest); set it in the runtime's own --spec or "
                        "the exporter's config")
