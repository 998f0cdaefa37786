"""A pod on a node whose cache is empty starts from a snapshot in the registry, without booting
(issue 23, item 2), with real guests, a real capture, the real ``vmsidecar-oci snapshot push``
and a real distribution 2.8 registry (no referrers API: the tag schema is what is read).

One runtime captures the tiny guest (module fixture); the CLI publishes its snapshot. A runtime
on an empty cache whose spec names the repository as ``snapshot_source`` is then Ready from it
(boot kind ``registry_warm``) and as isolated as a recycled guest; one of another key, one given
a tampered artifact and one whose source is another repository boot cold and say why. A disk
published as podman-machine-os publishes its own (an index of disktypes) gets its snapshot too.
tests/test_attack_registry_snapshots.py covers each refusal in detail without a guest.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zstandard
from test_snapshots import _lease_leaves_traces, _probe, _recycle

from fixtures.faults import wait_phase
from fixtures.registry import Crafter, RunningRegistry, copy_manifest, start_registry
from vmsidecar_contract.blocking import BlockingRuntimeClient
from vmsidecar_contract.process import RuntimeProcess, clean_environ
from vmsidecar_images.console import Console
from vmsidecar_runtime.oci import push_artifact
from vmsidecar_runtime.oci.mediatypes import OCI_INDEX
from vmsidecar_runtime.oci.reference import parse_reference
from vmsidecar_runtime.oci.registry import RegistryClient
from vmsidecar_runtime.oci.snapshot_artifact import referrers_tag

# one xdist worker runs the module (scripts/test: --dist loadgroup), so its module-scoped `published`
# is made once, not once on each worker that gets one of its tests
pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("registry-snapshots")]

TITLE = "org.opencontainers.image.title"
ENV_KEEP = ["VMSIDECAR_INSECURE_REGISTRIES"]


@dataclass(frozen=True)
class Published:
    """The tiny guest's image and the snapshot artifact its runtime captured, in one repository."""

    registry: RunningRegistry
    repo: str
    spec: dict
    key: str
    subject: str
    artifact: str
    #: the scrollback captured with the snapshot (what a restored guest shows, and nothing more)
    console: str

    @property
    def source(self) -> str:
        return f"{self.registry.host}/{self.repo}"


@pytest.fixture(scope="module")
def published(registry: RunningRegistry, tiny_image: Any, tmp_path_factory: pytest.TempPathFactory) -> Published:
    """Capture the tiny guest from the registry on a cache of its own, and push the snapshot with the CLI."""
    work = tmp_path_factory.mktemp("regsnap")
    repo = "regsnap/tiny"
    push_artifact(tiny_image.disk, f"{registry.host}/{repo}:v1")
    # a channel no other test's spec has: a key of its own
    spec = {"image": f"{registry.host}/{repo}:v1", "memory": "256M", "channels": [{"name": "regsnap"}]}
    cache = work / "capture-cache"
    env = clean_environ(keep=ENV_KEEP)
    rt = RuntimeProcess.start(work / "capture", spec=spec, cache=cache, args=["--grace", "20"], env=env)
    try:
        rt.wait_serving_blocking()
        BlockingRuntimeClient(rt.socket).wait_ready(240)
        state = BlockingRuntimeClient(rt.socket).wait_stored()  # the capture is stored just after Ready
        assert state["snapshot"]["boot"] == "cold" and state["snapshot"]["available"], state["snapshot"]
    finally:
        assert rt.stop() == 0, rt.log_text()[-3000:]
    spec_file = work / "spec.json"
    spec_file.write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, "-m", "vmsidecar_runtime.oci.cli", "snapshot", "push",
                           f"{registry.host}/{repo}", "--cache", str(cache), "--spec", str(spec_file)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "referrers tag schema updated" in done.stderr, done.stderr
    artifact = done.stdout.strip().rsplit("@", 1)[1]
    client = RegistryClient(parse_reference(f"{registry.host}/{repo}"))
    try:
        doc = client.get_manifest(artifact).json()
    finally:
        client.close()
    key = doc["annotations"]["io.vmsidecar.snapshot.key"]
    console = (cache / "snapshots" / key / "ttyS0.console").read_bytes().decode(errors="replace")
    return Published(registry, repo, spec, key, doc["subject"]["digest"], artifact, console)


