"""Registry credentials reach only the registry they are for (issue 19 items 2 and 11c).

Each test carries out the attack for real: fake registries on loopback (``FakeRegistry``, a real
HTTP server) that answer ``401`` with a challenge of the attacker's choosing and record every
header they are sent; the real runtime (``start_runtime``) or the real pull code, a real
docker-registry with htpasswd for the legitimate case, a real QEMU and qemu-img for the child
environment.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.http_server import LoopbackServer
from fixtures.registry import AUTH_PASSWORD, AUTH_USER, RunningRegistry, auth_file
from fixtures.runtime import qemu_pids
from fixtures.waiting import wait_until_async
from vmsidecar_contract.errors import HostError, RegistryError
from vmsidecar_runtime import procs
from vmsidecar_runtime.oci import pull, push_artifact, transport
from vmsidecar_runtime.oci.auth import load_config
from vmsidecar_runtime.oci.cli import main as oci_main
from vmsidecar_runtime.oci.reference import parse_reference
from vmsidecar_runtime.oci.registry import RegistryClient

SECRET = "pool-s3cret-9f2c"
USER = "pool-robot"
#: what a leak looks like on the wire: the password itself or the Basic header's base64
LEAKS = (SECRET, base64.b64encode(f"{USER}:{SECRET}".encode()).decode())


class FakeRegistry(LoopbackServer):
    """A real HTTP server on 127.0.0.1 that answers every request with ``answer(handler)`` and
    records the request line and headers of each request (what an attacker's server collects)."""

    def __init__(self, answer: Callable[[http.server.BaseHTTPRequestHandler], None] | None = None,
                 address: str = "127.0.0.1") -> None:
        self.requests: list[str] = []
        self.answer = answer or challenge('Basic realm="x"')
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                fake.requests.append(f"{self.requestline}\n{self.headers}")
                fake.answer(self)

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = _any

        super().__init__(Handler, address)

    def leaked(self) -> list[str]:
        """The requests that carried an Authorization header or the secret in any form."""
        return [r for r in self.requests if "authorization:" in r.lower() or any(s in r for s in LEAKS)]


def challenge(www_authenticate: str) -> Callable[[http.server.BaseHTTPRequestHandler], None]:
    """An answer: ``401`` with this ``WWW-Authenticate``."""

    def answer(h: http.server.BaseHTTPRequestHandler) -> None:
        body = b'{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}'
        h.send_response(401)
        h.send_header("WWW-Authenticate", www_authenticate)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    return answer


def token_service_with(token: str) -> Callable[[http.server.BaseHTTPRequestHandler], None]:
    """An answer: ``200`` with this token."""

    def answer(h: http.server.BaseHTTPRequestHandler) -> None:
        body = json.dumps({"token": token}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    return answer


#: a token endpoint that hands out a token to anyone (it only wants to see what it is sent)
token_service = token_service_with("stolen-nothing")


@contextlib.contextmanager
def fakes(n: int, *answers: Callable[[http.server.BaseHTTPRequestHandler], None]) -> Iterator[list[FakeRegistry]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(FakeRegistry(answers[i] if i < len(answers) else None)) for i in range(n)]


def pool_env(tmp_path: Path, host: str, *, file_hosts: tuple[str, ...] = (), insecure: tuple[str, ...] = ()
             ) -> dict[str, str]:
    """The pool's runtime environment: its credentials (the same pair, as a pool has one robot
    account) for ``host`` by the environment and for ``file_hosts`` by an auth file; before the fix,
    the environment's pair went to every registry a reference named, and the file was not read.
    The pool lends ``host`` to a lease's flash: these tests are about where credentials go once used."""
    env = {"VMSIDECAR_REGISTRY_USERNAME": USER, "VMSIDECAR_REGISTRY_PASSWORD": SECRET,
           "VMSIDECAR_REGISTRY_HOST": host, "VMSIDECAR_INSECURE_REGISTRIES": ",".join(insecure),
           "VMSIDECAR_LEASE_REGISTRIES": ",".join((host, *file_hosts)),
           "VMSIDECAR_REGISTRY_AUTH_FILE": str(auth_file(tmp_path / "auth.json", dict.fromkeys(file_hosts,
                                                                                               (USER, SECRET))))}
    return env


async def flash(rt: Any, reference: str) -> RegistryError:
    with pytest.raises(RegistryError) as info:
        await rt.client().flash_reference(reference)
    return info.value


SPEC = {"memory": "256M"}  # no image: the runtime serves, boots nothing, and a flash is one pull


# -- credentials stay with their registry --------------------------------------------------------


async def test_a_registry_the_pool_has_no_credentials_for_gets_none(
    start_runtime: Any, registry: RunningRegistry, tmp_path: Path
) -> None:
    """A lease holder flashes ``oci://127.0.0.1:<its port>/x:y`` and answers ``401 Basic``: the
    pool's credentials (configured for the real registry) are not sent, and the error says why."""
    with FakeRegistry() as fake:
        rt = await start_runtime(SPEC, env=pool_env(tmp_path, registry.host, insecure=(registry.host, fake.host)))
        error = await flash(rt, f"oci://{fake.host}/x:y")
    assert fake.requests, "the runtime never asked the fake registry: the attack did not happen"
    assert fake.leaked() == [], f"the pool's credentials reached {fake.host}: {fake.leaked()}"
    assert error.code == "registry_unauthorized"
    assert f"no credentials are configured for {fake.host}" in error.message, error.message
    assert SECRET not in rt.log_text()


async def test_a_token_realm_on_another_host_gets_no_credentials(start_runtime: Any, tmp_path: Path) -> None:
    """The registry the credentials are for answers ``401 Bearer realm="http://<another host>/token"``:
    the realm is asked for a token without them (before: oras-py sent them to any realm)."""
    with fakes(2) as (registry, realm):
        registry.answer = challenge(f'Bearer realm="http://{realm.host}/token",service="s",scope="repository:x:pull"')
        realm.answer = token_service
        rt = await start_runtime(SPEC, env=pool_env(tmp_path, registry.host, insecure=(registry.host, realm.host)))
        error = await flash(rt, f"oci://{registry.host}/x:y")
    assert registry.requests
    assert realm.leaked() == [], f"the credentials for {registry.host} reached the realm {realm.host}"
    assert error.code == "registry_unauthorized"
    assert f"token service {realm.host}" in error.message and "another host" in error.message, error.message


async def test_a_plain_http_token_realm_is_never_asked(start_runtime: Any, tmp_path: Path) -> None:
    """The lease holder's registry (listed insecure here, standing for any registry it controls)
    answers ``401 Bearer realm="http://<metadata-like host>/latest/meta-data/…"``: the runtime must
    not fetch a plain-HTTP URL of the attacker's choosing (before: it did, anonymously — a request
    into the pod's loopback or the cloud metadata service on the lease holder's word)."""
    with fakes(2) as (registry, metadata):
        registry.answer = challenge(f'Bearer realm="http://{metadata.host}/latest/meta-data/iam/",service="s"')
        metadata.answer = token_service
        env = {**pool_env(tmp_path, "registry.pool.example"), "VMSIDECAR_INSECURE_REGISTRIES": registry.host}
        rt = await start_runtime(SPEC, env=env)
        error = await flash(rt, f"oci://{registry.host}/x:y")
    assert registry.requests, "the runtime never asked the lease holder's registry: the attack did not happen"
    assert metadata.requests == [], f"the runtime fetched the realm {metadata.host}: {metadata.requests}"
    assert error.code == "registry_unauthorized"
    assert "plain HTTP" in error.message, error.message


async def test_an_https_registry_is_never_asked_over_http(start_runtime: Any, tmp_path: Path) -> None:
    """Credentials for host A, which is not listed as insecure, and A is a plain-HTTP server on
    loopback: the runtime speaks TLS to it and fails (before: loopback meant plain HTTP, and the
    credentials went over it in the clear)."""
    with FakeRegistry() as fake:
        rt = await start_runtime(SPEC, env=pool_env(tmp_path, fake.host))
        error = await flash(rt, f"oci://{fake.host}/x:y")
    assert fake.leaked() == [] and fake.requests == [], f"HTTP requests reached {fake.host}: {fake.requests}"
    assert error.code == "registry_tls"
    assert "VMSIDECAR_INSECURE_REGISTRIES" in error.message and "--insecure-registry" in error.message, error.message


def test_a_redirect_to_another_host_carries_no_authorization(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry the credentials are for takes them, then answers the blob GET with ``307`` to
    another host: the download follows it without the Authorization header."""
    blob = b"disk bytes"
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()

    def registry_answer(h: http.server.BaseHTTPRequestHandler) -> None:
        if "Authorization" not in h.headers:
            challenge('Basic realm="x"')(h)
            return
        h.send_response(307)
        h.send_header("Location", f"http://{other.host}/storage/{digest}")
        h.send_header("Content-Length", "0")
        h.end_headers()

    def storage_answer(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(len(blob)))
        h.end_headers()
        h.wfile.write(blob)

    with FakeRegistry(registry_answer) as registry, FakeRegistry(storage_answer, address="127.0.0.2") as other:
        monkeypatch.setenv("VMSIDECAR_INSECURE_REGISTRIES", f"{registry.host},{other.host}")
        client = RegistryClient(parse_reference(f"{registry.host}/x/y:1"), credentials=(USER, SECRET))
        try:
            with client.open_blob({"digest": digest, "size": len(blob)}) as chunks:
                assert b"".join(chunks) == blob
        finally:
            client.close()
    assert any("authorization: basic" in r.lower() for r in registry.requests), "the registry never got them"
    assert other.requests and other.leaked() == [], other.leaked()


def test_netrc_credentials_are_not_sent_to_any_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """requests adds ``~/.netrc`` credentials to every request (and redirect) it sends when the
    session trusts the environment: a ``default`` entry would go to any registry a lease names."""
    netrc = tmp_path / "netrc"
    netrc.write_text(f"default login {USER} password {SECRET}\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    with FakeRegistry() as fake:
        monkeypatch.setenv("VMSIDECAR_INSECURE_REGISTRIES", fake.host)
        with pytest.raises(RegistryError):
            pull(f"{fake.host}/x:y", tmp_path / "cache")
    assert fake.requests and fake.leaked() == [], fake.leaked()


# -- configuration --------------------------------------------------------------------------------


async def test_unscoped_environment_credentials_are_refused_at_start(start_runtime: Any) -> None:
    rt = await start_runtime(SPEC, env={"VMSIDECAR_REGISTRY_USERNAME": USER, "VMSIDECAR_REGISTRY_PASSWORD": SECRET},
                             wait=False)
    assert rt.proc.wait(30) == 2
    log = rt.log_text()
    assert "VMSIDECAR_REGISTRY_HOST" in log and "auth" in log, log[-2000:]
    assert SECRET not in log


@pytest.mark.parametrize("entry", ["auth", "fields", "url-key"])
def test_auth_file_forms(entry: str, auth_registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path) -> None:
    """The forms users' files have: ``auth`` (base64), ``username``/``password``, and a key written
    as a URL (``docker login`` writes ``https://host/v1/``); read by ``vmsidecar-oci --registry-auth``;
    entries without credentials (a ``credsStore`` user's) are ignored."""
    encoded = base64.b64encode(f"{AUTH_USER}:{AUTH_PASSWORD}".encode()).decode()
    creds = {"fields": {"username": AUTH_USER, "password": AUTH_PASSWORD}}.get(entry, {"auth": encoded})
    key = f"https://{auth_registry.host}/v1/" if entry == "url-key" else auth_registry.host
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"auths": {key: creds, "other.example:5000": {}}, "credsStore": "desktop"}))
    ref = f"{auth_registry.host}/forms/{entry}:1"
    assert oci_main(["push", str(oci_qcow2), ref, "--registry-auth", str(path)]) == 0
    assert oci_main(["pull", ref, "--cache", str(tmp_path / "c"), "--registry-auth", str(path)]) == 0
    with pytest.raises(RegistryError) as info:  # and without the file, the same registry refuses
        pull(ref, tmp_path / "c2")
    assert info.value.code == "registry_unauthorized"


def test_a_bad_auth_file_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "auth.json"
    path.write_text('{"auths": {"reg.example": {"auth": "bm90LWJhc2U2NA-!"}}}')
    monkeypatch.setenv("VMSIDECAR_REGISTRY_AUTH_FILE", str(path))
    with pytest.raises(HostError) as info:
        pull("reg.example/x:1", tmp_path / "c")
    assert str(path) in info.value.message and "reg.example" in info.value.message
    monkeypatch.setenv("VMSIDECAR_REGISTRY_AUTH_FILE", str(tmp_path / "missing.json"))
    with pytest.raises(HostError) as missing:
        pull("reg.example/x:1", tmp_path / "c")
    assert "missing.json" in missing.value.message


# -- 11c: a cached digest is not a licence ---------------------------------------------------------


async def test_a_cached_digest_needs_the_registry_to_authorise_it(
    start_runtime: Any, auth_registry: RunningRegistry, oci_qcow2: Path, image_cache: Path, tmp_path: Path
) -> None:
    """A private image pulled into the pool's cache by someone entitled to it; a lease holder with
    no credentials for that registry names its digest (on that registry, or on a host of their
    own): the runtime asks the registry, which refuses, and the cached disk is not used (before:
    a cached digest was used with no request at all)."""
    ref = f"{auth_registry.host}/private/tiny:1"
    push_artifact(oci_qcow2, ref, credentials=(AUTH_USER, AUTH_PASSWORD))
    digest = pull(ref, image_cache, credentials=(AUTH_USER, AUTH_PASSWORD)).manifest_digest
    assert digest
    with FakeRegistry() as fake:
        rt = await start_runtime(SPEC, env={"VMSIDECAR_INSECURE_REGISTRIES": f"{auth_registry.host},{fake.host}"})
        refused = await flash(rt, f"oci://{auth_registry.host}/private/tiny@{digest}")
        elsewhere = await flash(rt, f"oci://{fake.host}/private/tiny@{digest}")
    assert refused.code == "registry_unauthorized", refused.message
    assert elsewhere.code == "registry_unauthorized", elsewhere.message
    assert (await rt.client().state()).image_digest is None


def test_a_layer_digest_named_by_another_registry_is_not_a_licence(
    auth_registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path
) -> None:
    """A private disk in the cache, pulled with the pool's credentials; a lease holder's registry
    serves a manifest of its own naming that disk's layer digest, and never the blob: before, the
    cache answered by the layer's digest and the private disk was flashed (the manifest was the
    attacker's, so the manifest GET proved nothing). The registry named must deliver the bytes."""
    from vmsidecar_runtime.oci.pull import inspect

    ref = f"{auth_registry.host}/private/layered:1"
    push_artifact(oci_qcow2, ref, credentials=(AUTH_USER, AUTH_PASSWORD))
    cache = tmp_path / "cache"
    private = pull(ref, cache, credentials=(AUTH_USER, AUTH_PASSWORD))
    layer = inspect(ref, credentials=(AUTH_USER, AUTH_PASSWORD))["disk"]
    empty = "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.empty.v1+json", "size": 2,
                                      "digest": empty},
                           "layers": [{k: layer[k] for k in ("mediaType", "digest", "size")}]}).encode()
    blob_requests: list[str] = []

    def answer(h: http.server.BaseHTTPRequestHandler) -> None:
        body, status = (manifest, 200) if "/manifests/" in h.path else (b"{}", 200)
        if "/blobs/" in h.path:
            blob_requests.append(h.path)
            body, status = b'{"errors":[{"code":"BLOB_UNKNOWN","message":"blob unknown"}]}', 404
        h.send_response(status)
        h.send_header("Content-Type", "application/vnd.oci.image.manifest.v1+json" if status == 200 else
                      "application/json")
        h.send_header("Docker-Content-Digest", "sha256:" + hashlib.sha256(body).hexdigest())
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    with FakeRegistry(answer) as fake, pytest.raises(RegistryError) as refused:
        stolen = pull(f"{fake.host}/x/y:1", cache)
        pytest.fail(f"the private disk {private.digest} was handed out for another registry's manifest: "
                    f"{stolen}")
    assert blob_requests, "the lease holder's registry was never asked for the blob"
    assert refused.value.code == "blob_not_found", refused.value.message


