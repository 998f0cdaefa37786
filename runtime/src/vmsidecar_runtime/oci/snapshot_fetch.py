"""A runtime's cache miss, served from the spec's ``snapshot_source``: find, check, fetch, stage.

Only the repository the spec names is asked, never a reference a lease holder gave (a flashed or
pulled disk has no snapshot at all: ``SnapshotOps``). The order of trust:

1. discovery: the referrers of the image's manifest (the referrers API, else the referrers tag
   schema), filtered by ``artifactType`` and by every identity annotation equal to this runtime's
   (the listing is a hint: the manifest's own annotations decide);
2. the artifact's manifest fetched by the digest found, and checked again (type, subject, key);
3. each layer fetched by digest, its bytes hashed against it, decompressed under the same caps as
   an image pull (:mod:`..image.limits`, :mod:`..image.decompress`), into a staged entry;
4. the files checked against the seal in the entry's ``meta.json``, the frozen overlay's backing
   file pointed at this cache's copy of the image, and the entry committed (sealed again); the
   restore then verifies it like any other entry.

Every refusal is a :class:`SourceRefused` with a code from a fixed set (``SnapshotInfo``'s
``source_refusal``) and a message naming the cause; the guest then boots cold.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from vmsidecar_contract.errors import (
    DigestMismatchError,
    HostError,
    ImageError,
    RegistryError,
    VmsidecarError,
)

from ..console import SCROLLBACK
from ..disk import DiskImage
from ..image.checks import check_virtual_size, read_qcow2_header, run_qemu_img
from ..image.decompress import open_decompressed
from ..image.limits import DEFAULT_LIMITS, Limits, Origin, human_size
from ..image.sniff import Compression
from ..snapshot_identity import IMAGE_FIELDS, SnapshotIdentity
from ..snapshots import CONSOLE_SUFFIX, Snapshot, SnapshotMeta, SnapshotStore, seal_digest, seal_hash
from ..threads import Abort, in_daemon_thread
from .cache import remove_tree, stat_seal
from .mediatypes import (
    ANNOTATION_TITLE,
    MALFORMED,
    SNAPSHOT_ARTIFACT_TYPE,
    SNAPSHOT_FILE,
    SNAPSHOT_FILE_ZSTD,
    check_title,
    load_document,
    malformed_answer,
)
from .reference import parse_reference
from .registry import RegistryClient
from .snapshot_artifact import (
    MAX_CANDIDATES,
    MAX_FILES,
    MAX_MANIFESTS_READ,
    META_FILE,
    is_digest,
    referrers_tag,
)
from .unpack import BlobReader

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: bound on fetching a snapshot from a spec's snapshot_source (a cold boot is the fallback)
FETCH_TIMEOUT_S = 120.0

CHUNK = 1 << 20
#: a chunk of the unwritten RAM a templated snapshot's file has holes for
_ZEROS = bytes(CHUNK)
#: a snapshot's meta.json is a few hundred bytes (the seal of a handful of files)
MAX_META = 64 << 10
RESEND = "push the snapshot again (vmsidecar-oci snapshot push)"
PUBLISH = "publish one captured by this runtime's setup (same image, QEMU, machine, CPU model, accelerator, spec)"


class SourceRefused(Exception):
    """No snapshot of the source is used: ``code`` (``SnapshotInfo.source_refusal``) and why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


async def fetch_in_thread(source: str, identity: SnapshotIdentity, base: DiskImage, store: SnapshotStore, *,
                          timeout: float = FETCH_TIMEOUT_S) -> Snapshot:
    """:func:`fetch_snapshot` in a worker thread, within ``timeout`` seconds, logged either way.

    :raise SourceRefused: nothing usable there; the message says why.
    """
    snap, seconds = await _in_thread(source, timeout, fetch_snapshot, identity, base, store)
    log.info("snapshot %s fetched from %s in %.2f s (%d MB)", identity.key, source, seconds, snap.size >> 20)
    return snap


