"""The guest's NIC guard: every frame the guest sends passes the runtime before QEMU's slirp.

QEMU's user networking (slirp) connects whatever the guest addresses from the pod, and maps some
addresses to the pod's loopback. libslirp 4.7.0 (Debian 12's, QEMU 7.2's; ``sotranslate_out``)
connects 10.0.2.2 *and the limited broadcast 255.255.255.255* to the pod's 127.0.0.1, every
fec0::/64 address but the DNS one *and the all-nodes multicast ff02::1* to ::1, and 10.0.2.3 /
fec0::3 port 53 to the pod's resolver (other ports there are not connected); other 10.0.2.x are
connected as they are (older slirps mapped the whole 10.0.2.0/24 to 127.0.0.1). Multicast it sends
as any socket does, and the pod's kernel loops it back to the pod's own sockets on 0.0.0.0 / ::;
``::ffff:a.b.c.d`` it connects from an IPv6 socket, which the kernel turns into IPv4 a.b.c.d. So a
guest — whose root is the lease holder — reaches every loopback listener of the pod (the exporter's
gRPC port in standalone mode, health ports), and the cloud metadata service. QEMU 7.2 cannot turn
the loopback mapping off (libslirp's ``disable_host_loopback`` is not exposed), and passt, the other
unprivileged user-mode stack (Debian 12: 0.0~git20230309), still connects 127.0.0.1 for a guest
that routes it out of eth0, never completes an inbound port forward here, and needs user
namespaces that Kubernetes' default seccomp profile forbids (docs/decisions.md).

So the NIC keeps slirp, and a QEMU ``filter-redirector`` on the netdev's receive queue sends each
frame from the guest to the runtime (``net-out`` socket) instead of slirp; :class:`NetGuard`
passes the allowed ones back (``net-in``, on to slirp) and answers the refused ones with an ICMP
"administratively prohibited" to the guest (``net-back``: the guest's connect fails at once
rather than timing out; never for a broadcast or multicast). slirp's frames to the guest are not
filtered: they answer what passed. When the runtime is not connected, QEMU drops the guest's
frames: the guard fails closed.

What the guest may not reach (:func:`refused`): the pod's loopback (127.0.0.0/8, 0.0.0.0/8,
::/96 with ::1, IPv4-mapped IPv6), the pod's own addresses (every local address of the runtime's
network namespace — a listener bound to 0.0.0.0, like a standalone exporter's gRPC port, answers
there too; re-read every few seconds, as a laptop's change), broadcast and multicast (the limited
broadcast 255.255.255.255, 224.0.0.0/4, ff00::/8: slirp's or the kernel's way back to the pod,
except what slirp answers itself: DHCP to 255.255.255.255:67, DHCPv6 to ff02::1:2 port 547, and
ICMPv6 — neighbour discovery — which slirp never forwards), slirp's aliases of it (new connections
to 10.0.2.0/24 and fec0::/64, except ICMP, DHCP to the gateway and DNS port 53 at 10.0.2.3 /
fec0::3; the guest's side of a port forward's connection, which slirp shows as coming from
10.0.2.2, passes), and unless the spec allows it the metadata service (link-local
169.254.0.0/16, fd00:ec2::254, fd20:ce::254). An IPv4 address inside IPv6 (IPv4-mapped
::ffff:0:0/96, IPv4-compatible ::/96, NAT64's 64:ff9b::/96) is judged as that IPv4 address too.
``network.allow_host_loopback`` opens all but the metadata service again (slirp as it was).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from dataclasses import dataclass
from ipaddress import IPv4Address
from pathlib import Path

from vmsidecar_contract.errors import HostError
from vmsidecar_contract.reach import EMBEDDING_V6, METADATA_V6
from vmsidecar_contract.spec import Network

from ..plan import BootPlan

log = logging.getLogger(__name__)

#: slirp's guest network (QEMU's defaults, which the runtime keeps)
SLIRP_NET = int(IPv4Address("10.0.2.0"))
GATEWAY = "10.0.2.2"
DNS = int(IPv4Address("10.0.2.3"))
_GATEWAY_INT = int(IPv4Address(GATEWAY))
SLIRP_NET6 = socket.inet_pton(socket.AF_INET6, "fec0::")[:8]
DNS6 = socket.inet_pton(socket.AF_INET6, "fec0::3")
#: the filter's chardevs, QEMU's ids (sockets: ``BootPlan.console_socket(id)``)
CHARDEV_OUT, CHARDEV_IN, CHARDEV_BACK = "net-out", "net-in", "net-back"
#: a frame larger than this is a broken stream (QEMU's frames are at most 64 KiB)
MAX_FRAME = 1 << 17

_TCP, _UDP, _ICMP, _ICMP6 = 6, 17, 1, 58
_ETH_IPV4, _ETH_IPV6 = 0x0800, 0x86DD
#: ARP, and RARP: QEMU's own announcements after a restore (slirp ignores them)
_ETH_ADDRESSING = (0x0806, 0x8035)
_V6_METADATA = frozenset(socket.inet_pton(socket.AF_INET6, a) for a in METADATA_V6)
_V6_ZERO96 = bytes(12)
_V6_MAPPED = bytes(10) + b"\xff\xff"
#: IPv6 prefixes whose last 32 bits are an IPv4 address some part of the pod's network connects
#: (``reach.EMBEDDING_V6``: IPv4-compatible, IPv4-mapped, NAT64's well-known prefix)
_V6_EMBEDDING = tuple(socket.inet_pton(socket.AF_INET6, prefix)[:12] for prefix in EMBEDDING_V6)
_BROADCAST = 0xFFFFFFFF
_SLIRP_BROADCAST = SLIRP_NET | 0xFF
#: DHCPv6's all-servers-and-relays group (link scope), which slirp answers itself
_DHCP6_GROUP = socket.inet_pton(socket.AF_INET6, "ff02::1:2")
_DHCP_PORT, _DHCP6_PORT = 67, 547


#: how often the pod's own addresses are read again (a laptop's Wi-Fi changes them)
LOCAL_REFRESH_S = 5.0
#: the refused frames' count is logged at most this often (a guest refused 470 frames a millisecond)
COUNT_EVERY_S = 10.0


@dataclass(frozen=True)
class LocalAddresses:
    """The addresses of the runtime's own network namespace (the pod's, or the laptop's)."""

    v4: frozenset[int] = frozenset()
    v6: frozenset[bytes] = frozenset()

    @classmethod
    def read(cls, proc: Path = Path("/proc/net")) -> LocalAddresses:
        """From the kernel's tables: IPv4 ``LOCAL`` routes (fib_trie), IPv6 interface addresses."""
        v4: set[int] = set()
        with contextlib.suppress(OSError):
            last = None
            for line in (proc / "fib_trie").read_text().splitlines():
                text = line.strip()
                if text.startswith(("|--", "+--")):
                    last = text[3:].strip().split("/")[0]
                elif text == "/32 host LOCAL" and last:
                    with contextlib.suppress(ValueError):
                        v4.add(int(IPv4Address(last)))
        v6: set[bytes] = set()
        with contextlib.suppress(OSError, ValueError):
            for line in (proc / "if_inet6").read_text().splitlines():
                v6.add(bytes.fromhex(line.split()[0]))
        return cls(frozenset(v4), frozenset(v6))