def test_one_blob_declared_two_ways_is_two_disks(registry: RunningRegistry, tmp_path: Path) -> None:
    """The same blob bytes named by one manifest as a raw disk and by another as a zstd-compressed
    raw disk are two different disks: before, both were cached under one key (the blob's digest and
    the format), so whichever was pulled first answered for the other (a lease could plant the
    undecompressed bytes as the pool's disk)."""
    import zstandard

    from fixtures.registry import Crafter

    disk = bytes(range(256)) * 4096  # 1 MiB of raw disk
    blob = zstandard.ZstdCompressor().compress(disk)
    craft = Crafter(registry=registry, repo="declared/twice")
    as_raw = craft.tag(craft.manifest([craft.blob(blob, "application/vnd.diskimage.raw")],
                                      artifact_type="application/vnd.diskimage.raw"), "raw")
    as_zstd = craft.tag(craft.manifest([craft.blob(blob, "application/vnd.diskimage.raw+zstd")],
                                       artifact_type="application/vnd.diskimage.raw"), "zstd")
    cache = tmp_path / "cache"
    planted = pull(as_raw, cache, arch="x86_64")
    assert planted.path.read_bytes() == blob
    real = pull(as_zstd, cache, arch="x86_64")
    assert real.digest == "sha256:" + hashlib.sha256(disk).hexdigest(), real
    assert real.path.read_bytes() == disk