async def stage_in_thread(source: str, subject: str, known: SnapshotIdentity, store: SnapshotStore, *,
                          timeout: float = FETCH_TIMEOUT_S) -> Staged:
    """:func:`stage_before_pull` in a worker thread, within ``timeout`` seconds, logged either way.

    :raise SourceRefused: nothing usable there; the message says why.
    """
    staged, seconds = await _in_thread(source, timeout, stage_before_pull, subject, known, store,
                                       late=lambda late: store.discard_now(late.snap))
    log.info("%s fetched while the image was pulled, in %.2f s", staged.where, seconds)
    return staged


#: what the boot waits past the fetch's own deadline before it gives up on the fetching thread (the
#: thread looks at the deadline between chunks; a registry that trickles holds it inside one read)
GIVE_UP_AFTER_S = 5.0


async def _in_thread(source: str, timeout: float, fetch: Callable[..., _T], *args: Any,
                     late: Callable[[_T], None] | None = None) -> tuple[_T, float]:
    """``fetch(source, *args, deadline=…)`` in a thread of its own and the seconds it took; a refusal is
    logged. The caller waits no longer than the deadline (and :data:`GIVE_UP_AFTER_S`), whatever the
    thread is blocked in: a daemon thread (:mod:`..threads`), so one a registry keeps in a read holds
    neither a worker of the loop's executor nor the runtime's exit; given up, its connections are shut
    down, which ends it; what it returns once given up goes to ``late``."""
    started = time.monotonic()
    abort = Abort()
    done = in_daemon_thread(functools.partial(fetch, source, *args, deadline=started + timeout),
                            name="snapshot-fetch", abort=abort)
    try:
        result = await asyncio.wait_for(asyncio.shield(done), timeout + GIVE_UP_AFTER_S)
    except SourceRefused as e:
        log.warning("no snapshot from %s (%s): %s; booting cold", source, e.code, e.message)
        raise
    except (TimeoutError, asyncio.CancelledError) as e:
        abort.set()
        # what the thread ends with is read either way (an unread exception is a traceback in the log)
        done.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or late is None
                               or late(f.result()))
        if isinstance(e, asyncio.CancelledError):
            raise
        message = (f"{source} did not answer within the fetch's bound ({timeout:g} s); the registry is slow or "
                   "stalls: the next boot tries again")
        log.warning("no snapshot from %s (timeout): %s; booting cold", source, message)
        raise SourceRefused("timeout", message) from None
    return result, time.monotonic() - started


def fetch_snapshot(source: str, identity: SnapshotIdentity, base: DiskImage, store: SnapshotStore, *,
                   deadline: float, limits: Limits = DEFAULT_LIMITS) -> Snapshot:
    """The snapshot of ``identity`` from the repository ``source``, committed to ``store``.

    Blocking: run it in a thread. ``deadline`` (``time.monotonic()``) bounds the whole fetch.

    :raise SourceRefused: nothing usable there; the message says why.
    """
    if base.manifest_digest is None:
        raise SourceRefused("not_registry_image", f"the image {base.source} is a file or a flashed disk, with no OCI "
                            "manifest for a snapshot artifact to refer to; use an image from a registry")
    with _registry(source) as client:
        digest, artifact = _find(client, base.manifest_digest, identity)
        staged = _stage(client, digest, artifact, store, deadline, limits)
    return complete(staged, identity, base, store, limits)


def stage_before_pull(source: str, subject: str, known: SnapshotIdentity, store: SnapshotStore, *,
                      deadline: float, limits: Limits = DEFAULT_LIMITS) -> Staged:
    """While the image ``subject`` (its manifest's digest) is being pulled: the artifact of
    ``source`` for it whose annotations match ``known`` in every field but ``IMAGE_FIELDS``,
    fetched and checked against its own seal into a staging directory of ``store``. The rest
    (image digest, readiness, key, subject) is checked by :func:`complete` once the disk is there.

    Blocking: run it in a thread. :raise SourceRefused: nothing usable there; the message says why.
    """
    with _registry(source) as client:
        digest, artifact = _find(client, subject, known, ignore=IMAGE_FIELDS)
        return _stage(client, digest, artifact, store, deadline, limits)


