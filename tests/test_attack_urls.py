"""Attack (issue 19): a lease holder names a URL for ``j vm storage flash``, and the exporter —
inside the pod — fetches it with headers the lease holder chooses. Pointed at the pod's loopback
or at the cloud metadata service (``http://169.254.169.254/…``, ``Metadata-Flavor: Google``),
that is a request from inside the pod on the lease holder's word.

Through real ``jmp`` processes: a listener on this machine's loopback stands for a pod-local
service; the flash must be refused before any request reaches it, naming the exporter config's
switch, while the same exporter with ``allow_local_urls: true`` (a laptop) does fetch it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http.server
import json
import shlex
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from backports import zstd

from fixtures.attack import memory_kib, routable_address
from fixtures.jmp import exporter_config, run_shell

pytestmark = pytest.mark.timeout(300)


@contextlib.contextmanager
def pod_local_service() -> Iterator[tuple[int, list[str]]]:
    """A plain HTTP server on 127.0.0.1 that records every request it gets: (port, requests)."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.requestline)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()


async def test_a_flash_url_naming_the_pod_or_the_metadata_service_is_never_fetched(
    start_runtime: Any, standalone_exporter: Any, tmp_path: Path
) -> None:
    rt = await start_runtime(None)
    with pod_local_service() as (port, seen):
        cfg = exporter_config(tmp_path / "exporter.yaml", {"socket": str(rt.socket)})
        exp = await asyncio.to_thread(standalone_exporter, cfg)
        # (`:+PORT`: urlsplit refuses the port, yarl, which the fetch uses, takes it: the check had
        # taken the URL for one that does not resolve, and let it through)
        urls = (f"http://127.0.0.1:{port}/disk.qcow2", f"http://localhost:{port}/disk.qcow2",
                f"http://127.0.0.1:+{port}/disk.qcow2",
                "http://169.254.169.254/computeMetadata/v1/instance/service-accounts/default/token",
                # the IPv6 metadata services (AWS, GCP: unique-local, not link-local), and the IPv4
                # one inside NAT64's and the IPv4-compatible prefix
                "http://[fd00:ec2::254]/latest/meta-data/iam/security-credentials/",
                "http://[fd20:ce::254]/computeMetadata/v1/instance/service-accounts/default/token",
                "http://[64:ff9b::a9fe:a9fe]/latest/meta-data/", "http://[::a9fe:a9fe]/latest/meta-data/")
        # one lease, one `j` per URL (a shell per URL cost a lease's setup each: 8 of them took 48 s)
        script = "\n".join(f"echo '=== {i}'; if j vm storage flash {shlex.quote(url)} 2>&1; then echo '=== fetched'; "
                           f"else echo '=== refused'; fi" for i, url in enumerate(urls))
        result = await asyncio.to_thread(run_shell, exp.shell_args, script, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        answers = result.stdout.split("=== ")[1:]
        assert len(answers) == 2 * len(urls), result.stdout[-2000:]
        for url, (said, outcome) in zip(urls, zip(answers[::2], answers[1::2], strict=True), strict=True):
            message = " ".join(said.split())
            assert outcome.strip() == "refused", (url, message[-2000:])
            assert "which a lease may not reach" in message and "allow_local_urls" in message, (url, message[-2000:])
        assert seen == [], f"the exporter fetched a pod-local URL for the lease holder: {seen}"
        assert exp.proc.poll() is None  # the exporter keeps serving

        # the control: a laptop's exporter that allows it does fetch the same URL (so the test can fail)
        laptop = exporter_config(tmp_path / "laptop.yaml", {"socket": str(rt.socket), "allow_local_urls": True})
        exp = await asyncio.to_thread(standalone_exporter, laptop)
        await asyncio.to_thread(run_shell, exp.shell_args, f"j vm storage flash http://127.0.0.1:{port}/disk.qcow2",
                                cwd=tmp_path)
        assert seen == ["GET /disk.qcow2 HTTP/1.1"], seen


@contextlib.contextmanager
def redirecting_to(target: str) -> Iterator[str]:
    """A plain HTTP server on this machine's routable address whose every GET is ``302`` to ``target``
    (``test_attack_credentials.FakeRegistry``: any answer); yields its base URL."""
    from test_attack_credentials import FakeRegistry

    def answer(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(302)
        h.send_header("Location", target)
        h.send_header("Content-Length", "0")
        h.end_headers()

    with FakeRegistry(answer, address=routable_address()) as server:
        yield f"http://{server.host}"


async def test_a_flash_url_that_redirects_into_the_pod_is_never_followed_there(
    start_runtime: Any, standalone_exporter: Any, tmp_path: Path
) -> None:
    """The URL's own host is fine; its answer, a redirect to the pod's loopback (or the metadata
    service), is the lease holder's too: each hop is checked as the first was."""
    rt = await start_runtime(None)
    with pod_local_service() as (port, seen):
        cfg = exporter_config(tmp_path / "exporter.yaml", {"socket": str(rt.socket)})
        exp = await asyncio.to_thread(standalone_exporter, cfg)
        for target in (f"http://127.0.0.1:{port}/latest/meta-data/iam/security-credentials/role",
                       f"http://localhost:{port}/computeMetadata/v1/token"):
            with redirecting_to(target) as url:
                result = await asyncio.to_thread(run_shell, exp.shell_args,
                                                 f"j vm storage flash {url}/disk.img", cwd=tmp_path)
            assert result.returncode != 0, result.stdout
            message = " ".join(result.stderr.split())
            assert "which a lease may not reach" in message and "redirect" in message, message[-2000:]
        assert seen == [], f"the exporter followed a redirect into the pod for the lease holder: {seen}"
        assert exp.proc.poll() is None


#: a lease holder's upload that says it is zstd: 512 MiB of zeros in ~16 KB. Upstream's client stream
#: decompresses each chunk it receives in one call, with no bound on what comes out
BOMB = """python - <<'EOF'
import anyio
from backports import zstd
from jumpstarter.utils.env import env

compressor = zstd.ZstdCompressor()
bomb = b"".join(compressor.compress(bytes(1 << 20)) for _ in range(512)) + compressor.flush()
print("bomb bytes", len(bomb))

async def upload(storage):
    send, receive = anyio.create_memory_object_stream(16)
    async with storage.resource_async(receive, content_encoding="zstd") as handle:
        async with send:
            await send.send(bomb)
        try:
            await storage.call_async("flash", handle, None)
        except Exception as e:
            print("flash refused:", e)

with env() as client:
    client.vm.storage.portal.call(upload, client.vm.storage)
EOF
"""


def _peak_rss_mib(pid: int) -> float:
    """The highest resident size (VmHWM) of ``pid`` and its descendants, in MiB."""
    peak = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        with contextlib.suppress(FileNotFoundError):
            peak = max(peak, memory_kib(current)["VmHWM"])
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(c) for c in (task / "children").read_text().split()]
    return peak / 1024


async def test_an_upload_that_says_it_is_compressed_is_not_inflated_by_the_exporter(
    start_runtime: Any, standalone_exporter: Any, tmp_path: Path
) -> None:
    """The exporter holds the pool's credentials: a 16 KB upload must not have it allocate 512 MiB
    (or, at a few hundred KB, be OOM-killed). The runtime decompresses under its image limits."""
    rt = await start_runtime(None)
    cfg = exporter_config(tmp_path / "exporter.yaml", {"socket": str(rt.socket)})
    exp = await asyncio.to_thread(standalone_exporter, cfg)
    before = _peak_rss_mib(exp.proc.pid)
    result = await asyncio.to_thread(run_shell, exp.shell_args, BOMB, cwd=tmp_path)
    assert "bomb bytes" in result.stdout, result.stderr[-3000:]
    peak = _peak_rss_mib(exp.proc.pid)
    print(f"\nthe exporter's peak resident size: {before:.0f} MiB before, {peak:.0f} MiB after the upload")
    assert exp.proc.poll() is None, exp.log_text()[-3000:]
    assert peak < before + 200, f"the exporter inflated the upload: peak {peak:.0f} MiB (was {before:.0f})"

    # an encoding the runtime does not read is refused, not inflated here either
    bz2_upload = BOMB.replace('content_encoding="zstd"', 'content_encoding="bz2"')
    result = await asyncio.to_thread(run_shell, exp.shell_args, bz2_upload, cwd=tmp_path)
    assert "flash refused:" in result.stdout and "'bz2' cannot be flashed" in result.stdout, result.stdout[-2000:]

    # the control: a real compressed disk sent the same way (`--compression zstd`) is flashed
    disk = tmp_path / "d.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(disk), "64M"], check=True)
    (tmp_path / "d.qcow2.zst").write_bytes(zstd.compress(disk.read_bytes()))
    result = await asyncio.to_thread(run_shell, exp.shell_args,
                                     "j vm storage flash --compression zstd d.qcow2.zst", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    digest = "sha256:" + hashlib.sha256(disk.read_bytes()).hexdigest()
    assert (await rt.client().state()).image_digest == digest


@pytest.mark.parametrize(("method", "handle", "message"), [
    ("flash", {"kind": "presigned_request", "method": "PUT", "url": "http://example.invalid/d",
               "headers": {}}, "flash takes a URL to GET"),
    ("dump", {"kind": "presigned_request", "method": "GET", "url": "http://example.invalid/d",
              "headers": {}}, "dump to a URL is not supported"),
    # what `j vm storage dump https://…` sends: upstream's PUT hung for its 7200 s timeout
    ("dump", {"kind": "presigned_request", "method": "PUT", "url": "http://example.invalid/d",
              "headers": {}}, "dump to a URL is not supported"),
    ("flash", {"kind": "presigned_request", "method": "GET", "url": "file:///etc/passwd", "headers": {}},
     "is not an http(s) URL"),
    ("flash", {"kind": "client_stream", "uuid": "00000000-0000-0000-0000-000000000000",
               "x_jmp_content_encoding": "gzip"}, "no stream 00000000-0000-0000-0000-000000000000 was opened"),
    ("dump", {"kind": "client_stream", "uuid": "00000000-0000-0000-0000-000000000000"}, "no stream"),
])
async def test_a_resource_the_call_cannot_use_is_refused_naming_why(
    start_runtime: Any, method: str, handle: dict, message: str
) -> None:
    """Handles a stock client never sends for the call (an upload PUT for a flash hung for hours in
    upstream's PUT path; a file: URL was an error naming only the URL), sent by a lease holder."""
    from jumpstarter.client.core import DriverInvalidArgument
    from jumpstarter.common.utils import serve

    from jumpstarter_driver_vmsidecar.driver import VirtualMachine

    rt = await start_runtime(None)

    def call() -> None:
        vm = VirtualMachine(socket=str(rt.socket))
        with serve(vm) as client, pytest.raises(DriverInvalidArgument) as refused:
            client.storage.call(method, handle, None)
        assert message in str(refused.value), refused.value

    await asyncio.wait_for(asyncio.to_thread(call), 60)


@pytest.mark.parametrize("what", ["manifest", "blob"])
def test_a_registry_that_redirects_into_the_pod_is_not_followed_there(
        what: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``flash oci://`` names the lease holder's registry; its answers are theirs too. A ``307`` to
    the pod's loopback had the runtime send a GET there (AWS's metadata service needs no header);
    a registry that is itself on the loopback (a laptop's, the tests') may still redirect there."""
    from test_attack_credentials import FakeRegistry

    from vmsidecar_contract.errors import RegistryError
    from vmsidecar_runtime.oci import pull

    disk = b"QFI\xfb" + bytes(508)
    digest = "sha256:" + hashlib.sha256(disk).hexdigest()
    empty = "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.empty.v1+json", "size": 2,
                                      "digest": empty},
                           "layers": [{"mediaType": "application/vnd.diskimage.qcow2", "digest": digest,
                                       "size": len(disk)}]}).encode()
    with pod_local_service() as (port, seen):
        def answer(h: http.server.BaseHTTPRequestHandler) -> None:
            path = h.path.split("?")[0]
            redirect = "/manifests/" in path if what == "manifest" else "/blobs/" in path
            if path == "/v2/" or not redirect:
                body = manifest if "/manifests/" in path else b"{}"
                h.send_response(200)
                h.send_header("Content-Type", "application/vnd.oci.image.manifest.v1+json")
                h.send_header("Docker-Content-Digest", "sha256:" + hashlib.sha256(body).hexdigest())
                h.send_header("Content-Length", str(len(body)))
                h.end_headers()
                h.wfile.write(body)
                return
            h.send_response(307)
            metadata = f"http://127.0.0.1:{port}/latest/meta-data/iam/security-credentials/role"
            h.send_header("Location", metadata)
            h.send_header("Content-Length", "0")
            h.end_headers()

        with FakeRegistry(answer, address=routable_address()) as registry:
            monkeypatch.setenv("VMSIDECAR_INSECURE_REGISTRIES", registry.host)
            with pytest.raises(RegistryError) as refused:
                pull(f"{registry.host}/x/y:1", tmp_path / "cache", arch="x86_64")
    assert seen == [], f"the runtime followed a registry's redirect into the pod: {seen}"
    assert "127.0.0.1" in refused.value.message and "redirect" in refused.value.message, refused.value.message


def test_a_registry_redirect_to_plain_http_goes_only_to_a_host_listed_insecure(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Plain HTTP is spoken only to registries the pool owner lists as insecure; a registry's
    redirect had taken the runtime to any plain-HTTP host:port it named. With that host's name
    resolving elsewhere at the connect than at the redirect's check (DNS rebinding), that was a GET
    into the pod; over HTTPS no request is sent before the certificate matches the name."""
    from test_attack_credentials import FakeRegistry

    from vmsidecar_contract.errors import RegistryError
    from vmsidecar_runtime.oci import pull

    address = routable_address()
    seen: list[str] = []

    def elsewhere_answer(h: http.server.BaseHTTPRequestHandler) -> None:
        seen.append(h.requestline)
        h.send_response(404)
        h.send_header("Content-Length", "0")
        h.end_headers()

    with FakeRegistry(elsewhere_answer, address=address) as elsewhere:
        def answer(h: http.server.BaseHTTPRequestHandler) -> None:
            h.send_response(307)
            h.send_header("Location", f"http://{elsewhere.host}/v2/x/y/manifests/1")
            h.send_header("Content-Length", "0")
            h.end_headers()

        with FakeRegistry(answer, address=address) as registry:
            monkeypatch.setenv("VMSIDECAR_INSECURE_REGISTRIES", registry.host)  # this port only
            with pytest.raises(RegistryError) as refused:
                pull(f"{registry.host}/x/y:1", tmp_path / "cache", arch="x86_64")
            assert seen == [], f"the runtime spoke plain HTTP to a host nobody listed: {seen}"
            assert f"plain HTTP to {elsewhere.host}" in refused.value.message, refused.value.message
            assert "--insecure-registry" in refused.value.message, refused.value.message
            # listed by the pool owner, the same redirect is followed
            monkeypatch.setenv("VMSIDECAR_INSECURE_REGISTRIES", f"{registry.host},{elsewhere.host}")
            with pytest.raises(RegistryError):
                pull(f"{registry.host}/x/y:1", tmp_path / "cache", arch="x86_64")
            assert seen, "the listed host was not asked"


@contextlib.contextmanager
def accepting_port() -> Iterator[tuple[int, list[bytes]]]:
    """A TCP listener on 127.0.0.1 (a pod-local service of any protocol): its port, and the first
    bytes of every connection made to it."""
    import socket

    got: list[bytes] = []
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    got.append(conn.recv(4096))
                except OSError:
                    got.append(b"")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], got
    finally:
        stop.set()
        thread.join(5)
        server.close()


async def test_a_lease_cannot_make_the_runtime_connect_to_a_pod_local_registry(start_runtime: Any) -> None:
    """``flash oci://127.0.0.1:<port>/x:y`` had the runtime connect to any port of the pod's
    loopback (its answers told open from closed ports, a scan; with loopback listed insecure, a GET
    in plain HTTP), and ``oci://169.254.169.254/…`` to the metadata service. A lease may name such
    a registry only when the pool owner named it (insecure, lent, or the spec's image's)."""
    from vmsidecar_contract.errors import RegistryError

    with accepting_port() as (port, got):
        rt = await start_runtime({"memory": "256M"}, env={"VMSIDECAR_INSECURE_REGISTRIES": ""})
        for ref in (f"oci://127.0.0.1:{port}/x/y:1", f"oci://localhost:{port}/x/y:1",
                    "oci://169.254.169.254/x/y:1"):
            with pytest.raises(RegistryError) as refused:
                await rt.client().flash_reference(ref)
            assert "this pod" in refused.value.message and "--lease-registry" in refused.value.message, \
                refused.value.message
        assert got == [], f"the runtime connected to the pod-local port: {got}"
        # named by the pool owner: the same flash reaches it (TLS: it is no registry)
        lent = await start_runtime({"memory": "256M"}, env={"VMSIDECAR_INSECURE_REGISTRIES": "",
                                              "VMSIDECAR_LEASE_REGISTRIES": f"127.0.0.1:{port}"}, name="lent")
        with pytest.raises(RegistryError):
            await lent.client().flash_reference(f"oci://127.0.0.1:{port}/x/y:1")
        assert got, "the registry the pool owner lent was not asked"