# -- the pool's credentials are not lent to a lease's flash ---------------------------------------


async def test_a_lease_cannot_flash_another_private_repository_with_the_pools_credentials(
    start_runtime: Any, auth_registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path
) -> None:
    """The pool has credentials for its registry (for its own image); a lease holder flashes
    another private repository of that registry, one they cannot read: before, the runtime pulled
    it with the pool's credentials into the guest the lease holder is root in (the pool's access
    lent to anyone who holds a lease). Now a lease's flash gets the pool's credentials only for the
    repositories the pool owner lends it (``VMSIDECAR_LEASE_REGISTRIES``, ``--lease-registry``)."""
    private = f"{auth_registry.host}/secret/other:1"
    push_artifact(oci_qcow2, private, credentials=(AUTH_USER, AUTH_PASSWORD))
    env = {"VMSIDECAR_REGISTRY_AUTH_FILE": str(auth_file(tmp_path / "auth.json",
                                                         {auth_registry.host: (AUTH_USER, AUTH_PASSWORD)}))}
    rt = await start_runtime(SPEC, env=env)
    refused = await flash(rt, f"oci://{private}")
    assert refused.code == "registry_unauthorized", refused.message
    assert (f"{auth_registry.host}/secret/other" in refused.message
            and "--lease-registry" in refused.message), refused.message
    assert (await rt.client().state()).image_digest is None
    # lent by the pool owner (a namespace): the same flash works, with the same credentials
    lent = await start_runtime(SPEC, env={**env,
                                          "VMSIDECAR_LEASE_REGISTRIES": f"{auth_registry.host}/secret"},
                               name="lent")
    assert (await lent.client().flash_reference(f"oci://{private}")).image_digest