@contextlib.contextmanager
def _registry(source: str) -> Iterator[RegistryClient]:
    """A client of ``source``; every failure on the way is a :class:`SourceRefused`."""
    try:
        client = RegistryClient(parse_reference(source))
    except VmsidecarError as e:  # the registry configuration (auth file, insecure list) is wrong
        raise SourceRefused("host_error", e.message) from None
    try:
        with _refusals():
            yield client
    finally:
        client.close()


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """Registry and cache failures as :class:`SourceRefused`; so is an answer that raised anything
    else than this project's errors (:data:`MALFORMED`): the pod boots cold."""
    try:
        yield
    except RegistryError as e:
        raise _refusal_of(e) from None
    except MALFORMED as e:
        raise SourceRefused("bad_artifact", malformed_answer("the snapshot source", e).message) from None
    except VmsidecarError as e:  # the cache cannot be written (HostError)
        raise SourceRefused("host_error", e.message) from None
    except OSError as e:
        raise SourceRefused("host_error", f"the snapshot cannot be written to the cache ({e.strerror or e}); free "
                            "space in the cache volume") from None


def _refusal_of(e: RegistryError) -> SourceRefused:
    return SourceRefused("bad_artifact" if e.code in ("bad_answer", "manifest_not_found") else "unreachable",
                         e.message)


def _find(client: RegistryClient, subject: str, identity: SnapshotIdentity,
          ignore: frozenset[str] = frozenset()) -> tuple[str, dict]:
    """The digest and manifest document of the artifact to fetch (fetched by digest, checked in
    every identity field not in ``ignore``)."""
    where = client.ref.name
    candidates = _candidates(client.referrers(subject, SNAPSHOT_ARTIFACT_TYPE, MAX_CANDIDATES) or [])
    if not candidates:  # no referrers API, or one that lists none of ours (pushed before it had one): the tag schema
        raw = client.get_manifest_or_none(referrers_tag(subject))
        listed = (raw.json() if raw is not None else {}).get("manifests")
        candidates = _candidates(listed if isinstance(listed, list) else [])
    if not candidates:
        raise SourceRefused("not_found", f"{where} has no snapshot artifact for the image's manifest {subject}; "
                            "publish one with vmsidecar-oci snapshot push")
    # the listing's annotations are only a hint (whoever writes the index writes them): those that
    # claim this key are read first, and the manifest itself decides
    notes = [_object_or_empty(d.get("annotations")) for d in candidates]
    ranked = sorted(zip(candidates, notes, strict=True), key=lambda c: identity.mismatch(c[1], ignore) is not None)
    # one that cannot be read does not hide the next: an index is only ever appended to, and lists
    # artifacts deleted since
    first: SourceRefused | None = None
    for descriptor, _ in ranked[:MAX_MANIFESTS_READ]:
        digest = descriptor["digest"]
        try:
            doc = client.get_manifest(digest).json()  # digest-checked
        except DigestMismatchError as e:
            first = first or SourceRefused("tampered", e.message)
            continue
        except RegistryError as e:  # gone since it was listed, or the registry failed
            first = first or _refusal_of(e)
            continue
        except ImageError as e:  # not JSON
            first = first or SourceRefused("bad_artifact", e.message)
            continue
        problem = _artifact_problem(doc, subject, identity, ignore)
        if problem is None:
            return digest, doc
        first = first or SourceRefused(problem[0], f"the snapshot artifact {digest} in {where} is refused: "
                                       f"{problem[1]}; {PUBLISH}")
    assert first is not None
    raise first


def _candidates(entries: list) -> list[dict]:
    """The listed descriptors of snapshot artifacts (a registry may list every artifact type), the
    last :data:`MAX_CANDIDATES` of them: a push appends to the tag schema's index, so the newest
    snapshots are never those cut off."""
    return [d for d in entries if isinstance(d, dict)
            and d.get("artifactType") == SNAPSHOT_ARTIFACT_TYPE and is_digest(d.get("digest"))][-MAX_CANDIDATES:]


def _object_or_empty(value: object) -> dict:
    """A JSON object of a registry's answer, or an empty one for anything else it sent there."""
    return value if isinstance(value, dict) else {}