async def test_an_empty_cache_is_ready_from_the_registry_without_booting_and_isolated(
    start_runtime: Any, published: Published, tmp_path: Path
) -> None:
    cache = tmp_path / "empty-node-cache"
    started = time.monotonic()
    rt = await start_runtime({**published.spec, "snapshotSource": published.source}, cache=cache)
    client = rt.client()
    state = await client.wait_ready(240, poll=0.05)
    took = time.monotonic() - started
    assert state.snapshot.boot == "registry_warm" and state.boot == 1, state.snapshot
    assert state.snapshot.source_refusal is None and state.snapshot.reason is None, state.snapshot
    assert (cache / "snapshots" / published.key / "memory").is_file()  # the cache has it now: recycles restore
    # a templated snapshot travels with its RAM file and restores mapping it (issue 23)
    ram = cache / "snapshots" / published.key / "ram"
    assert state.snapshot.form == "templated" and ram.is_file(), state.snapshot
    assert ram.stat().st_blocks * 512 < ram.stat().st_size  # RAM the guest never wrote stays a hole
    assert took < 60, f"a registry warm start took {took:.1f} s"  # ~2 s unloaded: see bench/registry_warm.py
    console = rt.shared / "console.sock"
    replay, probe = await _probe(console)
    # no boot: the console shows the captured scrollback, and the guest printed no second boot
    assert replay.count("VMSIDECAR-READY") == published.console.count("VMSIDECAR-READY") == 1, replay[-2000:]
    assert "Linux version" not in replay[len(published.console):], replay[-2000:]
    # the same isolation as a recycle (test_snapshots.py): no lease's disk, RAM or processes, and
    # randomness of its own
    seen_random: set[str] = set()
    for lease in ("warm-lease-one", "warm-lease-two"):
        lines = [line.strip() for line in probe.splitlines()]
        assert "ls: /data/lease-file: No such file or directory" in lines, probe
        assert "ls: /tmp/ram-file: No such file or directory" in lines, probe
        assert "0" in lines, probe
        assert re.fullmatch(r"[0-9a-f]{32}", lines[-1]) and lines[-1] not in seen_random, probe
        seen_random |= {lines[-1], await _lease_leaves_traces(console, lease)}
        state, _ = await _recycle(client)
        assert state.snapshot.boot == "restored", state.snapshot  # from the cache, now
        replay, probe = await _probe(console)
        assert "warm-lease" not in replay


async def test_another_cpu_model_refuses_the_snapshot_and_boots_cold(start_runtime: Any, published: Published,
                                                                     tmp_path: Path) -> None:
    # the pool owner's portable model differs from the one captured: another key, said field by field
    spec = {**published.spec, "snapshotSource": published.source, "cpu": "qemu64"}
    rt = await start_runtime(spec, cache=tmp_path / "cache")
    state = await rt.client().wait_ready(240)
    assert state.snapshot.boot == "cold" and state.snapshot.source_refusal == "key_mismatch", state.snapshot
    assert "its CPU model is 'max', this runtime's is 'qemu64'" in (state.snapshot.reason or ""), state.snapshot


def _altered_storage(reg: RunningRegistry, doc: dict, client: RegistryClient) -> None:
    memory = next(d for d in doc["layers"] if d["annotations"][TITLE] == "memory")
    blob = reg.blob_data(memory["digest"])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x55
    blob.write_bytes(bytes(data))


def _swapped_console(reg: RunningRegistry, doc: dict, client: RegistryClient) -> None:
    # a layer of the right digest whose content is not the file the snapshot sealed: the manifest
    # is rewritten, so it is listed under a digest of its own
    console = next(d for d in doc["layers"] if d["annotations"][TITLE] == "ttyS0.console")
    other = b"VMSIDECAR-READY image=someone-else\n"
    with tempfile.TemporaryDirectory() as tmp:
        client.push_blob_bytes(other, console["mediaType"], Path(tmp))
    console.update(digest=Crafter.digest(other), size=len(other))