NO_LOCAL = LocalAddresses()


def _bare_syn(flags: int) -> bool:
    return bool(flags & 0x02 and not flags & 0x10)


def _metadata4(dst: int) -> bool:
    return dst >> 16 == 0xA9FE  # 169.254.0.0/16


def _group4(dst: int) -> bool:
    """A broadcast or multicast address: slirp's (10.0.2.255), the limited one, 224.0.0.0/4."""
    return dst in (_BROADCAST, _SLIRP_BROADCAST) or dst >> 28 == 0xE


def _pods4(dst: int, local: LocalAddresses) -> bool:
    """The pod itself: its loopback, 0.0.0.0/8, its own addresses, and multicast and the limited
    broadcast, which slirp (255.255.255.255 is its 127.0.0.1) or the pod's kernel (multicast loops
    back to the pod's sockets on 0.0.0.0) deliver to the pod's listeners."""
    return dst >> 24 in (0, 127) or dst in local.v4 or dst == _BROADCAST or dst >> 28 == 0xE


def _port(l4: bytes) -> int:
    return int.from_bytes(l4[2:4], "big") if len(l4) >= 4 else 0


def _refused4(frame: bytes, policy: Network, local: LocalAddresses) -> bool:
    if len(frame) < 34 or frame[14] >> 4 != 4:
        return True
    ihl = (frame[14] & 0xF) * 4
    proto, dst = frame[23], int.from_bytes(frame[30:34], "big")
    if not policy.allow_metadata and _metadata4(dst):
        return True
    if policy.allow_host_loopback:
        return False
    # No fragments to the pod's aliases: only a whole packet shows its real ports and TCP flags
    fragment = bool(int.from_bytes(frame[20:22], "big") & 0x3FFF)
    l4 = frame[14 + ihl:]
    if dst == _BROADCAST:  # a DHCP client's discover and request, which slirp's bootp answers itself
        return fragment or not (proto == _UDP and _port(l4) == _DHCP_PORT)
    if _pods4(dst, local):
        return True
    if dst >> 8 != SLIRP_NET >> 8:
        return False
    # slirp's own network: its gateway and DNS addresses are aliases of the pod's loopback and
    # resolver (every other address was, in older slirps)
    if fragment:
        return True
    if proto == _ICMP:  # slirp answers pings itself or pings for real: no service is reached
        return False
    port = _port(l4)
    if proto in (_TCP, _UDP) and dst == DNS and port == 53:
        return False
    if proto == _UDP and dst == _GATEWAY_INT and port == _DHCP_PORT:  # DHCP renewals
        return False
    # a port forward's connection comes from 10.0.2.2: the guest's side of it passes
    return not (proto == _TCP and dst == _GATEWAY_INT and len(l4) >= 14 and not _bare_syn(l4[13]))


