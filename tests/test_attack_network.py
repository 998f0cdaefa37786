"""Attack (issue 19, item 9): the guest — whose root is the lease holder — reaches the pod's
loopback listeners (the exporter's gRPC port in standalone mode, health ports) and the cloud
metadata service through its NIC.

A real tiny guest, from its own shell: the pod's loopback (through the gateway, and with root's
routing tricks straight to 127.0.0.1) and the pod's own address must stay out of reach, while a
listener in a network namespace the test makes (a veth pair, 198.18.0.0/15: standing for "the
outside") must still answer. Nothing here talks to an address outside this machine: the metadata
address is refused by the runtime's filter before any packet leaves, which the guest sees as an
immediate "No route to host".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import socket
import struct
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from fixtures.runtime import BACKENDS
from vmsidecar_contract.spec import Network, VmSpec
from vmsidecar_images.console import Console
from vmsidecar_runtime.backend.libvirt.xml import render_domain
from vmsidecar_runtime.backend.netguard import LocalAddresses, qemu_args, refusal, refused
from vmsidecar_runtime.backend.qemu_argv import NETDEV_ID, build_argv
from vmsidecar_runtime.plan import BootPlan

pytestmark = pytest.mark.timeout(300)

#: seconds busybox nc waits for a connection: a refusal must come well within it
NC_WAIT = 3


@dataclass
class Listener:
    """A TCP listener that hands every caller a token and remembers each connection."""

    address: str
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    port: int = 0
    peers: list[str] = field(default_factory=list)


async def _listen(address: str) -> tuple[Listener, asyncio.Server]:
    listener = Listener(address)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        listener.peers.append(str(writer.get_extra_info("peername")))
        writer.write(f"{listener.token}\n".encode())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, address, 0)
    listener.port = server.sockets[0].getsockname()[1]
    return listener, server


def _own_address() -> str | None:
    """This machine's first global IPv4 address (never an address of another machine)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"],
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/", out)
    return m.group(1) if m else None


#: answers each connection with the token and logs the peer (runs inside the outside namespace)
_OUTSIDE_SERVER = """
import socket, sys
s = socket.socket()
s.bind((sys.argv[1], 0))
s.listen(16)
print(s.getsockname()[1], flush=True)
while True:
    c, peer = s.accept()
    c.sendall((sys.argv[2] + "\\n").encode())
    c.close()
    open(sys.argv[3], "a").write(peer[0] + "\\n")
"""