@pytest.mark.parametrize("tamper", [_altered_storage, _swapped_console], ids=["altered-blob", "swapped-layer"])
async def test_a_tampered_artifact_is_refused_and_the_pod_boots_cold(
    start_runtime: Any, published: Published, tmp_path: Path,
    tamper: Callable[[RunningRegistry, dict, RegistryClient], None]
) -> None:
    # a registry of its own: distribution stores a blob once for every repository
    with start_registry(tmp_path / "registry") as reg:
        src = RegistryClient(parse_reference(published.source))
        dst = RegistryClient(parse_reference(f"{reg.host}/{published.repo}"))
        try:
            copy_manifest(src, dst, published.subject)
            doc = copy_manifest(src, dst, published.artifact)
            tamper(reg, doc, dst)
            data = json.dumps(doc).encode()
            digest = dst.put_manifest(Crafter.digest(data), data, doc["mediaType"])
            entry = {"mediaType": doc["mediaType"], "digest": digest, "size": len(data),
                     "artifactType": doc["artifactType"], "annotations": doc["annotations"]}
            index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [entry]}).encode()
            dst.put_manifest(referrers_tag(published.subject), index, OCI_INDEX)
        finally:
            src.close()
            dst.close()
        # the image from the published repository (the spec, and so the key, is the same), the
        # snapshot from the tampered copy
        spec = {**published.spec, "snapshotSource": f"{reg.host}/{published.repo}"}
        rt = await start_runtime(spec, cache=tmp_path / "cache")
        state = await rt.client().wait_ready(240)
        await rt.client().wait_stored()  # its cold boot's capture is stored just after Ready
    assert state.snapshot.boot == "cold" and state.snapshot.source_refusal == "tampered", state.snapshot
    assert not list((tmp_path / "cache" / "snapshots").glob(".incoming-*"))


async def test_a_snapshot_in_another_repository_is_never_read(start_runtime: Any, published: Published,
                                                               tmp_path: Path) -> None:
    # the spec's source holds the image but no snapshot; the artifact next to the image is not looked at
    src = RegistryClient(parse_reference(published.source))
    dst = RegistryClient(parse_reference(f"{published.registry.host}/regsnap/elsewhere"))
    try:
        copy_manifest(src, dst, published.subject)
    finally:
        src.close()
        dst.close()
    spec = {**published.spec, "snapshotSource": f"{published.registry.host}/regsnap/elsewhere"}
    rt = await start_runtime(spec, cache=tmp_path / "cache")
    state = await rt.client().wait_ready(240)
    assert state.snapshot.boot == "cold" and state.snapshot.source_refusal == "not_found", state.snapshot
    assert "regsnap/elsewhere has no snapshot artifact" in (state.snapshot.reason or ""), state.snapshot
    assert (await rt.client().wait_stored()).snapshot.available
    assert os.path.isdir(tmp_path / "cache" / "snapshots" / published.key)  # captured here, at Ready


