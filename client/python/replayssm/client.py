"""The client of replayssm-server: one method per RPC of replayssm.v1's ReplaySsm and Regions
services and the client-facing ones of SlotTransfer, numpy/torch tensors inline, typed errors.

Request ids: every mutating call takes `request_id`; when None a fresh one is made once per call
and reused by its retries (replayssm.retry). A call that still fails raises an error carrying
the id it sent (`.request_id`): pass it again to retry by hand.

Thread safety: a Client may be shared by threads; a ForwardStream is driven by one at a time.
"""

import collections
import warnings

import grpc

from replayssm import _health_pb2 as health_pb2
from replayssm import errors, tensors
from replayssm.results import Allocation, DecodeResult, ExportedState, PrefillResult
from replayssm.retry import new_request_id, with_retries
from replayssm.stream import ForwardStream, _Deadlines, draft_count, make_rows
from replayssm.v1 import replayssm_pb2 as pb
from replayssm.v1 import regions_pb2
from replayssm.v1 import regions_pb2_grpc
from replayssm.v1 import replayssm_pb2_grpc as pb_grpc
from replayssm.v1 import transfer_pb2
from replayssm.v1 import transfer_pb2_grpc


def _ints(values):
    """Python ints for repeated integer fields (numpy integers and tensors included)."""
    return [int(v) for v in values]


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                         "compression")), grpc.ClientCallDetails):
    pass


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call of a channel."""

    def __init__(self, token):
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, d):
        metadata = list(d.metadata or []) + [self._header]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


class _TypedStream:
    """A server-streaming call whose failure is raised as its typed error, as unary calls'
    are; the call's own methods (cancel(), code(), ...) pass through."""

    def __init__(self, call, method):
        self._call = call
        self._method = method

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._call)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, self._method) from None

    def __getattr__(self, name):
        return getattr(self._call, name)


def check_token(token, field="token"):
    """A bearer token gRPC can send: printable ASCII without spaces (as the C++ client's
    CheckToken). Anything else raised an untyped error from gRPC on every call, and gRPC
    logged the token's bytes."""
    for i, c in enumerate(token):
        if not 0x21 <= ord(c) <= 0x7e:
            raise ValueError(f"Client: {field}: expected a token of printable ASCII without "
                             f"spaces, got character 0x{ord(c):02x} at offset {i}")
    return token


def read_token_file(path):
    """The bearer token in `path`: the file's text without surrounding whitespace (one line:
    a token is printable ASCII without spaces)."""
    with open(path, encoding="utf-8") as f:
        token = f.read().strip()
    if not token:
        raise ValueError(f"token_file: expected a file holding a token, got an empty {path!r}")
    return check_token(token, "token_file")


