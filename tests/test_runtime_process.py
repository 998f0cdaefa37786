"""The one runtime launcher (``vmsidecar_contract.process``) on real ``vmsidecar-runtime serve`` processes,
most without a spec (no guest boots): it waits until the API answers, names why a runtime did not
serve (with the runtime's own words from its log), and stops it cleanly; and the API answers while
a boot is under way (a pull that hangs, a guest booting on a busy core)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from vmsidecar_contract.blocking import BlockingRuntimeClient
from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.process import RuntimeProcess, RuntimeStartError, clean_environ
from vmsidecar_contract.state import Phase
from vmsidecar_images.build import BuiltImage


def test_waits_until_the_api_answers_then_stops_cleanly(tmp_path: Path) -> None:
    with RuntimeProcess.start(tmp_path / "rt", cache=tmp_path / "cache", env=clean_environ()) as rt:
        rt.wait_serving_blocking()
        assert BlockingRuntimeClient(rt.socket).state()["phase"] == "Stopped"
        assert rt.stop() == 0  # SIGTERM: the runtime's graceful exit
    assert "serving" in rt.log_text() and not rt.socket.exists()


async def test_a_runtime_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    rt = RuntimeProcess.start(tmp_path / "rt", cache=tmp_path / "cache", args=["--grace", "soon"],
                              env=clean_environ())
    with pytest.raises(RuntimeStartError) as e:
        await rt.wait_serving()
    message = str(e.value)
    assert "exited with 2 before it served" in message and "'soon' is not a number of seconds" in message, message


def test_a_runtime_late_to_serve_is_reported_and_can_be_killed(tmp_path: Path) -> None:
    rt = RuntimeProcess.start(tmp_path / "rt", cache=tmp_path / "cache", env=clean_environ())
    try:
        with pytest.raises(RuntimeStartError, match=r"did not serve .*api\.sock within 0\.001 s; its log"):
            rt.wait_serving_blocking(timeout=0.001)  # its imports alone take longer
    finally:
        assert rt.stop(signal.SIGKILL) == -signal.SIGKILL


async def test_a_spec_mapping_is_written_for_the_runtime(tmp_path: Path) -> None:
    spec = {"image": "file:/nonexistent/disk.qcow2", "memory": "64M"}
    with RuntimeProcess.start(tmp_path / "rt", spec=spec, cache=tmp_path / "cache", env=clean_environ(),
                              args=["--grace", "5"]) as rt:
        await rt.wait_serving()
        async with RuntimeClient(rt.socket) as client:
            served = await client.get_spec()
    assert served is not None and (served.image, served.memory) == (spec["image"], 64)  # MiB


async def test_the_api_answers_while_the_boot_pull_hangs(tmp_path: Path) -> None:
    """The API's modules load once the boot's pull is over (beside it, on one GIL, they slowed a cold
    start's pull), but a pull that does not end must not keep the API down."""
    # a registry that accepts and never answers: the pull gives up after 3 tries of 2.5 s (Error);
    # the API must answer long before, while the phase is still Pulling
    with socket.create_server(("127.0.0.1", 0)) as silent:
        spec = {"image": f"127.0.0.1:{silent.getsockname()[1]}/vm:1"}
        with RuntimeProcess.start(tmp_path / "rt", spec=spec, cache=tmp_path / "cache", env=clean_environ()) as rt:
            await rt.wait_serving(timeout=20)
            async with RuntimeClient(rt.socket) as client:
                assert (await client.state()).phase == Phase.PULLING


async def test_the_api_answers_while_a_cold_guest_boots_on_a_busy_core(tmp_path: Path, tiny_image: BuiltImage) -> None:
    """The API, and with it the kubelet's probes, must answer while a guest boots however busy the
    node is. The runtime, its QEMU and two busy loops share one core (each inherits the affinity of
    the thread that starts it): the API's first answer comes while the guest still boots. With its
    modules' import at nice 19 (withdrawn: decisions.md) it answered only once the guest was Ready
    and idle: under load a nice-19 thread gets ~1 % of a core."""
    own = os.sched_getaffinity(0)
    hogs: list[subprocess.Popen[bytes]] = []
    os.sched_setaffinity(0, {max(own)})  # this thread's, inherited by what it starts
    try:
        hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(2)]
        rt = RuntimeProcess.start(tmp_path / "rt", spec={"image": f"file:{tiny_image.disk}", "memory": "256M"},
                                  cache=tmp_path / "cache", env=clean_environ(), args=["--grace", "5"])
    finally:
        os.sched_setaffinity(0, own)
    try:
        with rt:
            await rt.wait_serving(timeout=240)
            async with RuntimeClient(rt.socket) as client:
                state = await client.state()
            assert state.phase in (Phase.PULLING, Phase.STARTING, Phase.RUNNING), state.phase
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_a_runtimes_private_run_dir_never_outlives_it(tmp_path: Path) -> None:
    """Each runtime keeps QEMU's sockets in a private directory under /tmp (short paths): one killed
    (SIGKILL, OOM) left it behind, and so did one that refused its flags after making it; a day of CI
    had left 281 on this machine. The next runtime to start removes those of runtimes that are gone."""
    tmp = tmp_path / "t"
    tmp.mkdir()
    env = {**clean_environ(), "TMPDIR": str(tmp)}  # (this test's runtimes only: others share /tmp)
    killed = RuntimeProcess.start(tmp_path / "one", cache=tmp_path / "cache", env=env)
    killed.wait_serving_blocking()
    [left] = list(tmp.glob("vmsidecar-*"))
    killed.stop(signal.SIGKILL)
    assert left.is_dir()  # nothing of the killed process ran
    with RuntimeProcess.start(tmp_path / "two", cache=tmp_path / "cache", env=env) as rt:
        rt.wait_serving_blocking()
        assert not left.exists(), "a killed runtime's private run directory stayed"
        assert len(list(tmp.glob("vmsidecar-*"))) == 1  # its own
    assert list(tmp.glob("vmsidecar-*")) == []  # its own, at its exit
    refused = RuntimeProcess.start(tmp_path / "three", cache=tmp_path / "cache", env=env,
                                   args=["--health-listen", "nowhere"])
    assert refused.proc.wait(60) == 2, refused.log_text()
    assert list(tmp.glob("vmsidecar-*")) == [], "a runtime that refused its flags left its run directory"