def _artifact_problem(doc: dict, subject: str, identity: SnapshotIdentity,
                      ignore: frozenset[str] = frozenset()) -> tuple[str, str] | None:
    """``(refusal code, reason)`` when the artifact's own manifest is not this runtime's snapshot."""
    if doc.get("artifactType") != SNAPSHOT_ARTIFACT_TYPE:
        return "bad_artifact", f"its artifactType is {doc.get('artifactType')!r}, not {SNAPSHOT_ARTIFACT_TYPE}"
    named = doc.get("subject")
    if not isinstance(named, dict) or named.get("digest") != subject:
        return "bad_artifact", f"its subject is not the image's manifest {subject}"
    why = identity.mismatch(_object_or_empty(doc.get("annotations")), ignore)
    return None if why is None else ("key_mismatch", why)


def _layers(doc: dict, where: str, limits: Limits) -> list[tuple[str, dict]]:
    """``(file name, descriptor)`` of each layer, checked: known types, plain unique names, bounded sizes."""
    layers = doc.get("layers")
    if not isinstance(layers, list) or not 0 < len(layers) <= MAX_FILES:
        raise SourceRefused("bad_artifact", f"{where} has no layers list of 1 to {MAX_FILES} files; {RESEND}")
    found: list[tuple[str, dict]] = []
    for d in layers:
        if not isinstance(d, dict) or not is_digest(d.get("digest")) or type(d.get("size")) is not int or d["size"] < 0:
            raise SourceRefused("bad_artifact", f"{where} has a layer without a digest or size; {RESEND}")
        if d.get("mediaType") not in (SNAPSHOT_FILE, SNAPSHOT_FILE_ZSTD):
            raise SourceRefused("bad_artifact", f"{where} has a layer of type {d.get('mediaType')!r}, which is not a "
                                f"snapshot file; {RESEND}")
        title = (d.get("annotations") or {}).get(ANNOTATION_TITLE) if isinstance(d.get("annotations"), dict) else None
        try:
            check_title(title if isinstance(title, str) else "", where)
        except ImageError:
            raise SourceRefused("bad_artifact", f"{where} has a layer titled {title!r}, not a plain file name; "
                                f"{RESEND}") from None
        if title == META_FILE and d["size"] > MAX_META:
            raise SourceRefused("bad_artifact", f"{where} has a {META_FILE} of {human_size(d['size'])}, which no "
                                f"snapshot has; {RESEND}")
        if d["size"] > limits.max_disk_bytes:
            raise SourceRefused("too_large", f"{where} has the layer {title} of {human_size(d['size'])}, past this "
                                f"runtime's {human_size(limits.max_disk_bytes)} limit per file")
        found.append((title, d))  # type: ignore[arg-type]
    names = [name for name, _ in found]
    if len(set(names)) != len(names) or META_FILE not in names:
        raise SourceRefused("bad_artifact", f"{where} names a file twice or has no {META_FILE}; {RESEND}")
    return found


@dataclass(frozen=True)
class Staged:
    """A snapshot artifact downloaded into a staging directory and checked against its own seal,
    not yet against the image it is restored over (:func:`complete`)."""

    digest: str
    doc: dict
    where: str
    snap: Snapshot
    meta: SnapshotMeta
    #: file name -> (seal digest, stat seal when hashed): commit does not hash them again
    hashed: dict[str, tuple[str, dict]]


