"""The in-test controller: ``jumpstarter.v1.ControllerService`` and ``jumpstarter.client.v1.ClientService``.

What 0.9.0 really calls (read from the wheels):

* ``jmp run`` (``jumpstarter/exporter/exporter.py``): ``Register``, ``ReportStatus``, ``Status``
  (server stream), ``Listen`` (server stream, per lease), ``ReleaseLease`` (after the lease,
  falling back to ``ReportStatus(release_lease=true)`` on PERMISSION_DENIED/UNIMPLEMENTED/...),
  ``Unregister`` (on SIGINT/SIGTERM/SIGHUP shutdown).
* clients (``jumpstarter/client/lease.py``, ``config/client.py``): ``ClientService.CreateLease``,
  ``GetLease`` (polled until condition Ready=True), ``GetExporter`` (labels), ``DeleteLease``
  (when the client created the lease), ``ListLeases`` (``jmp shell`` without selector/lease),
  ``ListExporters`` (``jmp get exporters``), then ``ControllerService.Dial`` for every connection.

Everything runs on one asyncio loop (the gRPC server's). ``Registry`` keeps the state, and
every mutation is done under ``Registry.cond`` so test threads can wait on it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import grpc
from google.protobuf import duration_pb2, empty_pb2, timestamp_pb2
from jumpstarter_protocol.jumpstarter.client.v1 import client_pb2, client_pb2_grpc
from jumpstarter_protocol.jumpstarter.v1 import (
    common_pb2,
    jumpstarter_pb2,
    jumpstarter_pb2_grpc,
    kubernetes_pb2,
)

from .router import Router, bearer_token

logger = logging.getLogger(__name__)

_STATUS_PREFIX = "EXPORTER_STATUS_"
# Dial answers FAILED_PRECONDITION "exporter not ready" (which 0.9.0 clients retry) in these states.
_NOT_READY = {"OFFLINE", "AVAILABLE", "UNSPECIFIED"}


def status_name(value: int) -> str:
    return common_pb2.ExporterStatus.Name(value).removeprefix(_STATUS_PREFIX)


@dataclass(frozen=True)
class Identity:
    kind: str  # "Exporter" | "Client"
    namespace: str
    name: str
    token: str


def identity(context: grpc.aio.ServicerContext) -> Identity:
    """Who is calling: 0.9.0 sends jumpstarter-kind/-namespace/-name plus a bearer token. Any token is accepted."""
    md = dict(context.invocation_metadata() or ())
    return Identity(md.get("jumpstarter-kind", ""), md.get("jumpstarter-namespace", "default"),
                    md.get("jumpstarter-name", ""), bearer_token(context))


@dataclass
class ExporterRecord:
    name: str
    namespace: str = "default"
    uuid: str = field(default_factory=lambda: str(uuid.uuid4()))
    token: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    reports: list = field(default_factory=list)
    registered: bool = False
    register_count: int = 0
    status: str = "OFFLINE"
    status_message: str = ""
    status_log: list[tuple[float, str, str]] = field(default_factory=list)  # (monotonic, status, message)
    events: list[tuple[float, str]] = field(default_factory=list)  # (monotonic, "register" | "unregister" | ...)
    lease: str | None = None
    streams: list[asyncio.Queue] = field(default_factory=list)  # open Status streams

    @property
    def online(self) -> bool:
        return bool(self.streams)


@dataclass
class LeaseRecord:
    name: str
    namespace: str
    client: str
    duration: timedelta
    selector: str = ""
    exporter_name: str = ""  # requested exporter, if any
    exporter: str | None = None  # assigned exporter
    created: datetime = field(default_factory=lambda: datetime.now(UTC))
    begin: datetime | None = None
    end: datetime | None = None
    assigned_at: float | None = None  # monotonic
    released_at: float | None = None  # monotonic
    released_by: str = ""
    dials: int = 0
    listen: asyncio.Queue = field(default_factory=asyncio.Queue)  # ListenResponses for the exporter
    timer: asyncio.TimerHandle | None = None

    @property
    def active(self) -> bool:
        return self.end is None


def _labels_match(selector: str, labels: dict[str, str]) -> bool:
    """The equality subset of Kubernetes label selectors: ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = (s.strip() for s in term.split("!=", 1))
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = (s.strip() for s in term.replace("==", "=").split("=", 1))
            if labels.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