@dataclass
class Outside(Listener):
    """A listener in a network namespace of its own, reached through a veth pair: another host."""

    log: Path = Path("/dev/null")

    @property
    def connected(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []


@contextlib.contextmanager
def outside_host(workdir: Path) -> Iterator[Outside]:
    """A namespace ``vmsc-out-PID`` joined to this one by a veth pair on a random /30 of
    198.18.0.0/15 (the benchmarking range: no real host has it), with a listener on its side."""
    name, host_if, peer_if = f"vmsc-out-{os.getpid()}", f"vmsco{os.getpid() % 100000}", "eth0"
    base = f"198.{18 + random.randrange(2)}.{random.randrange(256)}.{random.randrange(64) * 4}"
    prefix, last = base.rsplit(".", 1)
    ours, theirs = f"{prefix}.{int(last) + 1}", f"{prefix}.{int(last) + 2}"
    steps = [["ip", "netns", "add", name],
             ["ip", "link", "add", host_if, "type", "veth", "peer", "name", peer_if, "netns", name],
             ["ip", "addr", "add", f"{ours}/30", "dev", host_if], ["ip", "link", "set", host_if, "up"],
             ["ip", "-n", name, "addr", "add", f"{theirs}/30", "dev", peer_if],
             ["ip", "-n", name, "link", "set", peer_if, "up"], ["ip", "-n", name, "link", "set", "lo", "up"]]
    server = None
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                why = f"cannot make the outside host ({' '.join(step)}: {done.stderr.strip()})"
                if os.geteuid() == 0:  # root can: anything else is a failure, never hidden as a skip
                    pytest.fail(why)
                pytest.skip(f"{why}: this test needs root (CAP_NET_ADMIN) to create a network namespace")
        outside = Outside(theirs, log=workdir / "outside-peers.log")
        server = subprocess.Popen(["ip", "netns", "exec", name, sys.executable, "-c", _OUTSIDE_SERVER, theirs,
                                   outside.token, str(outside.log)], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None
        outside.port = int(server.stdout.readline())
        yield outside
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@pytest.fixture
async def listeners(tmp_path: Path) -> AsyncIterator[tuple[Listener, Outside, Listener | None]]:
    """(loopback listener standing for the exporter's gRPC port, the outside host's listener, a
    listener on this machine's own non-loopback address — the pod's — when it has one)."""
    servers = []
    loop, server = await _listen("127.0.0.1")
    servers.append(server)
    own = None
    if (address := _own_address()) is not None:
        own, server = await _listen(address)
        servers.append(server)
    try:
        with outside_host(tmp_path) as outside:
            yield loop, outside, own
    finally:
        for server in servers:
            server.close()
            await server.wait_closed()


async def _nc(con: Console, address: str, port: int) -> str:
    return await con.run(f"nc -w {NC_WAIT} {address} {port} </dev/null 2>&1; echo rc=$?", timeout=NC_WAIT + 30)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_guest_reaches_outside_but_not_pod_loopback_nor_metadata(
    start_runtime: Any, tiny_image: Any, listeners: tuple[Listener, Outside, Listener | None], backend: str
) -> None:
    loop, outside, own = listeners
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"}, backend=backend)
    client = rt.client()
    await client.wait_ready(180)
    if backend == "qemu":
        # a guest restored from a memory snapshot gets a new QEMU: its NIC must be guarded as well
        await client.recycle()
        state = await client.wait_ready(120)
        assert state.snapshot.boot == "restored", state.snapshot
    con = await Console.open(rt.shared / "console.sock")
    await con.wake()
    # udhcpc runs in the background at boot: wait for the default route
    route = await con.run("for i in $(seq 50); do ip route | grep -q default && break; sleep 0.2; done; ip route")
    gateway = re.search(r"default via (\S+)", route)
    assert gateway, f"the guest got no default route: {route!r}"

    # the outside still answers
    got = await _nc(con, outside.address, outside.port)
    assert outside.token in got, f"the guest cannot reach {outside.address}:{outside.port} (the outside): {got!r}"

    # the gateway must not be the pod's loopback (slirp maps 10.0.2.2 to 127.0.0.1)
    got = await _nc(con, gateway.group(1), loop.port)
    assert loop.token not in got, f"the guest reached the pod's loopback through the gateway {gateway.group(1)}: {got!r}"
    # nor the pod's own address (a listener bound to 0.0.0.0, like a standalone exporter's, is there)
    if own is not None:
        got = await _nc(con, own.address, own.port)
        assert own.token not in got and not own.peers, f"the guest reached the pod's own address {own.address}: {got!r}"

    # root in the guest sends to 127.0.0.1 out of eth0: the NIC's backend must not connect it to
    # the pod's loopback (passt of Debian 12 does, even with --no-map-gw)
    await con.run(
        "ip route del local 127.0.0.1 table local; ip route del local 127.0.0.0/8 table local; "
        "for c in all eth0; do echo 1 > /proc/sys/net/ipv4/conf/$c/route_localnet; done; "
        f"ip route add 127.0.0.1/32 via {gateway.group(1)} dev eth0")
    got = await _nc(con, "127.0.0.1", loop.port)
    assert loop.token not in got, f"the guest reached the pod's loopback at 127.0.0.1: {got!r}"

    # the cloud metadata service: refused at once by the runtime, nothing leaves this machine
    started = asyncio.get_running_loop().time()
    got = await _nc(con, "169.254.169.254", 80)
    elapsed = asyncio.get_running_loop().time() - started
    assert "No route to host" in got and elapsed < NC_WAIT, f"metadata not refused ({elapsed:.1f} s): {got!r}"

    assert not loop.peers, f"the pod's loopback listener was connected from the guest: {loop.peers}"
    await con.close()


# ---- the guard's rules, frame by frame (no guest) ------------------------------------------------

GUEST_MAC, SLIRP_MAC = bytes.fromhex("525400123456"), bytes.fromhex("525500000002")


def _ipv4(dst: str, proto: int = 6, port: int = 80, flags: int = 0x02) -> bytes:
    l4 = struct.pack("!HHIIBBHHH", 40000, port, 1, 0, 5 << 4, flags, 64240, 0, 0) if proto == 6 else \
        struct.pack("!HHHH", 40000, port, 8, 0)
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), 1, 0, 64, proto, 0,
                         socket.inet_aton("10.0.2.15"), socket.inet_aton(dst))
    return SLIRP_MAC + GUEST_MAC + b"\x08\x00" + header + l4