def _embedded4(dst: bytes) -> int | None:
    """The IPv4 address inside an IPv6 one (:data:`_V6_EMBEDDING`), or None."""
    return int.from_bytes(dst[12:], "big") if dst[:12] in _V6_EMBEDDING else None


def _refused6(frame: bytes, policy: Network, local: LocalAddresses) -> bool:
    if len(frame) < 54 or frame[14] >> 4 != 6:
        return True
    dst = bytes(frame[38:54])
    v4 = _embedded4(dst)
    if not policy.allow_metadata and (dst in _V6_METADATA or (v4 is not None and _metadata4(v4))):
        return True
    if policy.allow_host_loopback:
        return False
    if dst[:12] in (_V6_ZERO96, _V6_MAPPED) or dst in local.v6 or (v4 is not None and _pods4(v4, local)):
        return True
    next_header, l4 = frame[20], frame[54:]
    # slirp takes no extension header: it drops any other next header (fragments among them)
    if next_header == _ICMP6:  # neighbour discovery with slirp; it never forwards ICMPv6
        return False
    port = _port(l4)
    if dst[0] == 0xFF:  # multicast: slirp connects ff02::1 to ::1, the kernel loops the rest back
        return not (next_header == _UDP and dst == _DHCP6_GROUP and port == _DHCP6_PORT)
    if dst[:8] != SLIRP_NET6:
        return False
    return not (next_header in (_TCP, _UDP) and dst == DNS6 and port == 53)


def refused(frame: bytes, policy: Network, local: LocalAddresses = NO_LOCAL) -> bool:
    """Whether a frame the guest sends must not reach slirp under ``policy`` (the spec's network)
    in a pod whose own addresses are ``local``: anything but (R)ARP, IPv4 and IPv6, and packets to
    what the module doc lists."""
    if len(frame) < 14:
        return True
    ethertype = int.from_bytes(frame[12:14], "big")
    if ethertype in _ETH_ADDRESSING:
        return False
    if ethertype == _ETH_IPV4:
        return _refused4(frame, policy, local)
    if ethertype == _ETH_IPV6:
        return _refused6(frame, policy, local)
    return True


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _with_checksum(packet: bytes, at: int, pseudo: bytes = b"") -> bytes:
    return packet[:at] + struct.pack("!H", _checksum(pseudo + packet)) + packet[at + 2:]