class Client:
    """A connection to one replayssm-server.

    address: host:port (an insecure channel); or pass `channel` (e.g. with credentials or
    interceptors). timeout: seconds per unary call and per stream reply. retries: extra
    attempts of a call that failed with UNAVAILABLE or DEADLINE_EXCEEDED, `retry_backoff`
    seconds apart, doubling.
    aborted_wait: seconds a call answered ABORTED (its request id still in flight on the
    server) keeps retrying, backing off from `retry_backoff` to 1 s (None: `timeout`, the time
    the attempt in flight may take; 60 s without one). retries=0 turns every retry off
    (replayssm.retry).
    keepalive: seconds without traffic after which the channel pings the server (None: never);
    a ping unanswered for 10 s ends every call on the channel with Unavailable. Without it a
    server gone without closing the connection (power, a partition) left watch_cache and
    streams waiting for ever. The server accepts pings every 10 s at most; a `channel` passed
    in keeps its own settings.
    """

    def __init__(self, address=None, *, channel=None, timeout=60.0, retries=2,
                 retry_backoff=0.05, aborted_wait=None, max_message_bytes=256 << 20,
                 tls_ca=None, tls_cert=None, tls_key=None, token=None, token_file=None,
                 keepalive=30.0):
        """tls_ca (PEM file of the server's CA; None with TLS on: the system roots),
        tls_cert + tls_key (this client's certificate, for a server that requires one): any
        of them turns TLS on (docs/operations.md, "Security and resource bounds").
        token, or token_file (a file holding it): the bearer token sent with every call, for a
        server with --auth-tokens; it names the tenant whose slots this client sees. An empty
        string for any of these is refused (ValueError): None is how to leave one out."""
        # "" would read as "not given" below: a plaintext channel, or calls without a token.
        for name, value in (("tls_ca", tls_ca), ("tls_cert", tls_cert), ("tls_key", tls_key),
                            ("token", token), ("token_file", token_file)):
            if value is not None and not str(value).strip():
                raise ValueError(f"Client: {name}: expected a non-empty value (or None to leave "
                                 f"it out), got {value!r}")
        if token is not None and token_file is not None:
            raise ValueError("Client: give token or token_file, not both")
        if token_file is not None:
            token = read_token_file(token_file)
        elif token is not None:
            check_token(token)
        if channel is None:
            if address is None:
                raise ValueError("Client: give an address or a channel")
            options = [("grpc.max_send_message_length", max_message_bytes),
                       ("grpc.max_receive_message_length", max_message_bytes)]
            if keepalive is not None:
                if not keepalive >= 10:
                    raise ValueError(f"Client: keepalive: expected None or at least 10 seconds "
                                     f"(the server's least ping interval), got {keepalive!r}")
                # Pings go on while the client sends nothing (a watch only receives): gRPC
                # stops after two pings without data of its own unless told otherwise.
                options += [("grpc.keepalive_time_ms", int(keepalive * 1000)),
                            ("grpc.keepalive_timeout_ms", 10000),
                            ("grpc.http2.max_pings_without_data", 0)]
            if tls_ca or tls_cert or tls_key:
                if bool(tls_cert) != bool(tls_key):
                    raise ValueError("Client: tls_cert and tls_key go together")

                def read(path):
                    with open(path, "rb") as f:
                        return f.read()

                credentials = grpc.ssl_channel_credentials(
                    root_certificates=read(tls_ca) if tls_ca else None,
                    private_key=read(tls_key) if tls_key else None,
                    certificate_chain=read(tls_cert) if tls_cert else None)
                channel = grpc.secure_channel(address, credentials, options=options)
            else:
                channel = grpc.insecure_channel(address, options=options)
        self._channel = channel
        if token:
            channel = grpc.intercept_channel(channel, _BearerToken(token))
        self.timeout = timeout
        self._deadlines = _Deadlines()  # streams' per-reply deadlines
        self.retries = retries
        self.retry_backoff = retry_backoff
        self.aborted_wait = aborted_wait
        self.stub = pb_grpc.ReplaySsmStub(channel)
        # SlotTransfer's server-to-server methods (Reserve/Commit/AbortTransfer) are used by
        # the sending server over UCX; this stub reaches them where a tool needs to.
        self.transfer_stub = transfer_pb2_grpc.SlotTransferStub(channel)
        self.regions_stub = regions_pb2_grpc.RegionsStub(channel)
        self._health_check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)
        self._info = None
        self._warned_mps = False

    def close(self):
        self._channel.close()
        self._deadlines.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def wait_ready(self, timeout=10.0):
        """True once the channel is connected, False when `timeout` seconds pass first."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
            return True
        except grpc.FutureTimeoutError:
            return False

    # ---- the call path ----

    def _call(self, method, rpc, request, retry=True):
        """rpc(request) under the retry policy; a failure raises its typed error, carrying the
        request's id when it has one."""
        request_id = getattr(request, "request_id", None)

        def attempt():
            try:
                return rpc(request, timeout=self.timeout)
            except grpc.RpcError as e:
                raise errors.from_rpc_error(e, method, request_id) from None

        return with_retries(attempt, self.retries if retry else 0, self.retry_backoff,
                            aborted_wait=self._aborted_wait())

    def _aborted_wait(self):
        if self.aborted_wait is not None:
            return self.aborted_wait
        return self.timeout if self.timeout is not None else 60.0

    def _layers(self, layers):
        act = self.model.act_dtype
        return [tensors.any_layer_input(i, x, act, f"layers[{i}]")
                for i, x in enumerate(layers)]

    @staticmethod
    def _outputs(replies, layers):
        """Reply LayerOutputs like their inputs: arrays (torch in, torch out), or the output
        RegionTensor of a layer given in regions."""
        return [tensors.layer_output(o.out, layers[o.layer], f"layers[{o.layer}].out")
                for o in replies]

    # ---- info ----

    def info(self):
        """GetInfo: the model (shapes, dtypes, layer parameters), backend, capacity, limits."""
        self._info = self._call("GetInfo", self.stub.GetInfo, pb.GetInfoRequest())
        return self._info

    @property
    def model(self):
        """The served ModelInfo (fetched once)."""
        if self._info is None:
            self.info()
        return self._info.model

    def stats(self):
        """GetStats: slots, folds, snapshots, forwards, draining."""
        return self._call("GetStats", self.stub.GetStats, pb.GetStatsRequest())

    def health(self, service=""):
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... (`service` "" = the server)."""
        reply = self._call("Health.Check", self._health_check,
                           health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    # ---- slots ----

    def allocate(self, prefix_tokens=None, *, request_id=None):
        """A new slot; with `prefix_tokens` it starts from the longest cached prefix of them."""
        request = pb.AllocateRequest(request_id=request_id or new_request_id())
        if prefix_tokens is not None:
            request.from_prefix = True
            request.prefix_tokens.extend(_ints(prefix_tokens))
        reply = self._call("Allocate", self.stub.Allocate, request)
        return Allocation(reply.slot, reply.matched)

    def free(self, slot, *, request_id=None):
        request = pb.FreeRequest(request_id=request_id or new_request_id(), slot=slot)
        self._call("Free", self.stub.Free, request)

    def get_slot(self, slot):
        """The slot's SlotState (seq_len, write_pos, pending_drafts)."""
        return self._call("GetSlot", self.stub.GetSlot, pb.GetSlotRequest(slot=slot)).state

    def list_slots(self):
        """Every live slot the server handed out: SlotListing (state, idle_seconds). Renews no
        lease."""
        return list(self._call("ListSlots", self.stub.ListSlots, pb.ListSlotsRequest()).slots)

    # ---- state import / export ----

    def import_state(self, slot, tokens, checkpoints, conv_windows=(), *, request_id=None):
        """Loads a state into `slot`: its tokens, one checkpoint [HV, V, K] per layer (cast
        to the state dtype) and, for a model with a short convolution, one conv window
        [W-1, C] per layer (cast to the act dtype; ExportedState.conv_windows). Returns the
        SlotState."""
        state_dtype = self.model.state_dtype
        request = pb.ImportRequest(request_id=request_id or new_request_id(), slot=slot,
                                   tokens=_ints(tokens))
        request.checkpoints.extend(tensors.to_proto(c, state_dtype, f"checkpoints[{i}]")
                                   for i, c in enumerate(checkpoints))
        request.conv_windows.extend(
            tensors.to_proto(w, self.model.act_dtype, f"conv_windows[{i}]")
            for i, w in enumerate(conv_windows))
        return self._call("Import", self.stub.Import, request).state

    def export_state(self, slot):
        """The slot's full state, folded first (write_pos is 0 afterwards)."""
        reply = self._call("Export", self.stub.Export, pb.ExportRequest(slot=slot))
        return ExportedState(reply.seq_len, list(reply.tokens),
                             [tensors.to_numpy(c, f"checkpoints[{i}]")
                              for i, c in enumerate(reply.checkpoints)],
                             [tensors.to_numpy(w, f"conv_windows[{i}]")
                              for i, w in enumerate(reply.conv_windows)])

    # ---- forwards ----

    def prefill(self, slot, tokens, layers, *, return_outputs=False, request_id=None):
        """Runs N tokens into `slot`; `layers` holds every layer's Activations for them, or
        its tensors in registered regions (a plan.PlannedLayer, or four RegionTensors with
        the output last: the server writes the output there, and it is what returns)."""
        layers = list(layers)  # read twice: the request, then the reply's outputs
        request = pb.PrefillRequest(request_id=request_id or new_request_id(), slot=slot,
                                    tokens=_ints(tokens), layers=self._layers(layers),
                                    return_outputs=return_outputs)
        reply = self._call("Prefill", self.stub.Prefill, request)
        return PrefillResult(self._outputs(reply.layers, layers), reply.state)

    def decode(self, rows, layers, *, request_id=None):
        """One decode forward in one call. rows: (slot, token_id) pairs (slot 0 = padding);
        layers: every layer's Activations for the B rows, or its tensors in regions (as
        prefill takes them)."""
        layers = list(layers)  # read twice: the request, then the reply's outputs
        request = pb.DecodeRequest(request_id=request_id or new_request_id(),
                                   rows=make_rows(rows), layers=self._layers(layers))
        reply = self._call("Decode", self.stub.Decode, request)
        return DecodeResult(self._outputs(reply.layers, layers), list(reply.rows))

    def open_stream(self, timeout=None):
        """A DecodeStream for layer-by-layer forwards (see ForwardStream). timeout: seconds
        each reply may take (None: the client's `timeout`; math.inf: no bound), not the
        stream's whole life."""
        return ForwardStream(self, timeout)

    def verify(self, slots, drafts, layers, *, request_id=None):
        """Speculative verify: drafts[i] are row i's T draft tokens (the same T for all rows);
        layers hold the B*T tokens' Activations (or regions, as prefill takes them) in (row,
        draft) order. Returns per layer [B*T, HV, V]; nothing advances until accept()."""
        layers, drafts = list(layers), [list(d) for d in drafts]  # each read twice
        request = pb.VerifyRequest(request_id=request_id or new_request_id(), slots=_ints(slots),
                                   num_draft=draft_count(drafts),
                                   draft_tokens=_ints(t for d in drafts for t in d),
                                   layers=self._layers(layers))
        reply = self._call("Verify", self.stub.Verify, request)
        return self._outputs(reply.layers, layers)

    def accept(self, slot, num_accepted, *, request_id=None):
        """Keeps the first `num_accepted` drafts of the last verify (0 rejects all)."""
        request = pb.AcceptRequest(request_id=request_id or new_request_id(), slot=slot,
                                   num_accepted=num_accepted)
        return self._call("Accept", self.stub.Accept, request).state

    # ---- prefix cache ----

    def match_prefix(self, tokens):
        """How many leading tokens a cached snapshot already holds."""
        request = pb.MatchPrefixRequest(tokens=_ints(tokens))
        return self._call("MatchPrefix", self.stub.MatchPrefix, request).matched

    def donate(self, slot, *, request_id=None):
        """A finished request's state becomes a prefix snapshot keyed by all its tokens; the
        handle is released."""
        request = pb.DonateRequest(request_id=request_id or new_request_id(), slot=slot)
        self._call("Donate", self.stub.Donate, request)

    # ---- cache events ----

    def watch_cache(self, epoch=0, from_seq=0, timeout=None):
        """The caller's cache events (docs/api.md, "Cache events"): an iterator of
        pb.CacheEventBatch, live until cancelled (the iterator's .cancel()) or the server goes;
        its end is raised as a ReplaySSMError (Cancelled after cancel(), Unavailable when the
        server goes, ...). epoch, from_seq: of the next batch wanted after a reconnect (0, 0:
        a resync first)."""
        request = pb.WatchCacheRequest(epoch=epoch, from_seq=from_seq)
        return _TypedStream(self.stub.WatchCache(request, timeout=timeout), "WatchCache")

    # ---- transfer between servers ----

    def transfer_slot(self, slot, peer_address, *, keep_source=False, request_id=None):
        """Moves `slot` to the server at peer_address over UCX; the reply has its handle there
        (remote_slot), seq_len, bytes and seconds."""
        request = transfer_pb2.TransferSlotRequest(
            request_id=request_id or new_request_id(), slot=slot, peer_address=peer_address,
            keep_source=keep_source)
        return self._call("TransferSlot", self.transfer_stub.TransferSlot, request)

    def pull_slot(self, slot, peer_address, *, keep_source=False, self_address="",
                  request_id=None):
        """Asks the server at peer_address to move its `slot` here; the reply has the handle on
        this server (slot). self_address: this server as the peer reaches it ("" = its
        listen address)."""
        request = transfer_pb2.PullSlotRequest(
            request_id=request_id or new_request_id(), slot=slot, peer_address=peer_address,
            keep_source=keep_source, self_address=self_address)
        return self._call("PullSlot", self.transfer_stub.PullSlot, request)

    # ---- registered regions (docs/data-plane.md) ----
    # The Regions calls carry no request id, so they are not retried: a retry of a register
    # whose reply was lost would meet ALREADY_EXISTS, of an unregister NOT_FOUND.

    def register_region(self, region):
        """Registers a regions.SharedMemoryRegion or regions.CudaRegion under its name."""
        request = region.register_request()
        if isinstance(request, regions_pb2.RegisterCudaRegionRequest):
            self._call("RegisterCudaRegion", self.regions_stub.RegisterCudaRegion, request, False)
            try:
                self._warn_without_mps()
            except errors.ReplaySSMError:
                pass  # advice only: the region is registered, and a raise would say it is not
        else:
            self._call("RegisterSystemRegion", self.regions_stub.RegisterSystemRegion, request,
                       False)

    def _warn_without_mps(self):
        """Once per client: a CUDA region shared with a server that runs without MPS works,
        but every doorbell hand-over time-slices the GPU (~280 us instead of ~5 us)."""
        info = self._info if self._info is not None else self.info()
        if info.backend.startswith("cuda") and not info.mps and not self._warned_mps:
            self._warned_mps = True
            warnings.warn(f"replayssm-server ({info.backend}) runs without MPS: each doorbell "
                          "hand-over between this process and the server costs ~280 us instead "
                          "of ~5 us; start nvidia-cuda-mps-control -d (docs/data-plane.md)",
                          RuntimeWarning, stacklevel=3)

    def unregister_region(self, region):
        """Takes the name (or a Region's name) away at once; the server unmaps the memory when
        the last forward using it has ended."""
        request = regions_pb2.UnregisterRegionRequest(name=getattr(region, "name", region))
        self._call("UnregisterRegion", self.regions_stub.UnregisterRegion, request, False)

    def region_status(self, name=""):
        """RegionStatus (name, kind, byte_size, device_id, in_use) of one region or, with "",
        of every region."""
        request = regions_pb2.RegionStatusRequest(name=name)
        return list(self._call("GetRegionStatus", self.regions_stub.GetRegionStatus,
                               request).regions)