def _fragment(frame: bytes) -> bytes:
    return frame[:20] + b"\x20\x00" + frame[22:]  # more fragments follow


def _ipv6(dst: str, next_header: int = 6, port: int = 80) -> bytes:
    l4 = struct.pack("!HHIIBBHHH", 40000, port, 1, 0, 5 << 4, 0x02, 64240, 0, 0)
    header = struct.pack("!IHBB", 6 << 28, len(l4), next_header, 64) + \
        socket.inet_pton(socket.AF_INET6, "fec0::5054:ff:fe12:3456") + socket.inet_pton(socket.AF_INET6, dst)
    return SLIRP_MAC + GUEST_MAC + b"\x86\xdd" + header + l4


@pytest.mark.parametrize(("frame", "default", "open_loopback"), [
    (_ipv4("192.0.2.10"), False, False),                       # the outside
    (_ipv4("10.0.2.2"), True, False),                          # slirp: the pod's 127.0.0.1
    (_ipv4("10.0.2.99", port=22), True, False),                # every other slirp alias too
    (_ipv4("10.0.2.2", flags=0x12), False, False),             # the guest's side of a port forward
    (_fragment(_ipv4("10.0.2.2", flags=0x12)), True, False),  # a fragment hides its real flags
    (_ipv4("10.0.2.2", proto=17, port=67), False, False),      # DHCP renewal
    (_ipv4("10.0.2.2", proto=1), False, False),                # ping the gateway
    (_ipv4("10.0.2.3", proto=17, port=53), False, False),      # DNS
    (_ipv4("10.0.2.3", port=22), True, False),                 # slirp: the pod's resolver, any port
    (_ipv4("127.0.0.1"), True, False),                         # root in the guest routes loopback out
    (_ipv4("0.0.0.0"), True, False),
    (_ipv4("169.254.169.254"), True, True),                    # metadata: its own switch
    (_ipv6("2001:db8::1"), False, False),
    (_ipv6("::1"), True, False),
    (_ipv6("::ffff:127.0.0.1"), True, False),
    (_ipv6("fec0::2"), True, False),
    (_ipv6("fec0::3", next_header=17, port=53), False, False),
    (_ipv6("fec0::2", next_header=58), False, False),          # neighbour discovery
    (_ipv6("fd00:ec2::254"), True, True),
    (SLIRP_MAC + GUEST_MAC + b"\x08\x06" + bytes(28), False, False),  # ARP
    (SLIRP_MAC + GUEST_MAC + b"\x80\x35" + bytes(46), False, False),  # RARP: QEMU's announce after a restore
    (SLIRP_MAC + GUEST_MAC + b"\x81\x00" + bytes(46), True, True),    # anything else (VLAN tag)
])
def test_guard_rules(frame: bytes, default: bool, open_loopback: bool) -> None:
    assert refused(frame, Network()) is default
    assert refused(frame, Network(allow_host_loopback=True)) is open_loopback
    assert refused(frame, Network(allow_host_loopback=True, allow_metadata=True)) is (frame[12:14] == b"\x81\x00")


def test_the_pods_own_addresses_are_refused_like_its_loopback() -> None:
    local = LocalAddresses(frozenset({int.from_bytes(socket.inet_aton("10.88.0.7"), "big")}),
                           frozenset({socket.inet_pton(socket.AF_INET6, "fd00::7")}))
    for frame in (_ipv4("10.88.0.7"), _ipv6("fd00::7")):
        assert refused(frame, Network()) is False  # another host's address
        assert refused(frame, Network(), local) is True  # the pod's own
        assert refused(frame, Network(allow_host_loopback=True), local) is False
    assert refused(_ipv4("10.88.0.8"), Network(), local) is False
    # the kernel's own tables: this namespace's loopback is among them
    assert int.from_bytes(socket.inet_aton("127.0.0.1"), "big") in LocalAddresses.read().v4