def refusal(frame: bytes) -> bytes | None:
    """The ICMP "administratively prohibited" answer to a refused IPv4/IPv6 packet, from the
    gateway to the guest, or None (nothing to answer: not IP, ICMP itself, or a packet to a
    broadcast or multicast address, which ICMP errors never answer: RFC 1122 3.2.2, RFC 4443 2.4)."""
    eth = frame[6:12] + frame[0:6] + frame[12:14]
    ethertype = int.from_bytes(frame[12:14], "big")
    if ethertype == _ETH_IPV4 and len(frame) >= 34 and frame[14] >> 4 == 4:
        ihl = (frame[14] & 0xF) * 4
        if frame[23] == _ICMP or len(frame) < 14 + ihl or _group4(int.from_bytes(frame[30:34], "big")):
            return None
        icmp = _with_checksum(struct.pack("!BBHI", 3, 13, 0, 0) + bytes(frame[14:14 + ihl + 8]), 2)
        header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(icmp), 0, 0, 64, _ICMP, 0,
                             socket.inet_aton(GATEWAY), bytes(frame[26:30]))
        return eth + _with_checksum(header, 10) + icmp
    if ethertype == _ETH_IPV6 and len(frame) >= 54 and frame[14] >> 4 == 6:
        if frame[20] == _ICMP6 or frame[38] == 0xFF:  # neighbour discovery among others; multicast
            return None
        src, dst = bytes(frame[38:54]), bytes(frame[22:38])  # from the refused address back
        icmp = struct.pack("!BBHI", 1, 1, 0, 0) + bytes(frame[14:14 + 1232])
        icmp = _with_checksum(icmp, 2, src + dst + struct.pack("!I3xB", len(icmp), _ICMP6))
        return eth + struct.pack("!IHBB", 6 << 28, len(icmp), _ICMP6, 64) + src + dst + icmp
    return None


def qemu_args(plan: BootPlan, netdev: str) -> list[str]:
    """The chardevs and the filter that send the guest's frames on ``netdev`` through the runtime
    (QEMU serves the sockets in the private run dir; the runtime connects before the guest runs)."""
    chardevs = [arg for ident in (CHARDEV_OUT, CHARDEV_IN, CHARDEV_BACK) for arg in
                ("-chardev", f"socket,id={ident},path={plan.console_socket(ident)},server=on,wait=off")]
    return [
        *chardevs,
        # queue rx: what the guest sends to slirp goes out to the runtime; what comes in is
        # passed on to slirp
        "-object", f"filter-redirector,id=netguard-out,netdev={netdev},queue=rx,outdev={CHARDEV_OUT},indev={CHARDEV_IN}",
        # queue tx, no outdev: slirp's frames pass; the runtime's refusals come in for the guest
        "-object", f"filter-redirector,id=netguard-back,netdev={netdev},queue=tx,indev={CHARDEV_BACK}",
    ]


@dataclass
class _Pipes:
    out: asyncio.StreamReader
    into: asyncio.StreamWriter
    back: asyncio.StreamWriter


