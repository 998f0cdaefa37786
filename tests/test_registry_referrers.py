"""Snapshot discovery through the OCI 1.1 referrers API (issue 23, item 2), paginated.

The registries a pool may use (zot, Harbor, ACR, Quay …) answer ``GET /v2/<repo>/referrers/<digest>``
and may split the answer into pages linked by ``Link: <…>; rel="next"``. None of them installs
on this machine (Debian's distribution 2.8 has no referrers API; no other registry server is in
Debian's archive, PyPI or npm), so a **stand-in** serves that one endpoint here, answered from the
referrers tag schema's index of a real distribution 2.8 registry, one entry per page; every other
request is passed to that registry as is. Everything else is real: the artifact pushed by the real
``vmsidecar-oci snapshot push`` code, the runtime's own fetch, its digests and seal checks.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
from test_attack_registry_snapshots import Published, _fetch, _publish

from fixtures.registry import RunningRegistry
from vmsidecar_runtime.image.digest import sha256_digest
from vmsidecar_runtime.oci.mediatypes import (
    EMPTY_DIGEST,
    EMPTY_JSON,
    OCI_EMPTY,
    OCI_INDEX,
    OCI_MANIFEST,
    SNAPSHOT_ARTIFACT_TYPE,
)
from vmsidecar_runtime.oci.reference import parse_reference
from vmsidecar_runtime.oci.registry import RegistryClient
from vmsidecar_runtime.oci.snapshot_artifact import referrers_tag

pytestmark = pytest.mark.timeout(240)

DECOY_TYPE = "application/vnd.example.sbom.v1+json"


@dataclass
class Referrers:
    """How the stand-in answers the referrers endpoint."""

    #: the entries it lists, in order (None: those of the tag schema's index)
    entries: list[dict] | None = None
    #: whether it filters by ``artifactType`` (and says so in ``OCI-Filters-Applied``)
    filters: bool = True
    #: the origin its ``Link`` to the second page points at (None: its own)
    next_origin: str | None = None
    #: the paths it was asked for
    seen: list[str] = field(default_factory=list)


@dataclass
class StandIn:
    host: str
    referrers: Referrers


@pytest.fixture
def stand_in(published: Published) -> Iterator[StandIn]:
    """The stand-in on a port of its own, in front of ``published``'s registry."""
    upstream = published.registry.url.rstrip("/")
    referrers = Referrers()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            referrers.seen.append(self.path)
            parts = url.path.split("/")
            if len(parts) >= 5 and parts[-2] == "referrers":
                self._referrers("/".join(parts[2:-2]), parts[-1], urllib.parse.parse_qs(url.query))
            else:
                self._pass()

        do_HEAD = do_GET

        def _pass(self) -> None:
            headers = {k: v for k, v in self.headers.items() if k.lower() in ("accept", "range", "authorization")}
            answer = requests.request(self.command, upstream + self.path, headers=headers, timeout=30)
            self.send_response(answer.status_code)
            for name in ("Content-Type", "Docker-Content-Digest", "WWW-Authenticate"):
                if name in answer.headers:
                    self.send_header(name, answer.headers[name])
            self.send_header("Content-Length", str(len(answer.content)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(answer.content)

        def _referrers(self, repo: str, digest: str, query: dict[str, list[str]]) -> None:
            entries = referrers.entries
            if entries is None:
                index = requests.get(f"{upstream}/v2/{repo}/manifests/{referrers_tag(digest)}",
                                     headers={"Accept": OCI_INDEX}, timeout=30)
                entries = index.json()["manifests"] if index.status_code == 200 else []
            wanted = query.get("artifactType", [None])[0]
            if referrers.filters and wanted:
                entries = [e for e in entries if e.get("artifactType") == wanted]
            page = int(query.get("page", ["0"])[0])
            body = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX,
                               "manifests": entries[page:page + 1]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", OCI_INDEX)
            self.send_header("Content-Length", str(len(body)))
            if referrers.filters and wanted:
                self.send_header("OCI-Filters-Applied", "artifactType")
            if page + 1 < len(entries):
                rest = urllib.parse.urlencode({**({"artifactType": wanted} if wanted else {}), "page": page + 1})
                target = f"/v2/{repo}/referrers/{digest}?{rest}"
                if referrers.next_origin is not None:
                    target = referrers.next_origin + target
                self.send_header("Link", f'<{target}>; rel="next"')
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield StandIn(f"127.0.0.1:{server.server_address[1]}", referrers)
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def published(registry: RunningRegistry, oci_qcow2: Path, tmp_path_factory: pytest.TempPathFactory) -> Published:
    """A snapshot artifact behind three decoys of another artifact type in the subject's index."""
    pub = _publish(registry, "discovery/good", oci_qcow2, tmp_path_factory.mktemp("discovery"))
    client = RegistryClient(parse_reference(pub.source))
    try:
        tag = referrers_tag(pub.subject)
        index = client.get_manifest(tag).json()
        empty = {"mediaType": OCI_EMPTY, "digest": EMPTY_DIGEST, "size": len(EMPTY_JSON)}  # pushed with the snapshot
        decoys = []
        for i in range(3):  # real manifests: the registry refuses an index naming unknown ones
            doc = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": DECOY_TYPE,
                              "config": empty, "layers": [empty], "annotations": {"decoy": str(i)}}).encode()
            digest = client.put_manifest(sha256_digest(doc), doc, OCI_MANIFEST)
            decoys.append({"mediaType": OCI_MANIFEST, "digest": digest, "size": len(doc), "artifactType": DECOY_TYPE})
        index["manifests"] = decoys + index["manifests"]
        client.put_manifest(tag, json.dumps(index).encode(), OCI_INDEX)
    finally:
        client.close()
    return pub