class Registry:
    """All controller state. Mutated on the event loop; read from any thread under ``cond``."""

    def __init__(self, router: Router, router_endpoint: str = ""):
        self.router = router
        self.router_endpoint = router_endpoint
        self.cond = threading.Condition()
        self.exporters: dict[str, ExporterRecord] = {}
        self.leases: dict[str, LeaseRecord] = {}
        self.clients: dict[str, str] = {}  # client name -> last token seen
        self._ids = itertools.count(1)

    # -- exporters ---------------------------------------------------------------------
    def exporter(self, name: str) -> ExporterRecord:
        with self.cond:
            if name not in self.exporters:
                self.exporters[name] = ExporterRecord(name)
            return self.exporters[name]

    def event(self, rec: ExporterRecord, what: str) -> None:
        with self.cond:
            rec.events.append((time.monotonic(), what))
            self.cond.notify_all()

    def set_status(self, rec: ExporterRecord, status: str, message: str) -> None:
        with self.cond:
            rec.status, rec.status_message = status, message
            rec.status_log.append((time.monotonic(), status, message))
            self.cond.notify_all()
        self.schedule()

    def status_msg(self, rec: ExporterRecord) -> jumpstarter_pb2.StatusResponse:
        lease = self.leases.get(rec.lease) if rec.lease else None
        if lease is None:
            return jumpstarter_pb2.StatusResponse(leased=False)
        return jumpstarter_pb2.StatusResponse(leased=True, lease_name=lease.name, client_name=lease.client)

    def push_status(self, rec: ExporterRecord) -> None:
        msg = self.status_msg(rec)
        for q in rec.streams:
            q.put_nowait(msg)

    # -- leases ------------------------------------------------------------------------
    def create_lease(self, *, client: str, namespace: str = "default", duration: timedelta,
                     selector: str = "", exporter_name: str = "", name: str = "") -> LeaseRecord:
        name = name or f"lease-{next(self._ids)}-{secrets.token_hex(3)}"
        if name in self.leases:
            raise ValueError(f"lease {name} exists")
        lease = LeaseRecord(name=name, namespace=namespace, client=client, duration=duration,
                            selector=selector, exporter_name=exporter_name)
        with self.cond:
            self.leases[name] = lease
            self.cond.notify_all()
        self.schedule()
        return lease

    def candidates(self, lease: LeaseRecord) -> list[ExporterRecord]:
        return [
            x for x in self.exporters.values()
            if (not lease.exporter_name or x.name == lease.exporter_name) and _labels_match(lease.selector, x.labels)
        ]

    def schedule(self) -> None:
        """Assign pending leases to registered, online, AVAILABLE, unleased exporters (oldest lease first)."""
        for lease in sorted(self.leases.values(), key=lambda lease: lease.created):
            if not lease.active or lease.exporter:
                continue
            for x in self.candidates(lease):
                if x.registered and x.online and x.status == "AVAILABLE" and x.lease is None:
                    self._assign(lease, x)
                    break

    def _assign(self, lease: LeaseRecord, x: ExporterRecord) -> None:
        with self.cond:
            lease.exporter, lease.begin, lease.assigned_at = x.name, datetime.now(UTC), time.monotonic()
            x.lease = lease.name
            self.cond.notify_all()
        logger.info("lease %s assigned to %s (client %s)", lease.name, x.name, lease.client)
        lease.timer = asyncio.get_running_loop().call_later(
            lease.duration.total_seconds(), self.release, lease.name, "expired")
        self.push_status(x)

    def release(self, name: str, by: str) -> LeaseRecord | None:
        """End a lease (idempotent) and tell its exporter ``leased=False``."""
        lease = self.leases.get(name)
        if lease is None or not lease.active:
            return lease
        with self.cond:
            lease.end, lease.released_at, lease.released_by = datetime.now(UTC), time.monotonic(), by
            x = self.exporters.get(lease.exporter) if lease.exporter else None
            if x is not None and x.lease == name:
                x.lease = None
            self.cond.notify_all()
        if lease.timer:
            lease.timer.cancel()
        logger.info("lease %s released by %s", name, by)
        if x is not None:
            self.push_status(x)
        self.schedule()
        return lease

    def lease_pb(self, lease: LeaseRecord) -> client_pb2.Lease:
        def ts(d: datetime) -> timestamp_pb2.Timestamp:
            t = timestamp_pb2.Timestamp()
            t.FromDatetime(d)
            return t

        dur = duration_pb2.Duration()
        dur.FromTimedelta(lease.duration)
        ns = lease.namespace
        if lease.end is not None:
            conditions = [("Ready", "False", "Released", f"released by {lease.released_by}")]
        elif lease.exporter:
            conditions = [("Pending", "False", "Ready", ""), ("Ready", "True", "Ready", "")]
        else:
            conditions = [("Pending", "True", "Pending", "waiting for an available exporter")]
        pb = client_pb2.Lease(
            name=f"namespaces/{ns}/leases/{lease.name}",
            selector=lease.selector,
            duration=dur,
            client=f"namespaces/{ns}/clients/{lease.client}",
            exporter=f"namespaces/{ns}/exporters/{lease.exporter}" if lease.exporter else "",
            exporter_name=lease.exporter_name,
            conditions=[kubernetes_pb2.Condition(type=t, status=s, reason=r, message=m) for t, s, r, m in conditions],
        )
        if lease.begin:
            pb.effective_begin_time.CopyFrom(ts(lease.begin))
        if lease.end:
            pb.effective_end_time.CopyFrom(ts(lease.end))
        return pb


