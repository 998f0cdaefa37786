"""A hostile registry's answers with a body without end (audit F3): a registry a lease names
(``j vm storage flash oci://evil/x:y``) answers 404, 401, 500 or a redirect, or its token service a
200, with a body of many GB or chunked for ever. The runtime had read each whole into memory
(``response.content``, then a parse: 256 MiB of body took the pull from 39 to 817 MiB; an endless
one until the OOM killer), in a worker thread the pull timeout does not stop.

Each test runs the real pull (or registry client) against a real HTTP server on loopback that
counts the bytes it managed to hand to the kernel, and asserts that the call ends promptly with the
error the status calls for, that the bytes sent stay far below the body (the kernel's socket
buffers take some: up to tens of MiB on loopback), and that the Python heap stayed small.
"""

from __future__ import annotations

import contextlib
import http.server
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.http_server import LoopbackServer
from vmsidecar_contract.errors import RegistryError
from vmsidecar_runtime.oci.pull import pull
from vmsidecar_runtime.oci.reference import parse_reference
from vmsidecar_runtime.oci.registry import RegistryClient

pytestmark = pytest.mark.timeout(120)

#: what a flood sends at most (a body "without end" stops here, so that a runtime that reads it all
#: fails the test instead of hanging it)
FLOOD = 256 << 20
BLOCK = b" " * (64 << 10)
#: what the socket buffers of loopback may hold on top of what the client read (tcp_rmem's 32 MiB max)
SENT_BOUND = 64 << 20
#: the Python heap's peak during the call (the bodies are read up to 1 MiB at most)
HEAP_BOUND = 16 << 20
NAME_UNKNOWN = b'{"errors":[{"code":"NAME_UNKNOWN","message":"repository name not known"}]}'
MANIFEST_UNKNOWN = b'{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}'
#: ``(status, headers, body)``: ``body`` bytes, or ``None`` for a flood (``Content-Length`` of
#: :data:`FLOOD` in the headers, else chunked)
Answer = tuple[int, dict[str, str], bytes | None]


