"""A CI test against a VM served by vmsidecar: copy it next to your own tests.

Run it inside a Jumpstarter shell, whichever way you reach the VM:

    jmp shell --exporter-config exporter.yaml -- pytest test_vm_example.py     # local
    jmp shell --tls-grpc HOST:PORT --tls-grpc-insecure -- pytest test_vm_example.py  # standalone
    jmp shell --client-config ci.yaml --selector vm=tiny -- pytest test_vm_example.py  # leased

With a client config, allow the clients: `drivers: {allow: ["jumpstarter_driver_*"]}`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from jumpstarter.utils.env import env

PROMPT = "vm# "  # the tiny guest's shell prompt; use your image's


@pytest.fixture(scope="module")
def vm() -> Iterator[Any]:
    with env() as client:
        client.vm.power.on()
        yield client.vm


@pytest.fixture
def console(vm: Any) -> Iterator[Any]:
    with vm.console.pexpect() as session:
        session.expect("VMSIDECAR-READY", timeout=300)  # the boot log is replayed to every new reader
        session.send("\n")  # getty swallows the first line
        session.expect(PROMPT, timeout=30)
        yield session


def test_guest_runs_commands(console: Any) -> None:
    console.sendline("echo $((6 * 7)) > /data/answer; cat /data/answer")
    console.expect("42", timeout=30)


def test_power_reads_on(vm: Any) -> None:
    reading = next(iter(vm.power.read()))
    assert reading.voltage > 0
