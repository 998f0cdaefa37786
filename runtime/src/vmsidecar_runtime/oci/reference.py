"""Image references: ``REGISTRY/REPO[:TAG][@DIGEST]``, ``oci-layout:DIR[:TAG]``, ``file:PATH``.

A registry reference must name its registry host: vmsidecar never defaults to Docker Hub.
``oci://`` and ``docker://`` prefixes are accepted and dropped.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from vmsidecar_contract.errors import BadReferenceError
from vmsidecar_runtime.image.digest import is_sha256_digest

RefKind = Literal["registry", "layout", "file"]

LAYOUT_SCHEME = "oci-layout:"
FILE_SCHEME = "file:"
_STRIPPED_SCHEMES = ("oci://", "docker://")

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
#: containers/image transports written without "//" that we do not read (a hint is better than
#: "no registry host")
_FOREIGN_TRANSPORTS = ("oci", "oci-archive", "docker-archive", "docker-daemon", "containers-storage", "dir")
_COMPONENT_RE = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*$"
)
_HOST_PORT_RE = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+)(?::(?P<port>[0-9]{1,5}))?$")


@dataclass(frozen=True)
class Reference:
    """A parsed image reference; ``str(ref)`` gives the canonical text back.

    ``kind`` is ``registry`` (``registry``, ``repository``, ``tag``, ``digest``), ``layout``
    (``path``, ``tag``, ``digest``) or ``file`` (``path``).
    """

    kind: RefKind
    registry: str | None = None
    repository: str | None = None
    tag: str | None = None
    digest: str | None = None
    path: Path | None = None

    def __str__(self) -> str:
        if self.kind == "file":
            return f"{FILE_SCHEME}{self.path}"
        if self.kind == "layout":
            text = f"{LAYOUT_SCHEME}{self.path}"
        else:
            text = f"{self.registry}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text

    @property
    def name(self) -> str:
        """``REGISTRY/REPO`` for a registry reference, the path otherwise (for messages)."""
        if self.kind == "registry":
            return f"{self.registry}/{self.repository}"
        return str(self.path)

    @property
    def manifest_ref(self) -> str:
        """What to ask a registry or layout for: the digest if pinned, else the tag (``latest``)."""
        return self.digest or self.tag or "latest"


def is_loopback_host(registry: str) -> bool:
    """Whether ``HOST[:PORT]`` names this machine (``localhost``, ``127.0.0.0/8``, ``::1``)."""
    match = _HOST_PORT_RE.fullmatch(registry)
    host = match.group("host") if match else registry
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def has_control_character(text: str) -> bool:
    """Whether ``text`` holds a C0 control character or DEL (a newline, an escape: never part of a
    reference, a path or a title, and each would reach messages and log lines)."""
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def parse_reference(text: str | Reference, *, look: bool = True) -> Reference:
    """Parse an image reference.

    Forms: ``REGISTRY/REPO[:TAG][@sha256:HEX]`` (optionally prefixed ``oci://`` or
    ``docker://``), ``oci-layout:DIR[:TAG|@DIGEST]``, ``file:PATH``, or a bare path to an existing
    file or OCI layout directory (or one starting with ``/``, ``./`` or ``../``).

    ``look=False`` for a reference from an API caller: the host is not looked at to classify it (a
    bare path is one by its prefix only, and a file: the answer must not say whether a host file,
    a layout or a user exists), and ``~`` is refused rather than expanded.

    :raise BadReferenceError: for an empty reference, an unknown scheme, a missing registry
        host, or an invalid repository, tag or digest.
    """
    if isinstance(text, Reference):
        return text
    ref = text.strip()
    if not ref:
        raise BadReferenceError(
            "the image reference is empty; give REGISTRY/REPO:TAG, oci-layout:DIR[:TAG] or file:PATH"
        )
    if has_control_character(ref):
        raise BadReferenceError(f"the image reference {ref[:200]!r} holds a control character, which no registry "
                                "host, repository, tag or path has; give it as REGISTRY/REPO:TAG")
    if ref.startswith(LAYOUT_SCHEME):
        return _parse_layout(ref, ref[len(LAYOUT_SCHEME) :])
    if ref.startswith(FILE_SCHEME):
        named = ref[len(FILE_SCHEME) :]
        if named.startswith("//"):
            named = named[2:]
        if not named:
            raise BadReferenceError(f"reference {ref!r} names no file; write file:/path/to/disk.qcow2")
        return Reference(kind="file", path=_host_path(ref, named, look))
    for prefix in _STRIPPED_SCHEMES:
        if ref.startswith(prefix):
            return _parse_registry(text, ref[len(prefix) :])
    scheme = _SCHEME_RE.match(ref)
    transport, _, after = ref.partition(":")
    if re.match(r"[0-9]+(/|$)", after):  # HOST:PORT/..., not a transport
        transport = ""
    if scheme or transport in _FOREIGN_TRANSPORTS:
        name = scheme.group(1) if scheme else transport
        raise BadReferenceError(
            f"reference {text!r} uses the unknown scheme {name!r}; use REGISTRY/REPO:TAG "
            "(optionally oci:// or docker://), oci-layout:DIR[:TAG] or file:PATH"
        )
    if _looks_like_path(ref, look):
        path = _host_path(ref, ref, look)
        try:
            if look and path.is_dir() and (path / "oci-layout").is_file():
                return Reference(kind="layout", path=path)
        except OSError:  # a name past NAME_MAX, a directory that cannot be read: not a layout here
            pass
        return Reference(kind="file", path=path)
    return _parse_registry(text, ref)


def _host_path(ref: str, path: str, look: bool = True) -> Path:
    """``path`` of the reference ``ref``, ``~`` expanded (refused when not ``look``).

    :raise BadReferenceError: a NUL byte (no file has one), or ``~user`` of a user this host does not have.
    """
    if "\0" in path:
        raise BadReferenceError(f"reference {ref!r} names a path with a NUL byte, which no file has; name "
                                "the file")
    if not look and path.startswith("~"):
        raise BadReferenceError(f"reference {ref!r} names a path in a home directory (~), which a reference "
                                "over the API may not; write the absolute path")
    try:
        return Path(path).expanduser()
    except RuntimeError:  # ~user of an unknown user
        raise BadReferenceError(f"reference {ref!r} names the home of a user this host does not have; write "
                                "the absolute path") from None


def _looks_like_path(ref: str, look: bool = True) -> bool:
    if ref.startswith(("/", "./", "../", "~")) or ref in (".", ".."):
        return True
    return look and os.path.exists(ref) and not _first_component_is_host(ref)


def _first_component_is_host(ref: str) -> bool:
    first = ref.split("/", 1)[0]
    return "/" in ref and (first == "localhost" or "." in first or ":" in first or first.startswith("["))


def _parse_layout(original: str, rest: str) -> Reference:
    digest = None
    if "@" in rest:
        rest, digest = rest.rsplit("@", 1)
        _check_digest(original, digest)
    tag = None
    head, sep, tail = rest.rpartition(":")
    if sep and tail and "/" not in tail:
        if not _TAG_RE.fullmatch(tail):
            raise BadReferenceError(
                f"layout reference {original!r} has the invalid tag {tail!r}; "
                "tags are letters, digits, '_', '.' and '-' (at most 128)"
            )
        rest, tag = head, tail
    if not rest:
        raise BadReferenceError(
            f"layout reference {original!r} names no directory; write oci-layout:DIR[:TAG]"
        )
    return Reference(kind="layout", path=Path(rest), tag=tag, digest=digest)


def _parse_registry(original: str, ref: str) -> Reference:
    digest = None
    if "@" in ref:
        ref, digest = ref.split("@", 1)
        _check_digest(original, digest)
    if "/" not in ref or not _is_host(ref.split("/", 1)[0]):
        raise BadReferenceError(
            f"reference {original!r} has no registry host; add it in front, as in 127.0.0.1:5000/{ref} "
            "(vmsidecar never defaults to Docker Hub); a file is file:PATH or ./PATH"
        )
    registry, path = ref.split("/", 1)
    tag = None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, tag = path.rsplit(":", 1)
        if not _TAG_RE.fullmatch(tag):
            raise BadReferenceError(
                f"reference {original!r} has the invalid tag {tag!r}; "
                "tags are letters, digits, '_', '.' and '-' (at most 128, not starting with '.' or '-')"
            )
    components = path.split("/")
    if not path or not all(_COMPONENT_RE.fullmatch(c) for c in components):
        raise BadReferenceError(
            f"reference {original!r} has the invalid repository {path!r}; use lowercase letters, digits "
            "and single '.', '_' or '-' separators between '/'-separated parts"
        )
    return Reference(kind="registry", registry=registry, repository=path, tag=tag, digest=digest)


def _is_host(component: str) -> bool:
    match = _HOST_PORT_RE.fullmatch(component)
    if not match:
        return False
    host, port = match.group("host"), match.group("port")
    if port is not None and not 0 < int(port) < 65536:
        return False
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    if not _HOSTNAME_RE.fullmatch(host):
        return False
    return host == "localhost" or "." in host or port is not None


def _check_digest(original: str, digest: str) -> None:
    if not is_sha256_digest(digest):
        raise BadReferenceError(
            f"reference {original!r} has the invalid digest {digest!r}; "
            "write @sha256: followed by 64 lowercase hex digits"
        )