def _through(stand_in: StandIn, pub: Published) -> str:
    return f"{stand_in.host}/{pub.repo}"


def test_a_snapshot_on_a_later_page_of_the_referrers_is_found(published: Published, stand_in: StandIn,
                                                               tmp_path: Path) -> None:
    # no filtering: four pages, ours the last
    stand_in.referrers.filters = False
    snap = _fetch(published, tmp_path / "cache", source=_through(stand_in, published))
    assert snap.memory.read_bytes() == published.memory
    pages = [p for p in stand_in.referrers.seen if "/referrers/" in p]
    assert len(pages) == 4 and f"artifactType={urllib.parse.quote(SNAPSHOT_ARTIFACT_TYPE, safe='')}" in pages[0], pages
    # read by digest after the discovery, never by tag
    assert any(f"/manifests/{published.artifact}" in p for p in stand_in.referrers.seen)
    assert not any(f"/manifests/{referrers_tag(published.subject)}" in p for p in stand_in.referrers.seen)


def test_a_next_page_on_another_host_is_not_followed(published: Published, stand_in: StandIn,
                                                     tmp_path: Path) -> None:
    """The listing is the registry's word, not the pool owner's: a page on another host is never
    asked for (nothing, not even the registry's credentials, goes there); what the registry itself
    lists (its tag schema here) is still read."""
    hits: list[str] = []

    class Elsewhere(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(500)
            self.end_headers()

    other = ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        stand_in.referrers.filters = False
        stand_in.referrers.next_origin = f"http://127.0.0.1:{other.server_address[1]}"
        snap = _fetch(published, tmp_path / "cache", source=_through(stand_in, published))
    finally:
        other.shutdown()
        other.server_close()
    assert hits == [], "a page link to another host was followed"
    assert len([p for p in stand_in.referrers.seen if "/referrers/" in p]) == 1
    assert snap.memory.read_bytes() == published.memory


def test_a_referrers_api_that_lists_none_of_ours_falls_back_to_the_tag_schema(
    published: Published, stand_in: StandIn, tmp_path: Path
) -> None:
    # a registry upgraded after the push, say: its API knows nothing of what the tag schema lists
    stand_in.referrers.entries = []
    snap = _fetch(published, tmp_path / "cache", source=_through(stand_in, published))
    assert snap.memory.read_bytes() == published.memory
    assert any(f"/manifests/{referrers_tag(published.subject)}" in p for p in stand_in.referrers.seen)