def _stage(client: RegistryClient, digest: str, doc: dict, store: SnapshotStore, deadline: float,
           limits: Limits) -> Staged:
    where = f"the snapshot artifact {digest} in {client.ref.name}"
    layers = _layers(doc, where, limits)
    staged = store.staging("fetched")  # the key is the artifact's word until complete() checks it
    try:
        left = limits.max_disk_bytes  # for the files together: one guest's disk and RAM
        for name, descriptor in layers:
            left -= _download(client, descriptor, staged.path / name, f"{name} of {where}", deadline, limits,
                              _bound(name, left, limits))
        try:  # bounded nesting first: meta() is json.loads, which recurses
            load_document(staged.meta_file.read_bytes())
        except ValueError:
            raise SourceRefused("bad_artifact", f"the {META_FILE} of {where} is not a snapshot's; {RESEND}") from None
        meta = staged.meta()
        if meta is None:
            raise SourceRefused("bad_artifact", f"{where} has no readable {META_FILE}; {RESEND}")
        files = {name for name, _ in layers if name != META_FILE}
        if set(meta.files) != files:
            raise SourceRefused("bad_artifact", f"{where} has the files {sorted(files)}, not the ones its "
                                f"{META_FILE} seals ({sorted(meta.files)}); {RESEND}")
        hashed = {}
        for name, sealed in meta.files.items():
            try:
                seal = stat_seal((staged.path / name).stat())
            except OSError:
                seal = {}
            if seal_digest(staged.path / name) != sealed:  # a RAM file's by chunks
                raise SourceRefused("tampered", f"{name} of {where} does not match the {seal_hash(name)} its {META_FILE} "
                                    f"recorded at capture; {RESEND}")
            hashed[name] = (sealed, seal)
    except BaseException:
        store.discard_now(staged)
        raise
    return Staged(digest, doc, where, staged, meta, hashed)


def complete(staged: Staged, identity: SnapshotIdentity, base: DiskImage, store: SnapshotStore,
             limits: Limits = DEFAULT_LIMITS) -> Snapshot:
    """``staged`` committed to ``store`` as the snapshot of ``identity`` over ``base``, once its
    manifest names ``base``'s manifest as subject and every identity field matches; discarded
    otherwise. Blocking. :raise SourceRefused: why it is not used (``key_mismatch`` for another key)."""
    try:
        with _refusals():
            subject = base.manifest_digest
            problem = (("not_registry_image", "the image has no OCI manifest") if subject is None
                       else _artifact_problem(staged.doc, subject, identity))
            if problem is None and staged.meta.form != identity.form:  # what the restore goes by
                problem = ("bad_artifact", f"its {META_FILE} records the {staged.meta.form} form, its key the "
                           f"{identity.form} form")
            if problem is not None:
                raise SourceRefused(problem[0], f"{staged.where} is refused: {problem[1]}; {PUBLISH}")
            _rebase_frozen_overlay(staged.snap, base, staged.where, limits)
            # sealed again (the overlay's header changed); the files that did not change are not hashed twice
            snap = store.commit(staged.snap, identity.key, {}, staged.meta, staged.hashed)
    except BaseException:
        store.discard_now(staged.snap)
        raise
    if store.find(identity.key) is None:  # sealed, but not all a snapshot needs (the store says what)
        remove_tree(snap.path)
        raise SourceRefused("bad_artifact", f"{staged.where} lacks files every snapshot has; {RESEND}")
    return snap


@dataclass(frozen=True)
class _Bound:
    """The most bytes a file of a snapshot may decompress to, and the refusal past it."""

    size: int
    code: str
    why: str


def _bound(name: str, left: int, limits: Limits) -> _Bound:
    """How large the file ``name`` may be: its role's bound (a few KiB of ``meta.json``, a console's
    scrollback: both are read whole into memory), else what is left of the limit for them all."""
    if name == META_FILE:
        return _Bound(MAX_META, "bad_artifact", f"larger than any snapshot's {META_FILE}; {RESEND}")
    if name.endswith(CONSOLE_SUFFIX):
        return _Bound(SCROLLBACK, "bad_artifact", f"larger than a console's scrollback (all a snapshot's console "
                      f"holds); {RESEND}")
    return _Bound(left, "too_large", f"what is left of this runtime's {human_size(limits.max_disk_bytes)} limit for a "
                  "snapshot's files together; push a snapshot of a smaller guest, or raise --max-disk-size")