class NetGuard:
    """The runtime's side of one QEMU's NIC filter: reads the guest's frames, passes or refuses them."""

    def __init__(self, plan: BootPlan) -> None:
        self.plan = plan
        self.policy = plan.spec.network
        #: frames refused since the start (for the log), and of them those to a group address
        self.refused = 0
        self.refused_to_groups = 0
        self._counted_at = -COUNT_EVERY_S
        self._local = LocalAddresses.read()
        self._local_read_at = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def attach(self) -> None:
        """Connect to QEMU's three filter sockets (QEMU is up, the guest not yet running).

        :raise HostError: when a socket does not answer.
        """
        try:
            out_r, out_w = await asyncio.open_unix_connection(str(self.plan.console_socket(CHARDEV_OUT)))
            self._writers.append(out_w)
            _, in_w = await asyncio.open_unix_connection(str(self.plan.console_socket(CHARDEV_IN)))
            self._writers.append(in_w)
            _, back_w = await asyncio.open_unix_connection(str(self.plan.console_socket(CHARDEV_BACK)))
            self._writers.append(back_w)
        except OSError as e:
            await self.close()
            raise HostError(f"cannot attach the guest NIC's filter ({e}); check the runtime log for QEMU's stderr") from e
        pipes = _Pipes(out_r, in_w, back_w)
        self._task = asyncio.create_task(self._pump(pipes), name="netguard")

    async def _pump(self, pipes: _Pipes) -> None:
        buf = bytearray()
        with contextlib.suppress(ConnectionError):
            while chunk := await pipes.out.read(1 << 16):
                buf += chunk
                passed, answers, pos = bytearray(), bytearray(), 0
                while len(buf) - pos >= 4:
                    size = int.from_bytes(buf[pos:pos + 4], "big")
                    if size > MAX_FRAME:
                        log.error("the guest NIC's filter stream is broken (a %d-byte frame); the NIC stops", size)
                        return
                    if len(buf) - pos - 4 < size:
                        break
                    frame = bytes(buf[pos + 4:pos + 4 + size])
                    if refused(frame, self.policy, self._local_addresses()):
                        self._count(frame)
                        if (answer := refusal(frame)) is not None:
                            answers += len(answer).to_bytes(4, "big") + answer
                    else:
                        passed += buf[pos:pos + 4 + size]
                    pos += 4 + size
                del buf[:pos]
                for writer, data in ((pipes.into, passed), (pipes.back, answers)):
                    if data:
                        writer.write(data)
                        await writer.drain()

    def _local_addresses(self) -> LocalAddresses:
        if time.monotonic() - self._local_read_at > LOCAL_REFRESH_S:
            self._local, self._local_read_at = LocalAddresses.read(), time.monotonic()
        return self._local

    def _count(self, frame: bytes) -> None:
        # a guest's OS sends multicast at every boot (MLD, IGMP, mDNS, SSDP): one line says so, and
        # the first lines stay for what a guest aims at the pod's or another host's own addresses
        self.refused += 1
        if _to_group(frame):
            self.refused_to_groups += 1
            if self.refused_to_groups == 1:
                log.info("guest NIC: refused a frame to %s (broadcast and multicast leave the guest's network; "
                         "the next ones are only counted)", _destination(frame))
        elif self.refused - self.refused_to_groups <= 5:
            log.info("guest NIC: refused a frame to %s (%d so far)", _destination(frame), self.refused)
        now = time.monotonic()
        if self.refused % 1000 == 0 and now - self._counted_at >= COUNT_EVERY_S:  # a flood logs no flood
            self._counted_at = now
            log.info("guest NIC: %d frames refused so far, %d of them to broadcast or multicast addresses",
                     self.refused, self.refused_to_groups)

    async def close(self) -> None:
        """Stop reading and close the sockets (QEMU is gone or going). Idempotent."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for writer in self._writers:
            writer.close()
        self._writers = []


def _to_group(frame: bytes) -> bool:
    """Whether an IP frame is addressed to a broadcast or multicast address."""
    ethertype = int.from_bytes(frame[12:14], "big") if len(frame) >= 14 else 0
    if ethertype == _ETH_IPV4 and len(frame) >= 34:
        return _group4(int.from_bytes(frame[30:34], "big"))
    return ethertype == _ETH_IPV6 and len(frame) >= 54 and frame[38] == 0xFF


def _destination(frame: bytes) -> str:
    ethertype = int.from_bytes(frame[12:14], "big") if len(frame) >= 14 else 0
    if ethertype == _ETH_IPV4 and len(frame) >= 34:
        return socket.inet_ntoa(frame[30:34])
    if ethertype == _ETH_IPV6 and len(frame) >= 54:
        return socket.inet_ntop(socket.AF_INET6, frame[38:54])
    return f"ethertype {ethertype:#06x}"


def guarded(plan: BootPlan) -> bool:
    """Whether this boot's NIC goes through the guard (always, unless the spec opens everything)."""
    network = plan.spec.network
    return network.enabled and not (network.allow_host_loopback and network.allow_metadata)