def _last(name: str) -> str:
    """``namespaces/ns/leases/x`` -> ``x``; plain names pass through."""
    return name.rsplit("/", 1)[-1]


class ControllerService(jumpstarter_pb2_grpc.ControllerServiceServicer):
    def __init__(self, reg: Registry):
        self.reg = reg

    def _exporter(self, context) -> ExporterRecord:
        who = identity(context)
        rec = self.reg.exporter(who.name)
        rec.namespace, rec.token = who.namespace, who.token
        return rec

    async def Register(self, request, context):
        rec = self._exporter(context)
        with self.reg.cond:
            rec.labels, rec.reports = dict(request.labels), list(request.reports)
            rec.registered = True
            rec.register_count += 1
        self.reg.event(rec, "register")
        logger.info("exporter %s registered (%d drivers)", rec.name, len(rec.reports))
        self.reg.schedule()
        return jumpstarter_pb2.RegisterResponse(uuid=rec.uuid)

    async def Unregister(self, request, context):
        rec = self._exporter(context)
        with self.reg.cond:
            rec.registered = False
        self.reg.event(rec, f"unregister: {request.reason}")
        return jumpstarter_pb2.UnregisterResponse()

    async def ReportStatus(self, request, context):
        rec = self._exporter(context)
        self.reg.set_status(rec, status_name(request.status), request.message)
        if request.release_lease and rec.lease:  # deprecated release path of older controllers
            self.reg.release(rec.lease, "exporter (ReportStatus.release_lease)")
        return jumpstarter_pb2.ReportStatusResponse()

    async def Status(self, request, context):
        rec = self._exporter(context)
        q: asyncio.Queue = asyncio.Queue()
        with self.reg.cond:
            rec.streams.append(q)
            self.reg.cond.notify_all()
        self.reg.event(rec, "status stream open")
        try:
            q.put_nowait(self.reg.status_msg(rec))
            self.reg.schedule()
            while True:
                yield await q.get()
        finally:
            with self.reg.cond:
                rec.streams.remove(q)
                self.reg.cond.notify_all()
            self.reg.event(rec, "status stream closed")

    async def Listen(self, request, context):
        rec = self._exporter(context)
        lease = self.reg.leases.get(request.lease_name)
        if lease is None or lease.exporter != rec.name:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "lease is not assigned to this exporter")
        # Stays open after the lease ends: the exporter cancels Listen itself when it handles leased=False.
        while True:
            yield await lease.listen.get()

    async def Dial(self, request, context):
        who = identity(context)
        lease = self.reg.leases.get(request.lease_name)
        if lease is None or not lease.active or not lease.exporter:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no active lease with that name")
        if lease.client != who.name:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "permission denied: lease held by another client")
        if self.reg.exporters[lease.exporter].status in _NOT_READY:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "exporter not ready")
        token = secrets.token_urlsafe(24)
        self.reg.router.expect(token)
        with self.reg.cond:
            lease.dials += 1
        lease.listen.put_nowait(jumpstarter_pb2.ListenResponse(
            router_endpoint=self.reg.router_endpoint, router_token=token))
        return jumpstarter_pb2.DialResponse(router_endpoint=self.reg.router_endpoint, router_token=token)

    async def ReleaseLease(self, request, context):
        rec = self._exporter(context)
        lease = self.reg.leases.get(_last(request.name))
        if lease is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such lease")
        if lease.exporter != rec.name:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "lease is not assigned to this exporter")
        self.reg.release(lease.name, f"exporter {rec.name}")
        return jumpstarter_pb2.ReleaseLeaseResponse()

    async def AuditStream(self, request_iterator, context):
        async for _ in request_iterator:
            pass
        return empty_pb2.Empty()


