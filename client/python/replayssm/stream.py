"""Layer-by-layer forwards on one DecodeStream: decode, prefill and verify.

A model's layer l+1 inputs come from layer l's outputs, so it drives a forward as
begin(rows) (or begin_prefill, begin_verify) -> run_layer(l, ...) for each linear-attention
layer -> commit(). The forward applies to every row at once, at commit. One stream carries
any number of forwards of any kind in turn.

A begin with `plan=` (a replayssm.plan.ForwardPlan) names every layer at once in registered
regions: no layer messages; the engine rings the plan's doorbells, and commit() closes the
forward. Layer messages may also name regions: run_layer(l, x, a, b, out=) with RegionTensors.

An error ends the server's stream and abandons the open forward (no cursor moves, no state
changes); it is raised as its typed error, carrying the forward's request id, and the next
begin() opens a new stream. A layer the client cannot send (input it refuses, e.g. an integer
array) abandons the forward the same way: left open, it would hold its slots from all other
work and refuse the stream's next begin.
"""

import itertools
import math
import queue
import threading
import time
import weakref

import grpc

from replayssm import errors, tensors
from replayssm.results import DecodeResult
from replayssm.retry import new_request_id, with_retries
from replayssm.v1 import replayssm_pb2 as pb

_END = object()  # closes the request iterator: the client half-closes the stream


def draft_count(drafts):
    """T of a verify: every row's draft count, which must be the same."""
    lengths = sorted({len(d) for d in drafts})
    if len(lengths) > 1:
        raise errors.InvalidArgument(f"draft_tokens: expected {len(drafts)} rows of equal "
                                     f"length, got lengths {[len(d) for d in drafts]}")
    return lengths[0] if lengths else 0


def make_rows(rows):
    """DecodeRows from (slot, token_id) pairs (or DecodeRows); slot 0 is a padding row."""
    return [r if isinstance(r, pb.DecodeRow) else pb.DecodeRow(slot=int(r[0]), token_id=int(r[1]))
            for r in rows]


