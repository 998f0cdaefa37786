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
import select
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from fixtures import libslirp
from fixtures.runtime import BACKENDS
from vmsidecar_contract.spec import Network, VmSpec
from vmsidecar_images.console import Console
from vmsidecar_runtime.backend.libvirt.xml import render_domain
from vmsidecar_runtime.backend.netguard import LocalAddresses, NetGuard, qemu_args, refusal, refused
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
    # slirp 4.7.0 connects the limited broadcast to the pod's 127.0.0.1 and all-nodes to its ::1;
    # the pod's kernel loops multicast back to the pod's own sockets on 0.0.0.0 / ::
    (_ipv4("255.255.255.255"), True, False),
    (_ipv4("255.255.255.255", proto=17, port=8080), True, False),
    (_ipv4("255.255.255.255", proto=1), True, False),          # no ping socket: slirp echoes to 127.0.0.1:7
    (_ipv4("255.255.255.255", proto=17, port=67), False, False),  # DHCP discover: slirp's bootp answers
    (_fragment(_ipv4("255.255.255.255", proto=17, port=67)), True, False),
    (_ipv4("10.0.2.255", proto=17, port=8080), True, False),   # slirp's own broadcast
    (_ipv4("224.0.0.1", proto=17, port=8080), True, False),    # all hosts: the pod itself
    (_ipv4("239.255.255.250", proto=17, port=1900), True, False),
    (_ipv4("224.0.0.22", proto=2), True, False),               # IGMP (slirp drops it anyway)
    (_ipv6("ff02::1"), True, False),                           # all nodes: slirp's ::1
    (_ipv6("ff02::1", next_header=17, port=8080), True, False),
    (_ipv6("ff02::fb", next_header=17, port=5353), True, False),
    (_ipv6("ff05::1:3", next_header=17, port=547), True, False),
    (_ipv6("ff02::1:2", next_header=17, port=8080), True, False),
    (_ipv6("ff02::1:2", next_header=17, port=547), False, False),  # DHCPv6: slirp answers
    (_ipv6("ff02::2", next_header=58), False, False),          # router solicitation
    (_ipv6("ff02::1:ff00:2", next_header=58), False, False),   # neighbour solicitation
    # an IPv4 address inside IPv6: mapped (the kernel connects IPv4), compatible, NAT64's prefix
    (_ipv6("::ffff:169.254.169.254"), True, True),
    (_ipv6("::169.254.169.254"), True, True),
    (_ipv6("64:ff9b::169.254.169.254"), True, True),
    (_ipv6("64:ff9b::127.0.0.1"), True, False),
    (_ipv6("64:ff9b::e000:1", next_header=17, port=8080), True, False),  # 224.0.0.1
    (_ipv6("64:ff9b::192.0.2.10"), False, False),              # the outside through NAT64
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
    nat64 = _ipv6("64:ff9b::10.88.0.7")  # an IPv4 address of the pod inside IPv6
    assert refused(nat64, Network()) is False and refused(nat64, Network(), local) is True
    assert refused(nat64, Network(allow_host_loopback=True), local) is False
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
    # nor for a broadcast or multicast (RFC 1122 3.2.2, RFC 4443 2.4)
    for group in (_ipv4("255.255.255.255", proto=17), _ipv4("10.0.2.255", proto=17),
                  _ipv4("224.0.0.1", proto=17), _ipv6("ff02::1", next_header=17)):
        assert refused(group, Network()) and refusal(group) is None


