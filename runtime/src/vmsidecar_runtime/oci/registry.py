"""Registry operations (manifests, tags, blobs), and registry answers mapped to vmsidecar errors.

The HTTP policy under them (auth, TLS, timeouts, bounded retries on top of oras-py) is
:mod:`.transport`. Here:

* manifests fetched and put as raw bytes, so the digest is computed over exactly what was served
  or pushed (oras-py parses/re-serializes and always sends the image-manifest media type);
* blob downloads as a chunk iterator (hashing and progress happen in :mod:`.unpack`);
* every other body read through one bound (:func:`.transport.read_body`): a manifest or an index
  up to :data:`MAX_MANIFEST`, a tag list :data:`MAX_TAGS`, an error answer's
  :data:`.transport.MAX_ERROR_BODY` (past it, no error codes: the message names the status).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urljoin, urlsplit

import requests

from vmsidecar_contract.errors import DigestMismatchError, ImageError, RegistryError
from vmsidecar_runtime.image.digest import sha256_digest

from .auth import HOW_TO_INSECURE, Credentials, RegistryConfig, current_config
from .mediatypes import ACCEPT, OCI_INDEX, load_document
from .reference import Reference
from .transport import MAX_ERROR_BODY, TRIES, OrasRegistry, Unreachable, origin, read_body

log = logging.getLogger(__name__)

MAX_MANIFEST = 4 << 20
#: the tag list read (for an error message's "tags there"): a page of 100 tags is ~14 KB (a tag is
#: at most 128 characters); a registry that ignores the page size may send ~8,000 within it; past
#: it, no tags are listed
MAX_TAGS = 1 << 20
#: pages of a paginated referrers listing read at most (each up to MAX_MANIFEST)
REFERRER_PAGES = 16
CHUNK = 1 << 20


@dataclass(frozen=True)
class RawManifest:
    """A manifest or index exactly as served."""

    data: bytes
    media_type: str
    digest: str

    def json(self) -> dict:
        """The parsed document.

        :raise ImageError: (code ``bad_manifest``) when it is not a JSON object.
        """
        try:
            doc = load_document(self.data)  # bounded nesting: never a RecursionError
        except ValueError as exc:
            raise ImageError(
                f"manifest {self.digest} is not valid JSON ({exc}); push the image again",
                code="bad_manifest",
            ) from exc
        if not isinstance(doc, dict):
            raise ImageError(
                f"manifest {self.digest} is not a JSON object; push the image again", code="bad_manifest"
            )
        return doc


class RegistryClient:
    """One registry repository, as named by a registry :class:`Reference`."""

    def __init__(
        self,
        ref: Reference,
        *,
        plain_http: bool | None = None,
        credentials: tuple[str, str] | None = None,
        config: RegistryConfig | None = None,
    ) -> None:
        """``plain_http`` ``None``: HTTP only for a registry the configuration lists as insecure.
        ``credentials``: for this registry (the reference's host) only; else the configuration's
        entry for it (:mod:`.auth`), if any.

        :raise HostError: the registry configuration is wrong (see :func:`.auth.load_config`).
        """
        assert ref.kind == "registry" and ref.registry and ref.repository
        config = config or current_config()
        self.ref = ref
        self.host = ref.registry
        self.plain_http = config.is_insecure(ref.registry) if plain_http is None else plain_http
        creds = Credentials(*credentials) if credentials else config.credentials_for(ref.registry, ref.repository)
        self._oras = OrasRegistry(ref.registry, plain_http=self.plain_http, credentials=creds, config=config)
        self.container = self._oras.get_container(f"{ref.registry}/{ref.repository}")
        self.scheme = "http" if self.plain_http else "https"

    def close(self) -> None:
        """Close the HTTP session (its pooled connections)."""
        self._oras.session.close()

    # -- requests -------------------------------------------------------------------------

    def _unreachable(self, exc: Exception) -> RegistryError:
        """The error for a registry that did not answer (code ``registry_unreachable``)."""
        return RegistryError(
            f"registry {self.host} is unreachable after {TRIES} tries ({_short(exc)}); "
            f"check that it runs and that {self.host} is the right host:port",
            code="registry_unreachable",
        )

    def _call(self, what: str, method: str, url: str, **kwargs: Any) -> requests.Response:
        """Send a request through :class:`.transport.OrasRegistry`.

        :raise RegistryError: unreachable, TLS failed, or the request failed on the way.
        """
        try:
            return self._oras.do_request(url, method, **kwargs)
        except Unreachable as exc:
            raise self._unreachable(exc) from None
        except requests.exceptions.SSLError as exc:
            raise RegistryError(
                f"TLS to registry {self.host} failed ({_short(exc)}); install its CA certificate, or, if it "
                f"serves plain HTTP on purpose, list it as insecure ({HOW_TO_INSECURE})",
                code="registry_tls",
            ) from None
        except requests.RequestException as exc:
            raise RegistryError(
                f"request to registry {self.host} failed while {what} ({_short(exc)}); retry, or check the "
                "registry's logs",
                code="registry_error",
            ) from None

    def _fail(self, response: requests.Response, what: str, subject: str,
              codes: list[str] | None = None) -> RegistryError:
        """The error for a refused request: unauthorized, unknown repository, or the status as served
        (``codes``: the answer's error codes when the caller read them already: a body is read once)."""
        codes = _error_codes(response) if codes is None else codes
        status = response.status_code
        if status in (401, 403):
            return RegistryError(
                f"registry {self.host} refused {what} {subject} ({status} {', '.join(codes) or response.reason}); "
                + self._oras.auth_hint(),
                code="registry_unauthorized",
            )
        if status == 404 and "NAME_UNKNOWN" in codes:
            return RegistryError(
                f"repository {self.ref.repository} not found on {self.host}; check the name or push the "
                "image there first",
                code="repository_not_found",
            )
        return RegistryError(
            f"registry {self.host} answered {status} {', '.join(codes) or response.reason} while {what} "
            f"{subject}; check the reference, or retry if the registry is overloaded",
            code="registry_error",
        )

    # -- manifests ------------------------------------------------------------------------

    def get_manifest(self, reference: str, *, expect_digest: str | None = None) -> RawManifest:
        """GET a manifest or index by tag or digest, as raw bytes.

        :raise RegistryError: unreachable, unauthorized, repository or tag not found.
        :raise DigestMismatchError: the bytes do not hash to the digest asked for.
        """
        url = f"{self.scheme}://{self.container.manifest_url(reference)}"
        subject = f"{self.ref.name}:{reference}" if ":" not in reference else f"{self.ref.name}@{reference}"
        response = self._call(
            "fetching manifest", "GET", url, headers={"Accept": ", ".join(ACCEPT)}, stream=True
        )
        with contextlib.closing(response):
            if response.status_code != 200:
                codes = _error_codes(response)
                if response.status_code == 404 and "MANIFEST_UNKNOWN" in codes:
                    raise self._manifest_unknown(reference)
                raise self._fail(response, "the manifest", subject, codes)
            data = _read_limited(response, MAX_MANIFEST, subject)
        digest = sha256_digest(data)
        wanted = expect_digest or (reference if reference.startswith("sha256:") else None)
        if wanted and digest != wanted:
            raise DigestMismatchError(
                f"manifest {subject} from {self.host} hashes to {digest}, not {wanted}; "
                "the registry served altered content, so push the image again"
            )
        media_type = response.headers.get("Content-Type", "").split(";")[0].strip()
        return RawManifest(data=data, media_type=media_type, digest=digest)

    def _manifest_unknown(self, reference: str) -> RegistryError:
        """The error for an unknown manifest: digest, tag (listing the tags there) or repository not found."""
        if reference.startswith("sha256:"):
            return RegistryError(
                f"manifest {reference} not found in {self.ref.name}; check the digest or pull by tag",
                code="manifest_not_found",
            )
        tags = self.tags()
        if tags is None:
            return RegistryError(
                f"repository {self.ref.repository} not found on {self.host}; check the name or push the "
                "image there first",
                code="repository_not_found",
            )
        known = f" (tags there: {', '.join(tags[:10])}{' …' if len(tags) > 10 else ''})" if tags else ""
        return RegistryError(
            f"tag {reference} not found in {self.ref.name}{known}; check the tag or push it first",
            code="tag_not_found",
        )

    def get_manifest_or_none(self, reference: str) -> RawManifest | None:
        """Like :meth:`get_manifest` but ``None`` for an unknown tag or repository."""
        try:
            return self.get_manifest(reference)
        except RegistryError as exc:
            if exc.code in ("tag_not_found", "repository_not_found", "manifest_not_found"):
                return None
            raise

    def put_manifest(self, reference: str, data: bytes, media_type: str) -> str:
        """PUT a manifest or index under a tag or its digest; returns its digest.

        :raise RegistryError: when the registry refuses it.
        """
        self.put_manifest_response(reference, data, media_type)
        return sha256_digest(data)

    def put_manifest_response(self, reference: str, data: bytes, media_type: str) -> requests.Response:
        """:meth:`put_manifest`, returning the registry's answer (its ``OCI-Subject`` header says
        whether it indexed the manifest's ``subject`` itself).

        :raise RegistryError: when the registry refuses it.
        """
        url = f"{self.scheme}://{self.container.manifest_url(reference)}"
        response = self._call("pushing manifest", "PUT", url, data=data, headers={"Content-Type": media_type})
        response.close()
        if response.status_code not in (200, 201, 202):
            raise self._fail(response, "pushing the manifest", f"{self.ref.name}:{reference}")
        return response

    def referrers(self, digest: str, artifact_type: str, limit: int) -> list | None:
        """The descriptors of ``artifact_type`` in the OCI 1.1 referrers index of ``digest`` (asked
        filtered, which a registry may ignore), up to ``limit`` of them over at most
        ``REFERRER_PAGES`` pages (``Link: <…>; rel="next"``; a page on another host is not asked
        for: nothing of this registry's goes there); None when the registry has no referrers API (a
        404: the caller reads the referrers tag schema instead).

        :raise RegistryError: unreachable, unauthorized, or an answer that is not an index.
        """
        base = f"{self.scheme}://{self.host}"
        url = f"{base}/v2/{self.ref.repository}/referrers/{digest}?{urlencode({'artifactType': artifact_type})}"
        subject = f"{self.ref.name} referrers of {digest}"
        found: list = []
        for page in range(REFERRER_PAGES):
            response = self._call("listing referrers", "GET", url, headers={"Accept": OCI_INDEX}, stream=True)
            with contextlib.closing(response):
                if response.status_code == 404 and page == 0:
                    return None
                if response.status_code != 200:
                    raise self._fail(response, "the referrers", subject)
                data = _read_limited(response, MAX_MANIFEST, subject)
                link = response.links.get("next", {}).get("url")
            entries = RawManifest(data, OCI_INDEX, sha256_digest(data)).json().get("manifests")
            found += [e for e in (entries if isinstance(entries, list) else [])  # whether it filtered or not
                      if isinstance(e, dict) and e.get("artifactType") == artifact_type]
            if not link or len(found) >= limit:
                break
            url = urljoin(url, link)
            if origin(url) != origin(base):
                log.warning("the referrers of %s on %s link a next page on another host (%s): not followed",
                            digest, self.host, urlsplit(url).netloc)
                break
        return found[:limit]

    def tags(self) -> list[str] | None:
        """The repository's tags (first page, up to :data:`MAX_TAGS` of it); ``None`` when the
        repository does not exist.

        A registry that cannot list tags (or lists them past the bound, or not as strings) gives ``[]``.
        """
        url = f"{self.scheme}://{self.container.tags_url(100)}"
        try:
            response = self._call("listing tags", "GET", url, stream=True)
            with contextlib.closing(response):
                if response.status_code != 200:
                    return None if response.status_code == 404 and "NAME_UNKNOWN" in _error_codes(response) else []
                body = read_body(response, MAX_TAGS)
            doc = load_document(body) if body is not None else None
        except (RegistryError, ValueError, requests.RequestException):
            return []
        tags = doc.get("tags") if isinstance(doc, dict) else None
        return [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else []

    # -- blobs ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def open_blob(self, descriptor: dict) -> Iterator[Iterator[bytes]]:
        """Stream a blob as chunks (unverified: :class:`.unpack.BlobReader` checks it).

        :raise RegistryError: when the blob cannot be fetched or the connection breaks.
        """
        digest = descriptor["digest"]
        url = f"{self.scheme}://{self.container.get_blob_url(digest)}"
        response = self._call("fetching blob", "GET", url, stream=True)
        with contextlib.closing(response):
            if response.status_code != 200:
                if response.status_code == 404:
                    raise RegistryError(
                        f"blob {digest} named by {self.ref} is missing from {self.host}; push the image again",
                        code="blob_not_found",
                    )
                raise self._fail(response, "the blob", digest)
            yield self._chunks(response, digest)

    def _chunks(self, response: requests.Response, digest: str) -> Iterator[bytes]:
        """The body in chunks.

        :raise RegistryError: when the connection breaks.
        """
        announced = response.headers.get("Content-Length", "")
        count = 0
        try:
            for chunk in response.iter_content(chunk_size=CHUNK):
                count += len(chunk)
                yield chunk
        except requests.RequestException as exc:
            raise RegistryError(
                f"the connection to {self.host} broke while downloading {digest} ({_short(exc)}); "
                "retry the pull",
                code="registry_error",
            ) from None
        # a server that dies mid-body just closes the connection: urllib3 may end the body
        # quietly, and a short blob would then read as altered content rather than a broken download
        if announced.isdigit() and count < int(announced):
            raise RegistryError(
                f"the connection to {self.host} ended after {count} of {announced} bytes of {digest} "
                "(the registry went away mid-download); retry the pull",
                code="registry_error",
            )

    def push_blob_file(self, path: Path, digest: str, size: int, media_type: str) -> None:
        """Upload a file as a blob unless the registry has it (oras-py: HEAD, then chunked upload).

        :raise RegistryError: when the registry refuses it.
        """
        layer = {"mediaType": media_type, "digest": digest, "size": size}
        try:
            response = self._oras.upload_blob(str(path), self.container, layer, do_chunked=True)
        except Unreachable as exc:
            raise self._unreachable(exc) from None
        except ValueError as exc:  # oras-py: "Issue retrieving session url"
            raise RegistryError(
                f"registry {self.host} refused the upload of {digest} ({_short(exc)}); check push "
                "permissions for the repository",
                code="registry_error",
            ) from None
        if response.status_code not in (200, 201, 202):
            raise self._fail(response, "the upload of blob", digest)

    def push_blob_bytes(self, data: bytes, media_type: str, workdir: Path) -> None:
        """Upload a small in-memory blob (configs).

        :raise RegistryError: when the registry refuses it.
        """
        path = workdir / f"blob-{sha256_digest(data)[7:19]}"
        path.write_bytes(data)
        self.push_blob_file(path, sha256_digest(data), len(data), media_type)


def _read_limited(response: requests.Response, limit: int, subject: str) -> bytes:
    """The whole body of a manifest response.

    :raise ImageError: (code ``bad_manifest``) past ``limit`` bytes.
    """
    body = read_body(response, limit)
    if body is None:
        raise ImageError(
            f"manifest {subject} is larger than {limit >> 20} MiB, which no disk image needs; "
            "check the reference",
            code="bad_manifest",
        )
    return body


def _error_codes(response: requests.Response) -> list[str]:
    """The OCI error codes (``MANIFEST_UNKNOWN`` …) in an error response's JSON body, read up to
    :data:`.transport.MAX_ERROR_BODY`: a longer body, or one that breaks off, has none. Read once:
    a second call on a streamed answer finds none."""
    try:
        body = read_body(response, MAX_ERROR_BODY)
        doc = load_document(body) if body is not None else None
    except (ValueError, requests.RequestException):
        return []
    errors = doc.get("errors") if isinstance(doc, dict) else None
    return [str(e.get("code")) for e in errors if isinstance(e, dict) and e.get("code")] if isinstance(
        errors, list) else []


def _short(exc: BaseException) -> str:
    """A requests exception as a short phrase for a one-line message."""
    text = str(exc)
    # requests' messages repeat the pool and object reprs; keep the useful tail
    for marker in ("Caused by ", "Failed to establish a new connection: "):
        if marker in text:
            text = text.split(marker)[-1]
    text = text.replace("<urllib3.connection.HTTPConnection object at", "<").strip("()'\" ")
    if "] " in text and text.startswith("[Errno"):
        text = text.split("] ", 1)[1]
    return text[:160].rstrip(".')\"")


class RegistrySource:
    """A registry reference as a :class:`.resolve.Source`."""

    def __init__(self, client: RegistryClient) -> None:
        self.client = client
        self.where = str(client.ref)

    def top(self) -> RawManifest:
        """The manifest or index named by the reference's digest or tag.

        :raise RegistryError: see :meth:`RegistryClient.get_manifest`.
        """
        return self.client.get_manifest(self.client.ref.manifest_ref)

    def manifest(self, descriptor: dict) -> RawManifest:
        """A child manifest, checked against the descriptor's digest and size.

        :raise DigestMismatchError: the registry served other bytes.
        """
        raw = self.client.get_manifest(str(descriptor["digest"]), expect_digest=str(descriptor["digest"]))
        size = descriptor.get("size")
        if isinstance(size, int) and size != len(raw.data):
            raise DigestMismatchError(
                f"manifest {raw.digest} of {self.where} is {len(raw.data)} bytes but its descriptor says {size}; "
                "push the image again"
            )
        return raw

    def open_blob(self, descriptor: dict) -> contextlib.AbstractContextManager[Iterator[bytes]]:
        """See :meth:`RegistryClient.open_blob`."""
        return self.client.open_blob(descriptor)

    def close(self) -> None:
        """Close the HTTP session."""
        self.client.close()