def _download(client: RegistryClient, descriptor: dict, out: Path, where: str, deadline: float,
              limits: Limits, bound: _Bound) -> int:
    """One layer into ``out``: hashed against its digest, decompressed under ``limits`` and ``bound``.
    Returns the bytes it decompressed to."""
    compression: Compression | None = "zstd" if descriptor["mediaType"] == SNAPSHOT_FILE_ZSTD else None
    reader: BlobReader | None = None
    size = 0
    try:
        with client.open_blob(descriptor) as chunks, open(out, "wb") as f:
            reader = BlobReader(_until(chunks, deadline, where), digest=descriptor["digest"], size=descriptor["size"],
                                where=where)
            _, stream = open_decompressed(reader, compression, Origin(where, RESEND), limits)
            while data := stream.read(CHUNK):
                size += len(data)
                if size > bound.size:
                    raise SourceRefused(bound.code, f"{where} decompresses to more than {human_size(bound.size)}, "
                                        f"{bound.why}")
                _check_deadline(deadline, where)  # a compressed chunk may hold gigabytes of repeated bytes
                if _all_zero(data):  # a templated snapshot's unwritten RAM: a hole, as at capture
                    f.seek(len(data), os.SEEK_CUR)
                else:
                    f.write(data)
            f.truncate()  # the file's length, when it ends in a hole
            reader.drain()
        reader.verify()
        return size
    except DigestMismatchError as e:
        raise SourceRefused("tampered", e.message) from None
    except ImageError as e:
        # the bytes did not decompress: say "altered" when they are not the ones the digest names
        if reader is not None:
            with contextlib.suppress(VmsidecarError):
                reader.drain()
            try:
                reader.verify()
            except DigestMismatchError as mismatch:
                raise SourceRefused("tampered", mismatch.message) from None
        raise SourceRefused("too_large" if e.code == "disk_too_large" else "bad_artifact", e.message) from None


def _all_zero(data: bytes) -> bool:
    # == is a memcmp that stops at the first non-zero byte; count(0) reads every byte (a Debian
    # guest's 1 GiB RAM layer: ~1.0 s against ~0.3 s, on the way to Ready)
    return data == _ZEROS if len(data) == CHUNK else data.count(0) == len(data)


def _until(chunks: Iterable[bytes], deadline: float, where: str) -> Iterator[bytes]:
    for chunk in chunks:
        _check_deadline(deadline, where)
        yield chunk


def _check_deadline(deadline: float, where: str) -> None:
    if time.monotonic() > deadline:
        raise SourceRefused("timeout", f"fetching {where} took longer than the fetch's bound; the registry is "
                            "slow or the snapshot large: the next boot tries again")


def _rebase_frozen_overlay(staged: Snapshot, base: DiskImage, where: str, limits: Limits) -> None:
    """Point the frozen overlay's backing file at this cache's copy of the image (the capturing
    node's path is recorded in it), after checking it is a qcow2 overlay with no data file and a
    virtual size within the image limit."""
    origin = Origin(f"the frozen overlay of {where}", RESEND)
    try:
        header = read_qcow2_header(staged.disk, origin)
    except OSError as e:
        raise SourceRefused("bad_artifact", f"{origin.what} cannot be read ({e.strerror}); {RESEND}") from None
    except ImageError as e:
        raise SourceRefused("bad_artifact", e.message) from None
    if header is None:
        raise SourceRefused("bad_artifact", f"{origin.what} is not a qcow2 image; {RESEND}")
    if header.data_file is not None or not header.backing_file:
        raise SourceRefused("bad_artifact", f"{origin.what} is not an overlay of the image (a data file, or no "
                            f"backing file); {RESEND}")
    try:  # every boot's overlay is made over it: it is the disk the guest sees, held to the image limit
        check_virtual_size(header.virtual_size, origin, limits)
    except ImageError as e:
        raise SourceRefused("too_large", e.message) from None
    # -u: only the header's backing name changes; the image is never opened through the old name
    try:
        rc, _, err = run_qemu_img("rebase", "-u", "-f", "qcow2", "-b", str(base.path), "-F", base.format,
                                  str(staged.disk), origin=origin, timeout=60, read=(base.path,), write=(staged.disk,))
    except ImageError as e:  # it took qemu-img past a bound
        raise SourceRefused("bad_artifact", e.message) from None
    except HostError as e:
        raise SourceRefused("host_error", e.message) from None
    if rc != 0:
        raise SourceRefused("bad_artifact", f"{origin.what} cannot be rebased onto {base.path} "
                            f"({err.strip()[:200]}); {RESEND}")