def test_refusal_is_an_icmp_the_guest_accepts() -> None:
    syn = _ipv4("169.254.169.254")
    answer = refusal(syn)
    assert answer is not None and answer[:6] == GUEST_MAC and answer[6:12] == SLIRP_MAC
    ip, icmp = answer[14:34], answer[34:]
    assert socket.inet_ntoa(ip[12:16]) == "10.0.2.2" and socket.inet_ntoa(ip[16:20]) == "10.0.2.15"
    assert _sum(ip) == 0 and _sum(icmp) == 0 and icmp[:2] == b"\x03\x0d"  # unreachable, admin prohibited
    assert icmp[8:] == syn[14:14 + 28]  # the quoted header the guest's stack matches to its socket
    answer6 = refusal(_ipv6("fd00:ec2::254"))
    assert answer6 is not None and answer6[54:56] == b"\x01\x01"
    pseudo = answer6[22:54] + struct.pack("!I3xB", len(answer6) - 54, 58)
    assert _sum(pseudo + answer6[54:]) == 0
    assert refusal(_ipv4("127.0.0.1", proto=1)) is None  # never ICMP for ICMP


def _sum(data: bytes) -> int:
    data += b"\0" * (len(data) % 2)
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def test_both_backends_route_the_nic_through_the_guard() -> None:
    plan = BootPlan(spec=VmSpec(image="file:/x.qcow2"), accel="tcg", disk=Path("/x"), disk_format="qcow2",
                    run_dir=Path("/run/vs"))
    argv = build_argv(plan)
    filters = [argv[i + 1] for i, a in enumerate(argv) if a == "-object" and argv[i + 1].startswith("filter-redirector")]
    assert filters == [f"filter-redirector,id=netguard-out,netdev={NETDEV_ID},queue=rx,outdev=net-out,indev=net-in",
                       f"filter-redirector,id=netguard-back,netdev={NETDEV_ID},queue=tx,indev=net-back"]
    assert "socket,id=net-out,path=/run/vs/net-out.sock,server=on,wait=off" in argv
    xml = render_domain(plan, "d", emulator="/usr/bin/qemu-system-x86_64")
    assert "filter-redirector,id=netguard-out,netdev=vsnet0" in xml
    opened = replace(plan, spec=VmSpec(image="file:/x.qcow2",
                                       network=Network(allow_host_loopback=True, allow_metadata=True)))
    assert not [a for a in build_argv(opened) if a.startswith("filter-redirector")]


async def test_an_unattached_guard_drops_the_guests_frames(
    start_runtime: Any, tiny_image: Any, listeners: tuple[Listener, Outside, Listener | None], tmp_path: Path
) -> None:
    """Fails closed: with nobody on the filter's sockets (the runtime's side gone), QEMU drops what
    the guest sends rather than passing it to slirp. The same arguments as a guarded boot, on a NIC
    of the test's own (extra_args) that the runtime does not attach to."""
    _, outside, _ = listeners
    run_dir = tmp_path / "guard"
    run_dir.mkdir()
    plan = BootPlan(spec=VmSpec(), accel="tcg", disk=Path("/x"), disk_format="qcow2", run_dir=run_dir)
    nic = ["-netdev", "user,id=lone0", "-device", "virtio-net-pci,netdev=lone0", *qemu_args(plan, "lone0")]
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off",
                              "network": {"enabled": False}, "extra_args": nic})
    await rt.client().wait_ready(180)
    con = await Console.open(rt.shared / "console.sock")
    await con.wake()
    # no DHCP answer comes back; a static address tries the outside directly
    await con.run("sleep 2; ip addr add 10.0.2.15/24 dev eth0; ip route add default via 10.0.2.2")
    got = await _nc(con, outside.address, outside.port)
    assert outside.token not in got and not outside.connected, f"a frame passed an unattached guard: {got!r}"
    await con.close()