@pytest.mark.timeout(300)
def test_vmsidecar_shell_starts_from_the_registry_on_an_empty_cache(published: Published, tmp_path: Path) -> None:
    # a developer's laptop: the same spec, the source on the command line, a cache that never saw the guest
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(published.spec))
    env = {**clean_environ(keep=ENV_KEEP), "VMSIDECAR_CACHE_DIR": str(tmp_path / "laptop-cache")}
    result = subprocess.run(
        [sys.executable, "-m", "jumpstarter_driver_vmsidecar.local", "--spec", str(spec_file),
         "--snapshot-source", published.source, "--", "vmsidecar-runtime", "status", "--json"],
        env=env, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    state = json.loads(result.stdout[result.stdout.index("{"):])
    assert state["phase"] == "Ready" and state["snapshot"]["boot"] == "registry_warm", state["snapshot"]


async def test_a_push_during_the_boot_waits_for_its_capture(start_runtime: Any, published: Published,
                                                             tmp_path: Path) -> None:
    """"Serve until Ready, then push" while the capture is still being stored (it is, just after
    Ready): the push waits for a capture of its key under way in a live runtime on its cache. Made
    certain here: the push starts while the guest boots, which cannot be Ready before the test types
    the line its readiness pattern waits for."""
    spec = {**published.spec, "channels": [{"name": "push-wait"}], "readiness": {"pattern": "PUSH-WAIT-42"}}
    cache = tmp_path / "cache"
    rt = await start_runtime(spec, cache=cache)
    client = rt.client()
    await wait_phase(client, "Running", timeout=240)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    push = subprocess.Popen([sys.executable, "-m", "vmsidecar_runtime.oci.cli", "snapshot", "push",
                             f"{published.registry.host}/regsnap/push-wait", "--cache", str(cache),
                             "--spec", str(spec_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=clean_environ(keep=ENV_KEEP))
    try:
        assert push.stderr is not None
        waiting = await asyncio.wait_for(asyncio.to_thread(push.stderr.readline), 120)
        assert "waiting for the capture under way" in waiting, waiting
        assert push.poll() is None
        con = await Console.open(rt.shared / "console.sock")
        try:
            await con.wake()
            await con.run("echo PUSH-WAIT-$((40+2))")  # the shell's answer, not the echo of the line
        finally:
            await con.close()
        out, err = await asyncio.to_thread(push.communicate, timeout=120)
    finally:
        if push.poll() is None:
            push.kill()
    assert push.returncode == 0, err
    state = await client.state()
    assert state.snapshot.boot == "cold" and state.snapshot.available, state.snapshot
    assert out.strip().startswith(f"{published.registry.host}/regsnap/push-wait@sha256:"), out


async def test_a_disk_published_like_podman_machine_os_gets_its_snapshot_from_the_registry(
    start_runtime: Any, registry: RunningRegistry, tiny_image: Any, tmp_path: Path
) -> None:
    """The disk as podman-machine-os publishes its own: an index with one platform manifest per
    ``disktype``, each a zstd blob titled ``*.qcow2.zst``. The snapshot's subject is the manifest
    the runtime booted (``disktype: qemu``), and a runtime on an empty cache finds it there."""
    repo = "regsnap/machine-os"
    craft = Crafter(registry=registry, repo=repo)
    data = zstandard.ZstdCompressor().compress(tiny_image.disk.read_bytes())
    manifests = {}
    for disktype in ("applehv", "qemu", "hyperv"):
        layer = craft.blob(data, "application/zstd", {TITLE: f"disk-{disktype}.qcow2.zst"})
        manifests[disktype] = craft.manifest([layer], artifact_type="application/vnd.unknown.artifact.v1")
    amd64 = {"os": "linux", "architecture": "amd64"}
    image = craft.tag(craft.index([(m, amd64, {"disktype": d}) for d, m in manifests.items()]), "5.5")
    spec = {"image": image, "memory": "256M", "channels": [{"name": "machine-os"}],
            "readiness": {"pattern": "VMSIDECAR-READY image=tiny"}}
    cache = tmp_path / "capture-cache"
    rt = await start_runtime(spec, cache=cache, name="capture")
    await rt.client().wait_ready(240)
    assert (await rt.client().wait_stored()).snapshot.available
    rt.stop()
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, "-m", "vmsidecar_runtime.oci.cli", "snapshot", "push",
                           f"{registry.host}/{repo}", "--cache", str(cache), "--spec", str(spec_file)],
                          capture_output=True, text=True, timeout=300, env=clean_environ(keep=ENV_KEEP))
    assert done.returncode == 0, done.stderr
    client = RegistryClient(parse_reference(f"{registry.host}/{repo}"))
    try:
        doc = client.get_manifest(done.stdout.strip().rsplit("@", 1)[1]).json()
    finally:
        client.close()
    assert doc["subject"]["digest"] == manifests["qemu"]["digest"], (doc["subject"], manifests)

    warm = await start_runtime({**spec, "snapshotSource": f"{registry.host}/{repo}"},
                               cache=tmp_path / "empty", name="warm")
    state = await warm.client().wait_ready(240)
    assert state.snapshot.boot == "registry_warm" and state.image == image, state.snapshot
