"""Which credentials belong to which registry, and which registries may be spoken to in plain HTTP.

Credentials are scoped per registry host: each comes from an entry that names its host (an auth
file's ``auths`` key, or ``VMSIDECAR_REGISTRY_HOST``), and :mod:`.transport` sends it to that host
only. The auth file is the format users already have (containers-auth.json(5), Docker's
``config.json``)::

    {"auths": {"registry.example:5000": {"auth": "<base64 of user:password>"},
               "https://index.docker.io/v1/": {"username": "u", "password": "p"},
               "quay.io/team": {"auth": "…"}}}

Keys written as URLs (as ``docker login`` does) count by their ``host[:port]``; a key with a path
(``quay.io/team``) applies to the repositories under it, the longest match winning. Entries without
credentials (``credsStore``/``credHelpers`` users, ``identitytoken``) are ignored: vmsidecar runs no
credential helper.

Where the auth file is read, first found wins: ``--registry-auth FILE`` (``serve`` and
``vmsidecar-oci``), ``$VMSIDECAR_REGISTRY_AUTH_FILE``, ``$REGISTRY_AUTH_FILE`` (each of these must
exist), else every one of ``$XDG_RUNTIME_DIR/containers/auth.json``,
``$XDG_CONFIG_HOME/containers/auth.json`` (``~/.config``), ``$DOCKER_CONFIG/config.json``
(``~/.docker``) that exists, the earlier file winning for a key, as podman and skopeo read them.
The file is read again at every pull, so a rotated secret (a Kubernetes Secret volume) is picked up.

A lease's pull (``POST /v1/vm/disk/pull``: ``j vm storage flash oci://…``, on the lease holder's
word) uses the pool's credentials only for the repository of the spec's image and the scopes the pool
owner lends: ``--lease-registry HOST[:PORT][/NAMESPACE]`` (repeatable) and
``$VMSIDECAR_LEASE_REGISTRIES`` (comma-separated); any other repository is pulled without them, so a
lease holder cannot read the pool's other private images into a guest they are root in.

Plain HTTP only for registries listed as insecure: ``--insecure-registry HOST[:PORT]`` (repeatable)
and ``$VMSIDECAR_INSECURE_REGISTRIES`` (comma-separated); a ``HOST`` without a port covers every port
of that host. Nothing is plain HTTP by default, not even loopback.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from vmsidecar_contract.errors import BadReferenceError, HostError, RegistryError
from vmsidecar_contract.reach import resolves_to_pod

from .reference import _HOST_PORT_RE, _is_host, parse_reference

ENV_AUTH_FILE = "VMSIDECAR_REGISTRY_AUTH_FILE"
ENV_INSECURE = "VMSIDECAR_INSECURE_REGISTRIES"
ENV_USERNAME = "VMSIDECAR_REGISTRY_USERNAME"
ENV_PASSWORD = "VMSIDECAR_REGISTRY_PASSWORD"
ENV_HOST = "VMSIDECAR_REGISTRY_HOST"
ENV_LEASE = "VMSIDECAR_LEASE_REGISTRIES"
#: podman's and skopeo's variable for the auth file
ENV_CONTAINERS_AUTH_FILE = "REGISTRY_AUTH_FILE"
#: environment that configures registry access (the runtime's process, not the VM spec)
PROCESS_ENV = frozenset({ENV_AUTH_FILE, ENV_INSECURE, ENV_USERNAME, ENV_PASSWORD, ENV_HOST, ENV_LEASE})

AUTH_FLAG = "--registry-auth"
INSECURE_FLAG = "--insecure-registry"
LEASE_FLAG = "--lease-registry"
#: how to give credentials, for messages
HOW_TO_CONFIGURE = (
    f"add an entry for it to the auth file ({AUTH_FLAG} FILE, {ENV_AUTH_FILE} or {ENV_CONTAINERS_AUTH_FILE}; "
    f"docs/oci.md), or set {ENV_HOST} to it with {ENV_USERNAME} and {ENV_PASSWORD}"
)
HOW_TO_INSECURE = f"serve {INSECURE_FLAG} HOST[:PORT], {ENV_INSECURE}=HOST[:PORT], or vmsidecar-oci --plain-http"


@dataclass(frozen=True)
class Credentials:
    """A user name and password, and where they came from (for messages: never the password)."""

    username: str
    password: str = field(repr=False)
    source: str = "the credentials argument"

    def basic(self) -> str:
        """The value of a ``Basic`` Authorization header (without the scheme)."""
        return base64.b64encode(f"{self.username}:{self.password}".encode()).decode()


@dataclass(frozen=True)
class RegistryConfig:
    """Credentials by registry (``host[:port]`` or ``host[:port]/namespace``) and the insecure hosts."""

    auths: Mapping[str, Credentials] = field(default_factory=dict)
    insecure: frozenset[str] = frozenset()
    #: what the pool lends a lease's pulls: ``host[:port]`` or ``host[:port]/namespace``
    lease_scopes: frozenset[str] = frozenset()
    #: why a 401 came without credentials when they were withheld from a lease (:meth:`for_lease`)
    lease_note: str | None = None

    def credentials_for(self, registry: str, repository: str | None = None) -> Credentials | None:
        """The credentials of the most specific entry for ``registry`` (and ``repository``), if any."""
        return next((self.auths[key] for key in _keys_covering(registry, repository) if key in self.auths),
                    None)

    def lends(self, registry: str, repository: str, spec_image: str | None = None) -> bool:
        """Whether a lease's pull of ``registry``/``repository`` may use the pool's credentials: the
        repository of the spec's image (``spec_image``: its guest runs it already), or one under a
        scope the pool owner lends."""
        own = _registry_repository(spec_image)
        return own == (normalize_host(registry), repository) or any(
            key in self.lease_scopes for key in _keys_covering(registry, repository))

    def names_registry(self, registry: str, spec_image: str | None) -> bool:
        """Whether the pool owner named ``registry`` (``host[:port]``): listed as insecure, lent to a
        lease (a scope on it), or the spec's image's registry."""
        host = normalize_host(registry)
        own = _registry_repository(spec_image)
        return (self.is_insecure(host) or (own is not None and own[0] == host)
                or any(scope == host or scope.startswith(f"{host}/") for scope in self.lease_scopes))

    def for_lease(self, registry: str, repository: str, spec_image: str | None) -> RegistryConfig:
        """The configuration a lease's pull of ``registry``/``repository`` works with: this one when
        :meth:`lends` says so, else the same without any credentials (a token service's included).
        A lease holder names the reference: the pool's credentials would read whatever they can
        read into a guest the lease holder is root in."""
        if self.lends(registry, repository, spec_image):
            return self
        note = None
        if self.credentials_for(registry, repository) is not None:
            host = normalize_host(registry)
            note = (f"the pool's credentials for {host} are not lent to a lease's flash of "
                    f"{host}/{repository} (only for the spec's image's repository and what the pool owner "
                    f"lends: serve {LEASE_FLAG} HOST[:PORT][/NAMESPACE] or {ENV_LEASE}); flash an image this "
                    "registry serves without credentials, or ask the pool owner to lend this repository")
        return RegistryConfig(insecure=self.insecure, lease_scopes=self.lease_scopes, lease_note=note)

    def is_insecure(self, registry: str) -> bool:
        """Whether ``registry`` (``host[:port]``) may be spoken to in plain HTTP."""
        host = normalize_host(registry)
        return host in self.insecure or _bare(host) in self.insecure


def normalize_host(text: str) -> str:
    """``host[:port]`` in lower case (``HOST:5000`` and ``host:5000`` are one registry)."""
    return text.strip().lower()


def lease_config(reference: str, spec_image: str | None) -> RegistryConfig | None:
    """What a lease's pull of ``reference`` works with (:meth:`RegistryConfig.for_lease`, for the
    process's configuration now); ``None`` for a reference that is not a registry's.

    :raise BadReferenceError: ``reference`` does not parse. :raise HostError: see :func:`load_config`.
    :raise RegistryError: the registry is the pod's (loopback, link-local) and the pool owner did not
        name it: a lease's reference would make the runtime connect into the pod.
    """
    ref = parse_reference(reference, look=False)  # (classified as check_reference did: by its text)
    if ref.kind != "registry" or not ref.registry or not ref.repository:
        return None
    config = current_config()
    if not config.names_registry(ref.registry, spec_image) and _in_pod(ref.registry):
        raise RegistryError(
            f"registry {ref.registry} is this pod (loopback) or a link-local address such as the cloud "
            "metadata service, which a lease may not make the runtime connect to unless the pool owner names "
            f"it (serve {LEASE_FLAG} HOST[:PORT], {INSECURE_FLAG} HOST[:PORT], or the spec's image); flash "
            "from another registry",
            code="registry_error")
    return config.for_lease(ref.registry, ref.repository, spec_image)


def _in_pod(registry: str) -> bool:
    """Whether ``registry`` (``host[:port]``) is, or resolves to, an address of the pod."""
    match = _HOST_PORT_RE.match(registry)
    if not match:
        return False
    return resolves_to_pod(match.group("host").strip("[]"), int(match.group("port") or 443))


def _keys_covering(registry: str, repository: str | None) -> list[str]:
    """The keys that name ``registry``/``repository`` (``host/a/b``, ``host/a``, ``host``), the most
    specific first: an auth file's, and the scopes lent to a lease."""
    host, parts = normalize_host(registry), repository.split("/") if repository else []
    return [f"{host}/{'/'.join(parts[:i])}" for i in range(len(parts), 0, -1)] + [host]


def _names_a_host(text: str) -> bool:
    """``HOST[:PORT]`` as in an image reference (a bare host names every port)."""
    return _is_host(text) or _is_host(f"{text}:1")


def _registry_repository(reference: str | None) -> tuple[str, str] | None:
    """``(host, repository)`` of a registry reference; ``None`` for anything else (or nothing)."""
    try:
        ref = parse_reference(reference) if reference else None
    except BadReferenceError:  # a spec's image that does not parse lends nothing
        return None
    return (normalize_host(ref.registry), ref.repository) if ref and ref.registry and ref.repository else None


def _bare(host: str) -> str:
    match = _HOST_PORT_RE.match(host)
    return match.group("host") if match else host


#: the process's settings (``serve``/``vmsidecar-oci`` flags); the environment is read at each load
_settings: dict[str, object] = {"auth_file": None, "insecure": (), "lease": ()}


def configure(*, auth_file: Path | None = None, insecure: Iterable[str] = (),
              lease: Iterable[str] = ()) -> RegistryConfig:
    """Set the process's auth file, extra insecure registries and the scopes lent to a lease (the
    command line's) and load once, so that a wrong setting stops the process at start with the reason.

    :raise HostError: see :func:`load_config`.
    """
    _settings["auth_file"] = auth_file
    _settings["insecure"] = tuple(insecure)
    _settings["lease"] = tuple(lease)
    return current_config()


@contextlib.contextmanager
def settings(*, auth_file: Path | None = None, insecure: Iterable[str] = (),
             lease: Iterable[str] = ()) -> Iterator[RegistryConfig]:
    """:func:`configure` for the duration of a ``with`` (a CLI command run in-process), then back.

    :raise HostError: see :func:`load_config`.
    """
    previous = dict(_settings)
    try:
        yield configure(auth_file=auth_file, insecure=insecure, lease=lease)
    finally:
        _settings.update(previous)


def current_config() -> RegistryConfig:
    """The configuration now: the process's settings, the environment, the auth file as it is now.

    :raise HostError: see :func:`load_config`.
    """
    auth_file, insecure, lease = _settings["auth_file"], _settings["insecure"], _settings["lease"]
    assert auth_file is None or isinstance(auth_file, Path)
    assert isinstance(insecure, tuple) and isinstance(lease, tuple)
    return load_config(auth_file=auth_file, insecure=insecure, lease=lease)


def load_config(
    *, auth_file: Path | None = None, insecure: Iterable[str] = (), lease: Iterable[str] = (),
    environ: Mapping[str, str] | None = None
) -> RegistryConfig:
    """Read the auth file(s), the scoped environment credentials, the insecure registries and the
    scopes lent to a lease.

    :raise HostError: an auth file named explicitly that is missing; any auth file that cannot be
        read, is not JSON or has an entry that is not ``user:password``; environment credentials
        without ``VMSIDECAR_REGISTRY_HOST`` (or a host without them); an insecure entry that is not
        ``HOST[:PORT]``; a lent scope that is not ``HOST[:PORT][/NAMESPACE]``.
    """
    env = os.environ if environ is None else environ
    auths: dict[str, Credentials] = {}
    for path in reversed(_auth_files(auth_file, env)):  # the earlier file wins: read it last
        auths.update(_read_auth_file(path))
    auths.update(_env_credentials(env))
    hosts = [*insecure, *env.get(ENV_INSECURE, "").replace(",", " ").split()]
    for host in hosts:
        if not _names_a_host(host.strip()):
            raise HostError(
                f"insecure registry {host!r} ({INSECURE_FLAG} or {ENV_INSECURE}) is not HOST[:PORT]; write it "
                "as in an image reference, e.g. 127.0.0.1:5000 or registry.lan (every port), without http://"
            )
    scopes = [*lease, *env.get(ENV_LEASE, "").replace(",", " ").split()]
    for scope in scopes:
        host, _, namespace = scope.strip().partition("/")
        if not _names_a_host(host) or (namespace and "" in namespace.split("/")):
            raise HostError(
                f"lent registry scope {scope!r} ({LEASE_FLAG} or {ENV_LEASE}) is not "
                "HOST[:PORT][/NAMESPACE]; write it as an auth file's key, e.g. registry.example:5000 or "
                "quay.io/team, without https://"
            )
    return RegistryConfig(auths=auths, insecure=frozenset(normalize_host(h) for h in hosts),
                          # (repos: lower case)
                          lease_scopes=frozenset(_normalize_key(s).lower() for s in scopes))


def _auth_files(explicit: Path | None, env: Mapping[str, str]) -> list[Path]:
    """The auth files to read, earliest first (see the module docstring)."""
    for path, name in ((explicit, AUTH_FLAG), (env.get(ENV_AUTH_FILE), ENV_AUTH_FILE),
                       (env.get(ENV_CONTAINERS_AUTH_FILE), ENV_CONTAINERS_AUTH_FILE)):
        if path:
            if not Path(path).is_file():
                raise HostError(
                    f"the registry auth file {path} ({name}) does not exist or is not a file; give the path of a "
                    "containers-auth.json or Docker config.json, or unset it"
                )
            return [Path(path)]
    home = env.get("HOME") or ""
    candidates = []
    if env.get("XDG_RUNTIME_DIR"):
        candidates.append(Path(env["XDG_RUNTIME_DIR"]) / "containers" / "auth.json")
    config_home = env.get("XDG_CONFIG_HOME") or (f"{home}/.config" if home else "")
    if config_home:
        candidates.append(Path(config_home) / "containers" / "auth.json")
    docker = env.get("DOCKER_CONFIG") or (f"{home}/.docker" if home else "")
    if docker:
        candidates.append(Path(docker) / "config.json")
    return [p for p in candidates if p.is_file()]


def _read_auth_file(path: Path) -> dict[str, Credentials]:
    """The usable entries of one auth file, keyed by normalised registry (and namespace)."""
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise HostError(
            f"cannot read the registry auth file {path} ({exc.strerror}); make it readable by uid {os.getuid()}"
        ) from None
    except ValueError as exc:
        raise HostError(f"the registry auth file {path} is not valid JSON ({exc}); fix it or point to another") from None
    auths = doc.get("auths", {}) if isinstance(doc, dict) else None
    if not isinstance(auths, dict):
        raise HostError(
            f'the registry auth file {path} has no "auths" object; write {{"auths": {{"HOST[:PORT]": '
            '{"auth": "<base64 of user:password>"}}}'
        )
    found: dict[str, Credentials] = {}
    for key, entry in auths.items():
        registry = _normalize_key(str(key))
        if not isinstance(entry, dict) or not registry:
            raise HostError(f"the registry auth file {path} has an entry {key!r} that is not an object with auth, "
                            "or username and password; fix or remove it")
        creds = _entry_credentials(path, str(key), entry)
        if creds is not None:
            found[registry] = creds
    return found


def _normalize_key(key: str) -> str:
    """An ``auths`` key as ``host[:port]`` (URL keys: their host only) or ``host[:port]/namespace``."""
    if "://" in key:
        return normalize_host(urlsplit(key).netloc)
    host, _, namespace = key.strip().strip("/").partition("/")
    return normalize_host(host) + (f"/{namespace}" if namespace else "")


def _entry_credentials(path: Path, key: str, entry: dict) -> Credentials | None:
    """The credentials of one entry; ``None`` for one without any (a credential helper's)."""
    source = f"the auth file {path} (entry {key})"
    encoded = entry.get("auth")
    if isinstance(encoded, str) and encoded.strip():
        try:
            user, sep, password = base64.b64decode(encoded.strip(), validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            sep, user, password = "", "", ""
        if not sep or not user:
            raise HostError(
                f"the registry auth file {path} has an entry {key} whose auth is not base64 of user:password; "
                "write it again (e.g. printf %s USER:PASSWORD | base64 -w0) or log in again"
            )
        return Credentials(user, password, source)
    username, secret = entry.get("username"), entry.get("password")
    if isinstance(username, str) and username and isinstance(secret, str):
        return Credentials(username, secret, source)
    return None


def _env_credentials(env: Mapping[str, str]) -> dict[str, Credentials]:
    """``VMSIDECAR_REGISTRY_USERNAME``/``_PASSWORD`` for the one host ``VMSIDECAR_REGISTRY_HOST`` names."""
    user, password, host = env.get(ENV_USERNAME), env.get(ENV_PASSWORD), env.get(ENV_HOST)
    if not (user or password or host):
        return {}
    if not (user and password):
        raise HostError(
            f"{ENV_USERNAME} and {ENV_PASSWORD} must be set together (one is missing); set both, or neither and use "
            f"an auth file ({AUTH_FLAG} FILE)"
        )
    if not host:
        raise HostError(
            f"{ENV_USERNAME}/{ENV_PASSWORD} are set without {ENV_HOST}: vmsidecar sends credentials only to the "
            f"registry they are for, never to whichever registry a reference names; set {ENV_HOST}=HOST[:PORT] of "
            f"that registry, or put them in an auth file ({AUTH_FLAG} FILE, {ENV_AUTH_FILE}; docs/oci.md)"
        )
    if not _is_host(host.strip()) and not _is_host(f"{host.strip()}:1"):
        raise HostError(f"{ENV_HOST}={host!r} is not HOST[:PORT]; write the registry as in an image reference, "
                        "e.g. registry.example:5000, without https://")
    return {normalize_host(host): Credentials(user, password, f"{ENV_USERNAME}/{ENV_PASSWORD} ({ENV_HOST})")}