async def test_a_lease_may_flash_other_tags_of_the_pools_own_image(
    start_runtime: Any, auth_registry: RunningRegistry, oci_qcow2: Path, tmp_path: Path
) -> None:
    """The repository of the spec's image is lent to a lease without asking (its guest already runs
    that image): another tag of it flashes with the pool's credentials."""
    own = f"{auth_registry.host}/pool/vm"
    for tag in ("1", "2"):
        push_artifact(oci_qcow2, f"{own}:{tag}", credentials=(AUTH_USER, AUTH_PASSWORD))
    env = {"VMSIDECAR_REGISTRY_AUTH_FILE": str(auth_file(tmp_path / "auth.json",
                                                         {auth_registry.host: (AUTH_USER, AUTH_PASSWORD)}))}
    # a blank disk: the guest's firmware finds nothing to boot, which is all this test needs of it
    rt = await start_runtime({**SPEC, "image": f"{own}:1", "snapshot": "off", "readiness": {"pattern": None}},
                             env=env)
    await rt.client().wait_ready(120)
    state = await rt.client().flash_reference(f"oci://{own}:2", power_off=True)
    assert state.image_digest


# -- child processes ------------------------------------------------------------------------------


def test_a_child_started_through_procs_sees_no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VMSIDECAR_REGISTRY_PASSWORD", "REGISTRY_AUTH_FILE", "AWS_SECRET_ACCESS_KEY", "SOME_TOKEN"):
        monkeypatch.setenv(name, SECRET)
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    rc, out, _ = procs.run("env")
    assert rc == 0
    names = {line.split("=", 1)[0] for line in out.splitlines()}
    assert SECRET not in out, out
    assert "PATH" in names and "LC_ALL" in names