class ClientService(client_pb2_grpc.ClientServiceServicer):
    def __init__(self, reg: Registry):
        self.reg = reg

    def _client(self, context) -> Identity:
        who = identity(context)
        with self.reg.cond:
            self.reg.clients[who.name] = who.token
        return who

    def _exporter_pb(self, x: ExporterRecord) -> client_pb2.Exporter:
        return client_pb2.Exporter(
            name=f"namespaces/{x.namespace}/exporters/{x.name}", labels=x.labels, online=x.online,
            status=common_pb2.ExporterStatus.Value(_STATUS_PREFIX + x.status), status_message=x.status_message,
            enabled=True,
        )

    async def GetExporter(self, request, context):
        self._client(context)
        x = self.reg.exporters.get(_last(request.name))
        if x is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such exporter")
        return self._exporter_pb(x)

    async def ListExporters(self, request, context):
        self._client(context)
        xs = [x for x in self.reg.exporters.values() if _labels_match(request.filter, x.labels)]
        return client_pb2.ListExportersResponse(exporters=[self._exporter_pb(x) for x in xs])

    async def GetLease(self, request, context):
        self._client(context)
        lease = self.reg.leases.get(_last(request.name))
        if lease is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such lease")
        return self.reg.lease_pb(lease)

    async def ListLeases(self, request, context):
        self._client(context)
        leases = [lease for lease in self.reg.leases.values() if lease.active or not request.only_active]
        return client_pb2.ListLeasesResponse(leases=[self.reg.lease_pb(lease) for lease in leases])

    async def CreateLease(self, request, context):
        who = self._client(context)
        spec = request.lease
        if not spec.selector and not spec.exporter_name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "selector or exporter_name required")
        try:
            lease = self.reg.create_lease(
                client=who.name, namespace=who.namespace, duration=spec.duration.ToTimedelta(),
                selector=spec.selector, exporter_name=spec.exporter_name, name=request.lease_id)
        except ValueError as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        return self.reg.lease_pb(lease)

    async def DeleteLease(self, request, context):
        who = self._client(context)
        lease = self.reg.leases.get(_last(request.name))
        if lease is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such lease")
        if lease.client != who.name:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "lease held by another client")
        self.reg.release(lease.name, f"client {who.name}")
        return empty_pb2.Empty()