def test_the_guests_routine_multicast_does_not_hide_what_it_aims_at_the_pod(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A guest's OS sends IGMP, MLD and mDNS at every boot, all refused: one line tells of them, and
    the first lines stay for the frames aimed at an address (the operator's clue to an attack)."""
    guard = NetGuard(BootPlan(spec=VmSpec(), accel="tcg", disk=Path("/x"), disk_format="qcow2", run_dir=tmp_path))
    caplog.set_level("INFO", logger="vmsidecar_runtime.backend.netguard")
    routine = [_ipv6("ff02::16", 0), _ipv4("224.0.0.22", 2), _ipv4("224.0.0.251", 17, 5353),
               _ipv4("255.255.255.255", 17, 9), _ipv4("10.0.2.255", 17, 137)] * 4
    for frame in [*routine, _ipv4("10.0.2.2", port=8080), _ipv6("fec0::2", port=8080)]:
        guard._count(frame)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "ff02::16" in lines[0] and "only counted" in lines[0]
    assert lines[1:] == ["guest NIC: refused a frame to 10.0.2.2 (21 so far)",
                         "guest NIC: refused a frame to fec0::2 (22 so far)"]
    assert (guard.refused, guard.refused_to_groups) == (22, 20)
    # a guest refused as fast as it sends (470 frames a millisecond in an auditor's run) logged its
    # count every 1000th frame: now at most once in COUNT_EVERY_S
    caplog.clear()
    for _ in range(20_000):
        guard._count(routine[0])
    counted = [r.getMessage() for r in caplog.records if "frames refused so far" in r.getMessage()]
    assert len(counted) == 1, counted


def _sum(data: bytes) -> int:
    data += b"\0" * (len(data) % 2)
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _arrived_tcp(listener: socket.socket, deadline: float) -> int:
    """Connections accepted until one came (or the deadline passed), then a short grace for more."""
    count = 0
    while True:
        wait = max(0.0, deadline - time.monotonic()) if count == 0 else 0.1
        if not select.select([listener], [], [], wait)[0]:
            return count
        listener.accept()[0].close()
        count += 1


def _arrived_udp(sock: socket.socket, control: bytes, deadline: float) -> list[bytes]:
    """Datagrams received until ``control`` came (or the deadline passed), then a short grace for more."""
    got: list[bytes] = []
    while True:
        wait = max(0.0, deadline - time.monotonic()) if control not in got else 0.1
        if not select.select([sock], [], [], wait)[0]:
            return got
        got.append(sock.recv(2048))


def test_what_the_guard_passes_to_the_real_libslirp_never_reaches_the_pods_loopback() -> None:
    """The host's libslirp (QEMU's -netdev user, configured as QEMU configures it) behind the guard:
    a broadcast or multicast frame from the guest must not reach a listener of the pod's loopback or a
    socket of the pod on 0.0.0.0, while the same listeners receive slirp's usual alias of the loopback
    (10.0.2.2, fec0::2), which the guard refuses and the test hands slirp itself: the test can see a
    frame arrive. DHCP, DHCPv6 and NDP to their broadcast or multicast addresses pass and are answered."""
    local, policy = LocalAddresses.read(), Network()
    tcp4, udp4 = socket.socket(), socket.socket(type=socket.SOCK_DGRAM)
    any4 = socket.socket(type=socket.SOCK_DGRAM)
    tcp6, udp6 = socket.socket(socket.AF_INET6), socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    mapped = socket.socket()
    with libslirp.Slirp() as slirp, tcp4, udp4, any4, tcp6, udp6, mapped:
        for sock, address in ((tcp4, "127.0.0.1"), (udp4, "127.0.0.1"), (any4, "0.0.0.0"), (tcp6, "::1"),
                              (udp6, "::1"), (mapped, "127.0.0.1")):
            sock.bind((address, 0))
        for sock in (tcp4, tcp6, mapped):
            sock.listen(8)
        p4, u4, w4, p6, u6, m4 = (s.getsockname()[1] for s in (tcp4, udp4, any4, tcp6, udp6, mapped))
        v4, v6, syn, udp = libslirp.ipv4, libslirp.ipv6, libslirp.tcp_syn, libslirp.udp
        attacks = {
            "TCP 255.255.255.255 (slirp: 127.0.0.1)": v4("255.255.255.255", 6, syn(40001, p4)),
            "UDP 255.255.255.255 (slirp: 127.0.0.1)": v4("255.255.255.255", 17, udp(40002, u4, b"bcast")),
            "UDP 224.0.0.1 (looped back to 0.0.0.0)": v4("224.0.0.1", 17, udp(40003, w4, b"mcast")),
            "TCP ff02::1 (slirp: ::1)": v6("ff02::1", 6, syn(40004, p6)),
            "UDP ff02::1 (slirp: ::1)": v6("ff02::1", 17, udp(40005, u6, b"allnodes")),
        }
        passed = [name for name, frame in attacks.items() if not refused(frame, policy, local)]
        for name in passed:
            slirp.input(attacks[name])
        controls = [v4("10.0.2.2", 6, syn(40011, p4)), v4("10.0.2.2", 17, udp(40012, u4, b"control")),
                    v4("10.0.2.2", 17, udp(40013, w4, b"control")), v6("fec0::2", 6, syn(40014, p6)),
                    v6("fec0::2", 17, udp(40015, u6, b"control"))]
        for frame in controls:
            assert refused(frame, policy, local)
            slirp.input(frame)
        deadline = time.monotonic() + 2
        arrived = {"127.0.0.1 TCP": _arrived_tcp(tcp4, deadline), "::1 TCP": _arrived_tcp(tcp6, deadline),
                   "127.0.0.1 UDP": _arrived_udp(udp4, b"control", deadline),
                   "0.0.0.0 UDP": _arrived_udp(any4, b"control", deadline),
                   "::1 UDP": _arrived_udp(udp6, b"control", deadline)}
        where = f"libslirp {slirp.version}; passed by the guard: {passed}; arrived: {arrived}"
        assert all(got in (1, [b"control"]) for got in arrived.values()), where

        # IPv4 in IPv6: slirp hands ::ffff:a.b.c.d to the kernel, which connects a.b.c.d, so the
        # guard must judge the IPv4 address (the metadata service, with the loopback open)
        opened, loopback = Network(allow_host_loopback=True), v6("::ffff:127.0.0.1", 6, syn(40021, m4))
        assert not refused(loopback, opened, local)
        slirp.input(loopback)
        assert _arrived_tcp(mapped, time.monotonic() + 2) == 1, f"libslirp {slirp.version}: ::ffff:127.0.0.1"
        assert refused(v6("::ffff:169.254.169.254", 6, syn(40022, 80)), opened, local)

        # what slirp answers itself still passes, and is answered
        # (ethertype, protocol, at in the L4 header: bytes): to the guest's port 68, an RA, to its port 546
        answers = (("DHCP discover", libslirp.dhcp_discover(), b"\x08\x00", 17, 2, b"\x00\x44"),
                   ("router solicitation", libslirp.router_solicitation(), b"\x86\xdd", 58, 0, b"\x86"),
                   ("DHCPv6", libslirp.dhcpv6_information_request(), b"\x86\xdd", 17, 2, b"\x02\x22"))
        for name, frame, ethertype, proto, at, value in answers:
            assert not refused(frame, policy, local), name
            slirp.sent.clear()
            slirp.input(frame)
            ip4 = ethertype == b"\x08\x00"
            l4 = 34 if ip4 else 54  # after IPv4's 20 or IPv6's 40 bytes of header
            got = [f for f in slirp.sent if f[12:14] == ethertype and f[23 if ip4 else 20] == proto
                   and f[l4 + at:l4 + at + len(value)] == value]
            assert got, f"libslirp {slirp.version}: no answer to {name}: {slirp.sent}"


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
    # (extra_args naming a host path, here the sockets: the administrator's case for running QEMU
    # outside its Landlock domain, docs/spec.md)
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off",
                              "network": {"enabled": False}, "extra_args": nic},
                             env={"VMSIDECAR_QEMU_CONFINEMENT": "off"})
    await rt.client().wait_ready(180)
    con = await Console.open(rt.shared / "console.sock")
    await con.wake()
    # no DHCP answer comes back; a static address tries the outside directly
    await con.run("sleep 2; ip addr add 10.0.2.15/24 dev eth0; ip route add default via 10.0.2.2")
    got = await _nc(con, outside.address, outside.port)
    assert outside.token not in got and not outside.connected, f"a frame passed an unattached guard: {got!r}"
    await con.close()