class Flood(LoopbackServer):
    """A registry on 127.0.0.1 (HTTP/1.1) answering by path, counting the body bytes it sent."""

    def __init__(self) -> None:
        self.answers: dict[str, Answer] = {"/v2/": (200, {}, b"{}")}
        self.sent = 0
        self.paths: list[str] = []
        flood = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                flood.paths.append(f"{self.command} {path}")
                status, headers, body = flood.answers.get(path, (404, {}, NAME_UNKNOWN))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                for name, value in headers.items():
                    self.send_header(name, value)
                if body is not None:
                    self.send_header("Content-Length", str(len(body)))
                elif "Content-Length" not in headers:
                    self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if self.command == "HEAD":
                    return
                if body is not None:
                    self.wfile.write(body)
                    return
                self.close_connection = True
                chunked = "Content-Length" not in headers
                frame = b"%x\r\n%s\r\n" % (len(BLOCK), BLOCK) if chunked else BLOCK
                try:
                    for _ in range(FLOOD // len(BLOCK)):
                        self.wfile.write(frame)
                        flood.sent += len(BLOCK)
                    if chunked:
                        self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    pass  # the client closed the connection: what it did not read stays unsent

            do_HEAD = do_PUT = do_GET

        super().__init__(Handler)


@pytest.fixture
def flood() -> Iterator[Flood]:
    with Flood() as server:
        yield server


@contextlib.contextmanager
def bounded(flood: Flood, seconds: float = 15.0) -> Iterator[None]:
    """Assert that the block ends within ``seconds``, with the bytes sent and the heap's peak bounded."""
    tracemalloc.start()
    start = time.monotonic()
    try:
        yield
    finally:
        elapsed = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert elapsed < seconds, f"the call took {elapsed:.1f} s"
    assert flood.sent < SENT_BOUND, f"the runtime read {flood.sent >> 20} MiB of a body it has no use for"
    assert peak < HEAP_BOUND, f"the heap peaked at {peak >> 20} MiB"


MANIFEST = "/v2/evil/img/manifests/1"
LONG = {"Content-Length": str(FLOOD)}


def _case(case: str, flood: Flood) -> tuple[str, str]:
    """Put the answers of ``case``; returns the error code and a phrase the message must hold."""
    host = flood.host
    if case == "manifest-404-long":
        flood.answers[MANIFEST] = (404, LONG, None)
        return "registry_error", "answered 404"
    if case == "manifest-500-endless":
        flood.answers[MANIFEST] = (500, {}, None)
        return "registry_error", "answered 500"
    if case == "manifest-401-endless":
        flood.answers[MANIFEST] = (401, {"WWW-Authenticate": 'Basic realm="r"'}, None)
        return "registry_unauthorized", "401"
    if case == "token-200-endless":
        challenge = f'Bearer realm="http://{host}/token",service="s",scope="repository:evil/img:pull"'
        flood.answers[MANIFEST] = (401, {"WWW-Authenticate": challenge}, b"")
        flood.answers["/token"] = (200, {}, None)
        return "registry_unauthorized", "more than 1 MiB"
    if case == "token-200-long":
        challenge = f'Bearer realm="http://{host}/token",service="s"'
        flood.answers[MANIFEST] = (401, {"WWW-Authenticate": challenge}, b"")
        flood.answers["/token"] = (200, LONG, None)
        return "registry_unauthorized", "more than 1 MiB"
    if case == "redirect-endless":
        flood.answers[MANIFEST] = (307, {"Location": "/v2/evil/img/manifests/2"}, None)
        return "repository_not_found", "evil/img not found"
    if case == "tags-200-endless":
        flood.answers[MANIFEST] = (404, {}, MANIFEST_UNKNOWN)
        flood.answers["/v2/evil/img/tags/list"] = (200, {}, None)
        return "tag_not_found", "tag 1 not found"
    if case == "tags-404-long":
        flood.answers[MANIFEST] = (404, {}, MANIFEST_UNKNOWN)
        flood.answers["/v2/evil/img/tags/list"] = (404, LONG, None)
        return "tag_not_found", "tag 1 not found"
    raise AssertionError(case)


CASES = ["manifest-404-long", "manifest-500-endless", "manifest-401-endless", "token-200-endless",
         "token-200-long", "redirect-endless", "tags-200-endless", "tags-404-long"]


@pytest.mark.parametrize("case", CASES)
def test_an_endless_answer_is_read_no_further_than_its_bound(case: str, flood: Flood, tmp_path: Path) -> None:
    """A pull from a registry that answers with a body without end ends promptly with the error its
    status calls for (an error body past 64 KiB has no error codes; a token answer past 1 MiB is
    refused, saying so), having read only the start of it."""
    code, phrase = _case(case, flood)
    with bounded(flood), pytest.raises(RegistryError) as info:
        pull(f"{flood.host}/evil/img:1", tmp_path / "cache", arch="x86_64", plain_http=True)
    assert info.value.code == code, info.value.message
    assert phrase in info.value.message, info.value.message
    assert any(p.startswith("GET /token") for p in flood.paths) or not case.startswith("token"), flood.paths


def test_an_endless_answer_to_a_put_is_read_no_further_than_its_bound(flood: Flood) -> None:
    """A push's manifest PUT (a request requests reads the answer of whole) answered 500 without
    end: the push's error names the status, the body read only to its bound."""
    flood.answers["/v2/evil/img/manifests/1"] = (500, {}, None)
    client = RegistryClient(parse_reference(f"{flood.host}/evil/img:1"), plain_http=True)
    with bounded(flood), pytest.raises(RegistryError) as info:
        client.put_manifest("1", b"{}", "application/vnd.oci.image.manifest.v1+json")
    client.close()
    assert info.value.code == "registry_error" and "answered 500" in info.value.message, info.value.message


def test_error_codes_in_a_bounded_body_still_count(flood: Flood, tmp_path: Path) -> None:
    """The bound does not cost real registries their error codes: a ``NAME_UNKNOWN`` in an error
    body of a few KB (padded as some proxies do) still names the missing repository."""
    flood.answers[MANIFEST] = (404, {}, NAME_UNKNOWN + b" " * (16 << 10))
    with pytest.raises(RegistryError) as info:
        pull(f"{flood.host}/evil/img:1", tmp_path / "cache", arch="x86_64", plain_http=True)
    assert info.value.code == "repository_not_found", info.value.message


def test_a_real_tag_list_is_read(flood: Flood) -> None:
    """A tag list of the size real registries send (a page of 100 tags) is read whole."""
    tags = [f"v{i}-" + "x" * 100 for i in range(100)]
    body = ('{"name":"evil/img","tags":[' + ",".join(f'"{t}"' for t in tags) + "]}").encode()
    flood.answers["/v2/evil/img/tags/list"] = (200, {}, body)
    client = RegistryClient(parse_reference(f"{flood.host}/evil/img:1"), plain_http=True)
    try:
        assert client.tags() == tags
    finally:
        client.close()