async def test_qemu_of_a_booted_guest_sees_no_secret(start_runtime: Any, tiny_image: Any, tmp_path: Path) -> None:
    """The real QEMU the runtime starts (read from /proc/PID/environ): no registry credentials, no
    auth file name, no other variable outside the allow-list."""
    auth = auth_file(tmp_path / "auth.json", {"reg.example": (USER, SECRET)})
    env = {"VMSIDECAR_REGISTRY_AUTH_FILE": str(auth), "VMSIDECAR_REGISTRY_USERNAME": USER,
           "VMSIDECAR_REGISTRY_PASSWORD": SECRET, "VMSIDECAR_REGISTRY_HOST": "reg.example",
           "REGISTRY_AUTH_FILE": str(auth), "MY_API_TOKEN": SECRET}
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off"}, env=env)
    pids = await wait_until_async(lambda: qemu_pids(str(rt.state)), 60, "QEMU to start", interval=0.1,
                                  detail=lambda: rt.log_text()[-2000:])
    environ = Path(f"/proc/{pids[0]}/environ").read_bytes().decode(errors="replace")
    assert SECRET not in environ and "VMSIDECAR_REGISTRY" not in environ and "REGISTRY_AUTH_FILE" not in environ
    names = {e.split("=", 1)[0] for e in environ.split("\0") if e}
    assert names <= set(procs.CHILD_ENV) | {n for n in names if n.startswith(procs.CHILD_ENV_PREFIXES)}, names
    assert "PATH" in names

    # a guest escaped into QEMU is QEMU: the runtime's UID (here root, as in upstream's pool pods),
    # with no capability (it had every one the container had: CAP_DAC_OVERRIDE, CAP_NET_RAW ...)
    status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pids[0]}/status").read_text().splitlines()
                  if ":\t" in line)
    if os.geteuid() == 0:
        assert {status[c].strip() for c in ("CapPrm", "CapEff", "CapBnd", "CapAmb")} == {"0" * 16}, status
    # ... and it reads nothing of the runtime: not its environment, nor what its fds hold (the auth
    # file), nor its memory (before: the password, read by the runtime's own UID, no capability needed)
    as_qemu = ["setpriv", *procs.NO_CAPABILITIES, "--"] if os.geteuid() == 0 else []
    for inside in ("environ", "mem", "fd"):
        peek = subprocess.run([*as_qemu, *(["ls", "-l"] if inside == "fd" else ["cat"]), f"/proc/{rt.proc.pid}/{inside}"],
                              capture_output=True, timeout=10)
        assert peek.returncode != 0 and SECRET.encode() not in peek.stdout, (inside, peek)
        assert b"Permission denied" in peek.stderr, (inside, peek.stderr)