class _Deadlines:
    """Cancels a stream call whose reply is later than its deadline: one daemon thread for
    all of a client's streams, started at the first deadline. gRPC bounds a stream's whole
    life, not one reply, so a per-reply bound is kept here. At most one deadline is armed per
    stream, so the thread scans them all when it wakes; it wakes at the earliest deadline, and
    an arm notifies it only when the new deadline is earlier still (not on every message)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._armed = {}  # token -> (deadline, call, expired list)
        self._seq = itertools.count()
        self._thread = None
        self._target = None  # the deadline the thread waits for (None: none)
        self._closed = False

    def arm(self, seconds, call):
        """Cancels `call` in `seconds` unless disarmed first; returns (token, expired), where
        expired turns [True] once it fired (disarm reads it reliably: it fires under the lock).
        None or math.inf: no bound."""
        expired = []
        if seconds is None or math.isinf(seconds):
            return None, expired
        with self._cv:
            if self._closed:
                return None, expired
            token = next(self._seq)
            deadline = time.monotonic() + seconds
            self._armed[token] = (deadline, call, expired)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="replayssm-deadlines",
                                                daemon=True)
                self._thread.start()
            if self._target is None or deadline < self._target:
                self._cv.notify()
        return token, expired

    def disarm(self, token):
        with self._cv:
            self._armed.pop(token, None)

    def close(self):
        """Ends the thread (Client.close): no deadline fires after it."""
        with self._cv:
            self._closed = True
            self._armed.clear()
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()

    def _run(self):
        with self._cv:
            while not self._closed:
                now = time.monotonic()
                for token, (deadline, call, expired) in list(self._armed.items()):
                    if deadline > now:
                        continue
                    del self._armed[token]
                    expired.append(True)
                    try:
                        call.cancel()  # non-blocking: the waiting next() raises CANCELLED
                    except Exception:  # noqa: BLE001 - one call's failure must not stop the rest
                        pass
                self._target = min((d for d, _, _ in self._armed.values()), default=None)
                self._cv.wait(None if self._target is None else self._target - now)


class ForwardStream:
    """One DecodeStream. Use as a context manager, or close() it: closing abandons an open
    forward. Not thread-safe: drive it from one thread.

    `timeout`: seconds each reply may take (a begin's, a layer's, a commit's, close()'s wait
    for the stream's end; None: the client's `timeout`; math.inf: no bound). Past it the
    stream is cancelled, its open forward abandoned, and DeadlineExceeded raised; forward()
    retries it as any DEADLINE_EXCEEDED. A commit whose reply is late may still have been
    applied: retry it with the same request_id (forward() does) to learn which. A planned
    commit waits for the engine's doorbells, so give it longer than the server's
    --forward-timeout."""

    def __init__(self, client, timeout=None):
        self._client = client
        self._timeout = client.timeout if timeout is None else timeout
        self._call = None
        self._requests = None
        self._end_requests = None  # ends the gRPC thread reading _requests (also at GC)
        self.request_id = None  # the id of the last begin
        self._forward_id = None  # the id of the open forward: its errors carry it
        self.replayed = False  # the last begin's id had been applied: outputs are the stored ones
        self._planned = False  # the open forward is planned: no layer messages
        self._awaiting = False  # a begin was sent with wait=False; its reply is not read yet

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _open(self):
        self._requests = queue.Queue()
        # gRPC reads the requests on a thread of its own until _END: a stream dropped or
        # collected without close() must still end it, or the thread waits for good.
        self._end_requests = weakref.finalize(self, self._requests.put, _END)
        self._call = self._client.stub.DecodeStream(iter(self._requests.get, _END))

    def _round_trip(self, request, expect):
        if request is not None:
            self._check_not_awaiting()
        if self._call is None:
            call = {"committed": "commit", "layer": "run_layer"}.get(expect, expect)
            raise errors.FailedPrecondition(f"{call}: no open forward (begin first)",
                                            method="DecodeStream")
        if request is not None:
            self._requests.put(request)
        request_id = self._forward_id
        token, expired = self._client._deadlines.arm(self._timeout, self._call)

        def late():
            # Which outcome the server reached is known only for a layer (its forward is
            # abandoned: nothing changes). A commit may have been applied before the cancel
            # reached the server, and a begin may have committed the planned forward before it:
            # a retry with the same request_id tells (the server answers a commit that applied
            # with its stored reply, `replayed`).
            if expect == "committed":
                outcome = ("the stream was cancelled; the commit may have been applied or not: "
                           "retry the forward with the same request_id (e.request_id) to learn "
                           "which")
            elif expect == "begun":
                outcome = ("the stream was cancelled and its open forward abandoned (a planned "
                           "forward open before this begin may have been committed by it)")
            else:
                outcome = ("the stream was cancelled and its open forward abandoned (nothing "
                           "changes)")
            return errors.DeadlineExceeded(
                f"no {expect} reply within {self._timeout} s (the stream's timeout): {outcome}",
                method="DecodeStream", request_id=request_id)

        try:
            reply = next(self._call)
        except grpc.RpcError as e:
            self._drop()
            # Only the cancel the deadline made is "late": a server's own error that came as
            # the deadline fired is its answer (a refusal: retried as a timeout, it was
            # reported as one in the end).
            if expired and e.code() == grpc.StatusCode.CANCELLED:
                raise late() from None
            raise errors.from_rpc_error(e, "DecodeStream", request_id) from None
        except StopIteration:
            self._drop()
            raise errors.Unavailable("decode stream ended by the server", method="DecodeStream",
                                     request_id=request_id) from None
        finally:
            self._client._deadlines.disarm(token)
        if expired:  # fired as the reply came: the call is cancelled all the same
            self._drop()
            # A begin's or a layer's forward is abandoned by the cancel, so their reply is
            # void; a commit's reply in hand is the server's answer that it applied (or not):
            # returned, never reported as lost.
            if expect != "committed" or reply.WhichOneof("msg") != expect:
                raise late()
        kind = reply.WhichOneof("msg")
        if kind != expect:
            self.close()
            raise errors.Internal(f"expected a {expect} reply, got {kind}", method="DecodeStream",
                                  request_id=request_id)
        return getattr(reply, expect)

    def _drop(self):
        if self._end_requests is not None:
            self._end_requests()  # once: later calls do nothing
        self._end_requests = None
        self._call = None
        self._requests = None
        self._planned = False
        self._awaiting = False
        self._forward_id = None

    def begin(self, rows, *, plan=None, request_id=None, wait=True):
        """Opens a decode forward over rows ((slot, token_id) pairs; slot 0 pads). With `plan`
        (a ForwardPlan) the forward is planned: its next value goes with it. A retry of a
        forward whose commit reply was lost passes the same request_id: the server answers
        with the stored outputs (`replayed`). Returns DecodeBegun.

        A begin while a planned forward is open commits that forward first (its reply is in
        the returned DecodeBegun's `closed`). With wait=False (planned forwards) the begin is
        sent without waiting for its reply, so the engine can ring its doorbells at once;
        await_begun() reads the reply before anything else is sent on the stream. A refused
        begin rings the plan's done doorbells, so the engine does not hang; await_begun()
        then raises and the outputs are not valid (docs/data-plane.md)."""
        return self._begin("begin", lambda rid: pb.DecodeBegin(request_id=rid,
                                                               rows=make_rows(rows)),
                           plan, request_id, wait)

    def begin_prefill(self, rows, *, plan=None, request_id=None, wait=True):
        """Opens a prefill forward: rows are (slot, tokens) pairs; every layer then carries
        N = all rows' tokens, packed in row order. Commit advances each slot by its tokens."""
        rows = [(slot, list(tokens)) for slot, tokens in rows]

        def message(rid):
            return pb.PrefillBegin(request_id=rid, rows=[
                pb.PrefillRow(slot=int(slot), tokens=[int(t) for t in tokens])
                for slot, tokens in rows])

        return self._begin("prefill_begin", message, plan, request_id, wait)

    def begin_verify(self, slots, drafts, *, plan=None, request_id=None, wait=True):
        """Opens a verify forward: drafts[i] are row i's T draft tokens; every layer carries
        B*T tokens in (row, draft) order. Commit moves no cursor: accept() decides."""
        slots, drafts = list(slots), [list(d) for d in drafts]  # read again by a retry
        num_draft = draft_count(drafts)

        def message(rid):
            return pb.VerifyBegin(request_id=rid, slots=[int(s) for s in slots],
                                  num_draft=num_draft,
                                  draft_tokens=[int(t) for d in drafts for t in d])

        return self._begin("verify_begin", message, plan, request_id, wait)

    def _begin(self, kind, message, plan, request_id, wait=True):
        if not wait and plan is None:
            raise errors.InvalidArgument("wait=False: only a planned begin (plan=...) can be "
                                         "sent without waiting for its reply",
                                         method="DecodeStream")
        self._check_not_awaiting()
        if self._call is None:
            self._open()
        self.request_id = request_id or new_request_id()
        self._forward_id = self.request_id
        request = message(self.request_id)
        if plan is not None:
            plan.next_value()
            request.plan.CopyFrom(plan.proto())
        if not wait:
            self._requests.put(pb.DecodeStreamRequest(**{kind: request}))
            self._awaiting = True
            self._planned = True
            return None
        begun = self._round_trip(pb.DecodeStreamRequest(**{kind: request}), "begun")
        self.replayed = begun.replayed
        self._planned = plan is not None
        return begun

    def await_begun(self):
        """The reply of a begin sent with wait=False: DecodeBegun, or the refusal raised."""
        if not self._awaiting:
            raise errors.FailedPrecondition("await_begun: no begin sent with wait=False",
                                            method="DecodeStream")
        self._awaiting = False
        begun = self._round_trip(None, "begun")
        self.replayed = begun.replayed
        return begun

    def _check_not_awaiting(self):
        if self._awaiting:
            raise errors.FailedPrecondition("a begin sent with wait=False awaits its reply: "
                                            "call await_begun() first", method="DecodeStream")

    def run_layer(self, layer, mixed_qkv, a, b, *, out=None):
        """Runs one layer for every row of the open forward; returns its output [B, HV, V]
        (numpy, or a torch tensor on mixed_qkv's device when the inputs are torch). With
        RegionTensors for every input and `out` a RegionTensor, only their places travel:
        the server writes the output there and `out` is returned. Input refused before
        sending (InvalidArgument naming the field) abandons the forward, as any error does."""
        if self._planned:
            raise errors.FailedPrecondition(f"layer {layer}: the open forward is planned (its "
                                            "layers run on the doorbells); commit() closes it",
                                            method="DecodeStream")
        given = (mixed_qkv, a, b) if out is None else (mixed_qkv, a, b, out)
        try:
            request = tensors.any_layer_input(layer, given, self._client.model.act_dtype,
                                              "layer")
            return self._send_layer(request, given, "layer.out")
        except BaseException:
            # The server's errors have ended the stream already; anything else leaves the
            # forward open on the server, holding its slots, until the stream closes.
            self.close()
            raise

    def _send_layer(self, request, given, field):
        reply = self._round_trip(pb.DecodeStreamRequest(layer=request), "layer")
        return tensors.layer_output(reply.out, given, field)

    def commit(self):
        """Closes the forward: every row's cursor advances once (verify: none; the drafts
        wait for accept). A planned forward's commit returns once every layer has run.
        Returns the rows' SlotStates."""
        committed = self._round_trip(pb.DecodeStreamRequest(commit=pb.DecodeCommit()),
                                     "committed")
        self._planned = False
        self._forward_id = None
        return list(committed.rows)

    def forward(self, rows, layers, *, request_id=None):
        """A whole forward (begin, every layer in order, commit), retried with the same request
        id on a RETRYABLE failure as the client's unary calls are. Every layer's inputs are
        checked (and encoded) before the begin, so input the client refuses sends nothing.
        `layers` as Client.decode takes them. Returns DecodeResult."""
        request_id = request_id or new_request_id()
        rows, layers = list(rows), list(layers)  # a retry reads them again
        act = self._client.model.act_dtype
        messages = [tensors.any_layer_input(i, x, act, f"layers[{i}]")
                    for i, x in enumerate(layers)]

        def attempt():
            self.begin(rows, request_id=request_id)
            try:
                outputs = [self._send_layer(m, x, f"layers[{i}].out")
                           for i, (m, x) in enumerate(zip(messages, layers))]
            except BaseException:
                self.close()  # as run_layer: no forward left open on the server
                raise
            return DecodeResult(outputs, self.commit())

        client = self._client
        return with_retries(attempt, client.retries, client.retry_backoff, self.close,
                            aborted_wait=client._aborted_wait())

    def close(self):
        """Half-closes the stream and waits for the server to end it; a forward still open is
        abandoned (nothing changes)."""
        if self._call is None:
            return
        call = self._call
        self._drop()  # half-closes: the request iterator ends
        # Bounded as a reply is: a server that stopped answering is cancelled, not waited for.
        token, _ = self._client._deadlines.arm(self._timeout, call)
        try:
            for _ in call:
                pass
        except grpc.RpcError:
            pass  # the stream's end status; the forward, if open, is abandoned either way
        finally:
            self._client._deadlines.disarm(token)