def test_which_entry_is_whose(tmp_path: Path) -> None:
    """Keys as users' files write them; the most specific entry wins; the earlier default file wins;
    an insecure ``HOST`` covers its ports, ``HOST:PORT`` only that one."""
    (tmp_path / "run" / "containers").mkdir(parents=True)
    (tmp_path / "home" / ".docker").mkdir(parents=True)
    auth_file(tmp_path / "run" / "containers" / "auth.json", {"Quay.IO/team": ("team", "pw-team"), "quay.io": ("q", "pw-q")})
    auth_file(tmp_path / "home" / ".docker" / "config.json", {"quay.io": ("docker", "d"),
                                                              "https://reg.example:5000/v1/": ("r", "r")})
    config = load_config(environ={"XDG_RUNTIME_DIR": str(tmp_path / "run"), "HOME": str(tmp_path / "home"),
                                  "VMSIDECAR_INSECURE_REGISTRIES": "lan.example, 127.0.0.1:5000"})
    assert config.credentials_for("quay.io", "team/app").username == "team"
    assert config.credentials_for("quay.io", "teamx/app").username == "q"  # a path prefix, not a string prefix
    assert config.credentials_for("reg.example:5000", "x").username == "r"
    assert config.credentials_for("reg.example", "x") is None  # another port is another registry
    assert config.credentials_for("evil.example", "quay.io") is None
    assert config.is_insecure("lan.example:8080") and config.is_insecure("127.0.0.1:5000")
    assert not config.is_insecure("127.0.0.1:5001") and not config.is_insecure("quay.io")
    assert "pw-" not in repr(config)  # a logged or printed config shows no password


@pytest.mark.parametrize("realm_on", ["registry", "token-host-same-credentials", "known-token-service"])
def test_bearer_token_flow_still_works(realm_on: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The legitimate cases of the token flow, each given the registry's own credentials: a realm on
    the registry's own host; a realm on another host whose auth entry holds those very credentials
    (the owner's word that it takes them: GitLab's shape, registry:2 with a token server elsewhere);
    a realm on a host known to be the registry's token service (Docker Hub's ``auth.docker.io``,
    GitLab's ``gitlab.com``), with no entry of its own."""
    issued = "issued-token-1"

    def token(h: http.server.BaseHTTPRequestHandler) -> None:
        if h.headers.get("Authorization") == "Basic " + base64.b64encode(f"{USER}:{SECRET}".encode()).decode():
            token_service_with(issued)(h)
        else:
            challenge('Basic realm="token"')(h)

    def registry_answer(h: http.server.BaseHTTPRequestHandler) -> None:
        if h.path.startswith("/token"):
            token(h)
        elif h.headers.get("Authorization") == f"Bearer {issued}":
            body = b'{"errors":[{"code":"MANIFEST_UNKNOWN","message":"unknown"}]}'
            h.send_response(404)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
        else:
            realm_host = registry.host if realm_on == "registry" else other.host
            challenge(f'Bearer realm="http://{realm_host}/token",service="s",scope="repository:x/y:pull"')(h)

    with FakeRegistry(registry_answer) as registry, FakeRegistry(token) as other:
        entries = {registry.host: (USER, SECRET)}
        if realm_on == "token-host-same-credentials":
            entries[other.host] = (USER, SECRET)
        if realm_on == "known-token-service":
            monkeypatch.setitem(transport.KNOWN_TOKEN_SERVICES, registry.host, frozenset({other.host}))
        monkeypatch.setenv("VMSIDECAR_INSECURE_REGISTRIES", f"{registry.host},{other.host}")
        monkeypatch.setenv("VMSIDECAR_REGISTRY_AUTH_FILE", str(auth_file(tmp_path / "a.json", entries)))
        with pytest.raises(RegistryError) as info:
            pull(f"{registry.host}/x/y@sha256:{'0' * 64}", tmp_path / "c")
    assert info.value.code == "manifest_not_found", info.value.message  # authorised: the registry looked
    if realm_on != "registry":
        assert any(s in r for r in other.requests for s in LEAKS)  # the registry's credentials went there


def test_the_known_token_services_are_the_public_registries_own() -> None:
    """Docker Hub's registry host asks ``auth.docker.io`` for tokens, GitLab's ``gitlab.com``."""
    assert "auth.docker.io" in transport.KNOWN_TOKEN_SERVICES["registry-1.docker.io"]
    assert transport.KNOWN_TOKEN_SERVICES["registry.gitlab.com"] == frozenset({"gitlab.com"})


@pytest.mark.parametrize("registry_entry", ["none", "other-credentials"])
def test_a_registry_cannot_have_another_hosts_token_service_issue_it_a_token(
    registry_entry: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Audit F6: registry A answers ``401 Bearer realm="<B's token service>",scope="repository:
    victim/private:pull"``, and the auth file has an entry for B (and for A none, or other
    credentials). Before: vmsidecar sent B's credentials to B, then the token B issued on them (a
    pull of B's private repository) to A. Now B is asked without credentials (neither its own,
    chosen by A's answer, nor A's), A gets at most an anonymous token, and the error says why."""
    victim = ("victim-robot", "victim-pw-31")
    issued = "token-issued-on-credentials"

    def token_b(h: http.server.BaseHTTPRequestHandler) -> None:
        token_service_with(issued if h.headers.get("Authorization") else "anonymous-token")(h)

    def registry_a(h: http.server.BaseHTTPRequestHandler) -> None:
        challenge(f'Bearer realm="http://{b.host}/token",service="b",scope="repository:victim/private:pull"')(h)

    with FakeRegistry(registry_a) as a, FakeRegistry(token_b) as b:
        entries = {b.host: victim}
        if registry_entry == "other-credentials":
            entries[a.host] = (USER, SECRET)
        monkeypatch.setenv("VMSIDECAR_INSECURE_REGISTRIES", f"{a.host},{b.host}")
        monkeypatch.setenv("VMSIDECAR_REGISTRY_AUTH_FILE", str(auth_file(tmp_path / "a.json", entries)))
        with pytest.raises(RegistryError) as info:
            pull(f"{a.host}/x/y:1", tmp_path / "c")
    assert b.requests, "the token service was never asked: the attack did not happen"
    assert not any("authorization:" in r.lower() for r in b.requests), f"credentials reached {b.host}: {b.requests}"
    assert not any(issued in r for r in a.requests), f"{a.host} received a token issued on credentials"
    assert any("Bearer anonymous-token" in r for r in a.requests), a.requests
    assert info.value.code == "registry_unauthorized", info.value.message
    assert f"token service {b.host}" in info.value.message and "another host" in info.value.message, (
        info.value.message)
    assert victim[1] not in info.value.message and SECRET not in info.value.message
