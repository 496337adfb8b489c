"""Errors and request ids against the real server: every failure is its typed error with the
server's code and message, a failed call changes nothing, and a retry reuses its request id so
that a call whose reply was lost is not applied twice."""

import gc
import signal
import threading
import time
import unittest
from unittest import mock

import grpc
import numpy as np

import replayssm
from replayssm import pb
from support import ServerTest


class ErrorsTest(ServerTest):
    def prefilled_slot_and_stream(self):
        """A slot with 2 tokens prefilled, its reference state, what observe() sees of it, an
        open stream (closed at cleanup), and one token's layers."""
        slot = self.client.allocate().slot
        state = self.ref.new_state()
        self.prefill(slot, state, 2)
        before = self.observe(slot)
        stream = self.client.open_stream()
        self.addCleanup(stream.close)
        return slot, state, before, stream, self.layers(1)

    def test_a_bad_shape_is_invalid_argument_naming_the_field_and_changes_nothing(self):
        slot = self.client.allocate().slot
        self.prefill(slot, self.ref.new_state(), 3)
        before = self.observe(slot)
        layers = self.layers(1)
        x = layers[1]
        layers[1] = replayssm.Activations(x.mixed_qkv, np.zeros((1, 5), np.float32), x.b)
        with self.assertRaises(replayssm.InvalidArgument) as caught:
            self.client.decode([(slot, 7)], layers)
        error = caught.exception
        self.assertIsInstance(error, replayssm.ReplaySSMError)
        self.assertEqual(error.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("layers[1].a.shape: expected [1, 4], got [1, 5]", error.details)
        self.assertEqual(self.observe(slot), before)

    def test_a_bad_layer_abandons_the_stream_forward_and_the_next_begin_works(self):
        slot, state, before, stream, layers = self.prefilled_slot_and_stream()
        stream.begin([(slot, 3)])
        stream.run_layer(0, *layers[0])
        with self.assertRaises(replayssm.InvalidArgument) as caught:
            stream.run_layer(1, layers[1].mixed_qkv, layers[1].a, np.zeros((2, 4), np.float32))
        self.assertIn("layer.b.shape", caught.exception.details)
        self.assertEqual(self.observe(slot), before)
        stream.begin([(slot, 3)])
        for l, x in enumerate(layers):
            self.assertClose(stream.run_layer(l, *x), self.ref.decode_layer([state], l, *x))
        self.assertEqual(stream.commit()[0].seq_len, 3)

    def test_a_layer_the_client_refuses_abandons_the_forward_and_the_stream_goes_on(self):
        slot, state, before, stream, layers = self.prefilled_slot_and_stream()
        bad = list(layers)
        bad[2] = replayssm.Activations(layers[2].mixed_qkv.astype(np.int32), *layers[2][1:])
        with self.assertRaises(replayssm.InvalidArgument) as caught:
            stream.forward([(slot, 3)], bad)
        self.assertIn("layers[2].mixed_qkv.dtype", caught.exception.details)
        # Checked before the begin: the slot was never held, a unary call takes it at once.
        self.assertEqual(self.observe(slot), before)
        stream.begin([(slot, 3)])
        stream.run_layer(0, *layers[0])
        with self.assertRaises(replayssm.InvalidArgument) as caught:
            stream.run_layer(1, *bad[2])
        self.assertIn("layer.mixed_qkv.dtype", caught.exception.details)
        self.assertEqual(self.observe(slot), before)  # abandoned: the slot takes other work
        got = stream.forward([(slot, 3)], layers)
        for l, x in enumerate(layers):
            self.assertClose(got.outputs[l], self.ref.decode_layer([state], l, *x))
        self.assertEqual(got.rows[0].seq_len, 3)

    def test_a_layer_twice_in_one_forward_is_failed_precondition(self):
        slot = self.client.allocate().slot
        layers = self.layers(1)
        with self.client.open_stream() as stream:
            stream.begin([(slot, 1)])
            stream.run_layer(0, *layers[0])
            with self.assertRaises(replayssm.FailedPrecondition) as caught:
                stream.run_layer(0, *layers[0])
        self.assertIn("already ran", caught.exception.details)
        self.assertEqual(self.client.get_slot(slot).seq_len, 0)

    def test_unknown_and_freed_slots_are_not_found(self):
        slot = self.client.allocate().slot
        self.client.free(slot)
        with self.assertRaises(replayssm.NotFound):
            self.client.decode([(slot, 1)], self.layers(1))
        with self.assertRaises(replayssm.NotFound):
            self.client.free(slot)
        with self.assertRaises(replayssm.NotFound):
            self.client.export_state(slot ^ 0x5A5A)

    def test_drafts_awaiting_accept_refuse_a_decode_until_accepted(self):
        slot = self.client.allocate().slot
        state = self.ref.new_state()
        self.client.verify([slot], [[1, 2]], self.layers(2))
        with self.assertRaises(replayssm.FailedPrecondition):
            self.client.decode([(slot, 3)], self.layers(1))
        self.client.accept(slot, 0)
        self.decode([slot], [state])

    def test_input_the_client_cannot_encode_is_invalid_argument_before_sending(self):
        slot = self.client.allocate().slot
        layers = self.layers(1)
        layers[0] = replayssm.Activations(layers[0].mixed_qkv.astype(np.int32), *layers[0][1:])
        with self.assertRaises(replayssm.InvalidArgument) as caught:
            self.client.decode([(slot, 1)], layers)
        self.assertIn("layers[0].mixed_qkv.dtype", caught.exception.details)
        with self.assertRaises(replayssm.InvalidArgument) as caught:
            self.client.verify([slot, slot], [[1, 2], [3]], self.layers(3))
        self.assertIn("draft_tokens", caught.exception.details)
        self.assertEqual(self.client.stats().slots_live, 1)


class CapacityTest(ServerTest):
    SERVER_FLAGS = ("--memory-budget=1M",)

    def test_allocating_past_the_capacity_is_resource_exhausted(self):
        capacity = self.info.capacity_slots
        self.assertGreater(capacity, 1)
        slots = [self.client.allocate().slot for _ in range(capacity)]
        with self.assertRaises(replayssm.ResourceExhausted):
            self.client.allocate()
        self.client.free(slots[0])
        self.client.allocate()


class DrainTest(ServerTest):
    def test_a_draining_server_is_not_serving_and_refuses_new_work_as_unavailable(self):
        slot = self.client.allocate().slot
        layers = self.layers(1)
        stream = self.client.open_stream()
        self.addCleanup(stream.close)
        stream.begin([(slot, 1)])  # an open forward keeps the server draining
        self.server.signal(signal.SIGTERM)
        for _ in range(500):
            if self.client.health() == "NOT_SERVING":
                break
            time.sleep(0.01)
        self.assertEqual(self.client.health(), "NOT_SERVING")
        self.client.retries = 0
        with self.assertRaises(replayssm.Unavailable):
            self.client.allocate()
        for l, x in enumerate(layers):
            stream.run_layer(l, *x)
        self.assertEqual(stream.commit()[0].seq_len, 1)
        stream.close()
        self.assertEqual(self.server.wait_exit(timeout=30), 0)


class LoseFirstReply(grpc.UnaryUnaryClientInterceptor):
    """Lets the first `lost` calls of `method` reach the server, then reports their replies
    lost."""

    class Lost(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.DEADLINE_EXCEEDED

        def details(self):
            return "reply lost (test)"

    def __init__(self, method, lost=1):
        self.method = method
        self.lost = lost
        self.request_ids = []

    def intercept_unary_unary(self, continuation, details, request):
        call = continuation(details, request)
        if details.method.endswith("/" + self.method):
            self.request_ids.append(request.request_id)
            if len(self.request_ids) <= self.lost:
                call.result()  # applied on the server
                raise self.Lost()
        return call


class AbortedFor(grpc.UnaryUnaryClientInterceptor):
    """Answers calls of `method` ABORTED (its id still in flight) for `seconds` after the
    first, without reaching the server; then lets them through."""

    class InFlight(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.ABORTED

        def details(self):
            return "request_id: still in flight (test)"

    def __init__(self, method, seconds):
        self.method = method
        self.seconds = seconds
        self.request_ids = []
        self.first = None

    def intercept_unary_unary(self, continuation, details, request):
        if details.method.endswith("/" + self.method):
            self.request_ids.append(request.request_id)
            self.first = self.first or time.monotonic()
            if time.monotonic() - self.first < self.seconds:
                raise self.InFlight()
        return continuation(details, request)


class SlowReply:
    """A stream call whose replies arrive, then are taken 2 s later: a stream's deadline fires
    while a reply is already in hand."""

    def __init__(self, call):
        self.call = call

    def __iter__(self):
        return self

    def __next__(self):
        reply = next(self.call)
        time.sleep(2.0)
        return reply

    def cancel(self):
        return self.call.cancel()


class SlowRefusal:
    """A stream call whose next reply is the server's refusal, taken 2 s later: the stream's
    deadline fires (cancelling the call) while the server's own error is already in hand."""

    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.NOT_FOUND

        def details(self):
            return "rows[0].slot: no slot 7 (a test's refusal)"

    def __init__(self, call):
        self.call = call

    def __iter__(self):
        return self

    def __next__(self):
        time.sleep(2.0)
        raise self.Refused()

    def cancel(self):
        return self.call.cancel()


class TransferAbortedBy(grpc.UnaryUnaryClientInterceptor):
    """Answers TransferSlot ABORTED as a sender does when the peer aborted the move (decided:
    the state stays), without reaching the server."""

    class PeerAborted(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.ABORTED

        def details(self):
            return "transfer 7: the peer aborted it"

    def __init__(self):
        self.request_ids = []

    def intercept_unary_unary(self, continuation, details, request):
        if details.method.endswith("/TransferSlot"):
            self.request_ids.append(request.request_id)
            raise self.PeerAborted()
        return continuation(details, request)


class RequestIdTest(ServerTest):
    def client_losing_first(self, method, lost=1):
        return self.intercepted(LoseFirstReply(method, lost))

    def intercepted(self, interceptor, **kw):
        channel = grpc.intercept_channel(grpc.insecure_channel(self.server.grpc_address),
                                         interceptor)
        client = replayssm.Client(channel=channel, timeout=30, retry_backoff=0.01, **kw)
        self.addCleanup(client.close)
        return client, interceptor

    def test_an_allocate_whose_reply_was_lost_is_retried_with_its_id_and_applied_once(self):
        client, lose = self.client_losing_first("Allocate")
        slot = client.allocate().slot
        self.assertEqual(len(lose.request_ids), 2)
        self.assertEqual(lose.request_ids[0], lose.request_ids[1])
        self.assertEqual(self.client.stats().slots_live, 1)
        self.assertEqual(self.client.get_slot(slot).seq_len, 0)

    def test_a_decode_whose_reply_was_lost_advances_the_slot_once(self):
        client, lose = self.client_losing_first("Decode")
        slot = client.allocate().slot
        state = self.ref.new_state()
        layers = self.layers(1)
        got = client.decode([(slot, 1)], layers)
        self.assertEqual(len(lose.request_ids), 2)
        for l, x in enumerate(layers):
            self.assertClose(got.outputs[l], self.ref.decode_layer([state], l, *x))
        self.assertEqual(got.rows[0].seq_len, 1)
        self.assertEqual(self.client.get_slot(slot).seq_len, 1)

    def test_a_call_out_of_retries_names_its_id_and_a_retry_by_hand_applies_it_once(self):
        client, lose = self.client_losing_first("Prefill", lost=3)
        slot = self.client.allocate().slot
        layers = self.layers(3)
        with self.assertRaises(replayssm.DeadlineExceeded) as caught:
            client.prefill(slot, [1, 2, 3], layers)
        error = caught.exception
        self.assertEqual(len(lose.request_ids), 3)  # retries=2: every attempt's reply lost
        self.assertEqual(set(lose.request_ids), {error.request_id})
        self.assertIn(f"request_id {error.request_id}", str(error))
        again = self.client.prefill(slot, [1, 2, 3], layers, request_id=error.request_id)
        self.assertEqual(again.state.seq_len, 3)  # the first attempt's reply, not a second run
        self.assertEqual(self.client.export_state(slot).tokens, [1, 2, 3])

    def test_errors_of_calls_with_an_id_carry_it_and_the_others_none(self):
        slot = self.client.allocate().slot
        self.client.free(slot)
        with self.assertRaises(replayssm.NotFound) as caught:
            self.client.free(slot, request_id="free-gone")
        self.assertEqual(caught.exception.request_id, "free-gone")
        with self.assertRaises(replayssm.NotFound) as caught:
            self.client.get_slot(slot)
        self.assertIsNone(caught.exception.request_id)
        self.assertNotIn("request_id", str(caught.exception))
        with self.client.open_stream() as stream:
            with self.assertRaises(replayssm.NotFound) as caught:
                stream.begin([(slot, 1)], request_id="begin-gone")
            self.assertEqual(caught.exception.request_id, "begin-gone")
            with self.assertRaises(replayssm.NotFound) as caught:
                stream.forward([(slot, 1)], self.layers(1))
            self.assertEqual(caught.exception.request_id, stream.request_id)

    def test_an_aborted_call_waits_for_its_id_in_flight_with_a_growing_backoff(self):
        client, aborted = self.intercepted(AbortedFor("Allocate", 0.6))
        slot = client.allocate().slot
        self.assertEqual(self.client.get_slot(slot).seq_len, 0)
        self.assertEqual(len(set(aborted.request_ids)), 1)
        self.assertLessEqual(len(aborted.request_ids), 12)  # backing off, not spinning

    def test_an_aborted_call_gives_up_after_aborted_wait_naming_its_id(self):
        client, aborted = self.intercepted(AbortedFor("Allocate", 60), aborted_wait=0.3)
        start = time.monotonic()
        with self.assertRaises(replayssm.Aborted) as caught:
            client.allocate(request_id="alloc-busy")
        self.assertGreaterEqual(time.monotonic() - start, 0.3)
        self.assertLess(time.monotonic() - start, 3)
        self.assertEqual(caught.exception.request_id, "alloc-busy")
        self.assertEqual(set(aborted.request_ids), {"alloc-busy"})
        no_retries, aborted = self.intercepted(AbortedFor("Allocate", 60), retries=0)
        with self.assertRaises(replayssm.Aborted):
            no_retries.allocate()
        self.assertEqual(len(aborted.request_ids), 1)

    def test_a_transfer_the_peer_aborted_is_final_and_not_retried(self):
        # A decided abort is ABORTED too; retried with the same id it would run a new move.
        # It was retried for the whole aborted_wait (10 moves in 5 s; an outside review).
        client, aborted = self.intercepted(TransferAbortedBy(), aborted_wait=5)
        slot = self.client.allocate().slot
        start = time.monotonic()
        with self.assertRaises(replayssm.Aborted) as caught:
            client.transfer_slot(slot, "127.0.0.1:1", request_id="move-1")
        self.assertLess(time.monotonic() - start, 1)
        self.assertEqual(aborted.request_ids, ["move-1"])
        self.assertIn("the peer aborted it", caught.exception.details)

    def test_the_same_id_again_returns_the_original_reply(self):
        first = self.client.allocate(request_id="alloc-1")
        again = self.client.allocate(request_id="alloc-1")
        self.assertEqual(first, again)
        self.assertNotEqual(self.client.allocate().slot, self.client.allocate().slot)
        self.assertEqual(self.client.stats().slots_live, 3)

    def test_the_same_id_for_a_different_request_is_invalid_argument(self):
        a, b = self.client.allocate().slot, self.client.allocate().slot
        self.client.free(a, request_id="free-1")
        with self.assertRaises(replayssm.InvalidArgument) as caught:
            self.client.free(b, request_id="free-1")
        self.assertIn("request_id", caught.exception.details)
        self.assertEqual(self.client.get_slot(b).slot, b)

    def test_a_stream_forward_retried_with_its_id_replays_the_original_outputs(self):
        slot = self.client.allocate().slot
        layers = self.layers(1)
        with self.client.open_stream() as stream:
            first = stream.forward([(slot, 1)], layers, request_id="fwd-1")
            self.assertFalse(stream.replayed)
        with self.client.open_stream() as stream:
            again = stream.forward([(slot, 1)], layers, request_id="fwd-1")
            self.assertTrue(stream.replayed)
        for a, b in zip(first.outputs, again.outputs):
            np.testing.assert_array_equal(a, b)
        self.assertEqual(self.client.get_slot(slot).seq_len, 1)


class StreamResourcesTest(ServerTest):
    def settled_thread_count(self, at_most):
        """The process's thread count once it is at most `at_most` (gRPC threads end a moment
        after their stream), or what it is after 5 s."""
        deadline = time.monotonic() + 5
        while threading.active_count() > at_most and time.monotonic() < deadline:
            time.sleep(0.05)
        return threading.active_count()

    def test_failed_and_dropped_streams_leave_no_thread_behind(self):
        slot = self.client.allocate().slot
        with self.client.open_stream() as stream:  # the client's own threads started once
            stream.forward([(slot, 1)], self.layers(1))
        baseline = threading.active_count()
        stream = self.client.open_stream()
        for _ in range(20):  # NOT_FOUND: each failure ends the server's stream
            with self.assertRaises(replayssm.NotFound):
                stream.forward([(123456789, 1)], self.layers(1))
        for _ in range(20):  # streams a caller forgets to close
            forgotten = self.client.open_stream()
            forgotten.forward([(slot, 1)], self.layers(1))
            del forgotten
        gc.collect()
        self.assertLessEqual(self.settled_thread_count(baseline), baseline)
        self.assertEqual(self.client.get_slot(slot).seq_len, 21)

    def test_layers_drafts_and_rows_may_be_generators(self):
        slot = self.client.allocate().slot
        state = self.ref.new_state()
        layers = self.layers(1)
        got = self.client.decode(((s, 7) for s in [slot]), (x for x in layers))
        for l, x in enumerate(layers):
            self.assertClose(got.outputs[l], self.ref.decode_layer([state], l, *x), f"layer {l}")
        outputs = self.client.verify([slot], ([t] for t in [9]), (x for x in self.layers(1)))
        self.assertEqual(len(outputs), self.model.num_layers)
        self.assertEqual(self.client.get_slot(slot).pending_drafts, 1)
        self.client.accept(slot, 0)
        with self.client.open_stream() as stream:
            stream.forward(((s, 8) for s in [slot]), (x for x in self.layers(1)))
            stream.begin_verify((s for s in [slot]), ([t] for t in [3]))
            for l, x in enumerate(self.layers(1)):
                stream.run_layer(l, *x)
            stream.commit()
        self.assertEqual(self.client.get_slot(slot).seq_len, 2)
        self.assertEqual(self.client.get_slot(slot).pending_drafts, 1)

    def test_a_stream_bounds_each_reply_not_its_whole_life(self):
        slot = self.client.allocate().slot
        stream = self.client.open_stream(timeout=1.0)
        self.addCleanup(stream.close)
        stream.forward([(slot, 1)], self.layers(1))
        time.sleep(1.5)  # an idle stream outlives its timeout: only a reply is bounded
        stream.forward([(slot, 2)], self.layers(1))
        before = self.observe(slot)
        self.server.signal(signal.SIGSTOP)
        self.addCleanup(self.server.signal, signal.SIGCONT)
        started = time.monotonic()
        with self.assertRaises(replayssm.DeadlineExceeded) as raised:
            stream.begin([(slot, 3)], request_id="stuck-1")
        waited = time.monotonic() - started
        self.assertLess(waited, 10)
        self.assertIn("within 1.0 s", raised.exception.details)
        self.assertEqual(raised.exception.request_id, "stuck-1")
        self.server.signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while True:  # the resumed server runs the begin, then sees the stream cancelled
            try:
                seen = self.observe(slot)
                break
            except replayssm.FailedPrecondition:  # "in another open operation" until then
                self.assertLess(time.monotonic(), deadline)
                time.sleep(0.05)
        self.assertEqual(seen, before)  # the cancelled begin changed nothing
        stream.forward([(slot, 3)], self.layers(1))
        self.assertEqual(self.client.get_slot(slot).seq_len, 3)

    def test_a_deadline_firing_as_the_reply_comes_fails_that_reply(self):
        slot = self.client.allocate().slot
        stream = self.client.open_stream(timeout=1.0)  # ample for a reply, even under ASan
        self.addCleanup(stream.close)
        stream.forward([(slot, 1)], self.layers(1))
        stream._call = SlowReply(stream._call)
        with self.assertRaises(replayssm.DeadlineExceeded):  # it used to return, cancelled
            stream.begin([(slot, 2)])
        deadline = time.monotonic() + 10
        while self.client.stats().open_forwards and time.monotonic() < deadline:
            time.sleep(0.05)
        stream.forward([(slot, 2)], self.layers(1))  # a new stream; the slot took one token
        self.assertEqual(self.client.get_slot(slot).seq_len, 2)

    def test_a_refusal_in_hand_as_the_deadline_fires_is_raised_as_itself(self):
        """It was raised as DeadlineExceeded ("no begun reply within ..."), and forward()
        retried a refusal as a timeout."""
        slot = self.client.allocate().slot
        stream = self.client.open_stream(timeout=1.0)
        self.addCleanup(stream.close)
        stream.forward([(slot, 1)], self.layers(1))
        stream._call = SlowRefusal(stream._call)
        with self.assertRaises(replayssm.NotFound) as caught:
            stream.begin([(slot, 2)])
        self.assertIn("a test's refusal", caught.exception.details)

    def test_a_commit_reply_in_hand_as_the_deadline_fires_is_returned(self):
        slot = self.client.allocate().slot
        stream = self.client.open_stream(timeout=1.0)
        self.addCleanup(stream.close)
        stream.begin([(slot, 1)])
        for l, x in enumerate(self.layers(1)):
            stream.run_layer(l, *x)
        stream._call = SlowReply(stream._call)
        committed = stream.commit()  # it used to raise "abandoned" for a commit that applied
        self.assertEqual(committed[0].seq_len, 1)
        self.assertEqual(self.client.get_slot(slot).seq_len, 1)
        stream.forward([(slot, 2)], self.layers(1))  # the cancelled stream was replaced
        self.assertEqual(self.client.get_slot(slot).seq_len, 2)

    def test_a_late_commit_reply_says_its_outcome_is_unknown_and_a_retry_applies_it_once(self):
        slot = self.client.allocate().slot
        stream = self.client.open_stream(timeout=1.0)
        self.addCleanup(stream.close)
        stream.begin([(slot, 1)], request_id="late-commit")
        for l, x in enumerate(self.layers(1)):
            stream.run_layer(l, *x)
        self.server.signal(signal.SIGSTOP)
        self.addCleanup(self.server.signal, signal.SIGCONT)
        with self.assertRaises(replayssm.DeadlineExceeded) as raised:
            stream.commit()
        self.server.signal(signal.SIGCONT)
        # It used to say the forward was abandoned and nothing changed, which a caller driving
        # the stream by hand took as leave to run the token again under a new id.
        self.assertIn("may have been applied", raised.exception.details)
        self.assertNotIn("nothing changes", raised.exception.details)
        self.assertEqual(raised.exception.request_id, "late-commit")
        retry = self.client.open_stream(timeout=30)
        self.addCleanup(retry.close)
        deadline = time.monotonic() + 10
        while True:  # the resumed server decides the first commit, then answers the retry
            try:
                retry.forward([(slot, 1)], self.layers(1), request_id="late-commit")
                break
            except replayssm.FailedPrecondition:  # "in another open operation" until then
                self.assertLess(time.monotonic(), deadline)
                time.sleep(0.05)
        self.assertEqual(self.client.get_slot(slot).seq_len, 1)  # applied once, either way

    def test_closing_is_bounded_and_closed_clients_leave_no_thread(self):
        baseline = threading.active_count()
        for _ in range(5):
            with replayssm.Client(self.server.grpc_address, timeout=1) as client:
                slot = client.allocate().slot
                with client.open_stream() as stream:
                    stream.forward([(slot, 1)], self.layers(1))
        self.assertLessEqual(self.settled_thread_count(baseline), baseline)
        self.assertNotIn("replayssm-deadlines", [t.name for t in threading.enumerate()])
        client = replayssm.Client(self.server.grpc_address, timeout=1, retries=0)
        self.addCleanup(client.close)
        stream = client.open_stream()
        stream.forward([(client.allocate().slot, 1)], self.layers(1))
        self.server.signal(signal.SIGSTOP)
        self.addCleanup(self.server.signal, signal.SIGCONT)
        started = time.monotonic()
        stream.close()  # it waited for the stopped server's end of the stream
        self.assertLess(time.monotonic() - started, 5)


class ErrorTypesTest(unittest.TestCase):
    def test_every_code_maps_to_its_subclass_carrying_code_and_details(self):
        from replayssm import errors

        for code in grpc.StatusCode:
            if code == grpc.StatusCode.OK:
                continue
            error = errors.error_for(code, "x: expected 1, got 2", "Decode")
            self.assertIsInstance(error, replayssm.ReplaySSMError)
            self.assertIsNot(type(error), replayssm.ReplaySSMError, code)
            self.assertEqual((error.code, error.details), (code, "x: expected 1, got 2"))
            self.assertEqual(str(error), f"Decode: {code.name}: x: expected 1, got 2")
        self.assertIs(type(errors.error_for(grpc.StatusCode.NOT_FOUND, "")), replayssm.NotFound)
        self.assertEqual(pb.DTYPE_BF16, replayssm.BF16)


class RetryPolicyTest(unittest.TestCase):
    def test_a_long_aborted_wait_ends_in_aborted_not_an_overflow(self):
        """An attempt in flight for longer than ~17 min at the 1 s cap: the backoff's exponent
        reached 1024 and the float overflowed (OverflowError, the request id lost)."""
        from replayssm import errors, retry

        clock = [0.0]

        class FakeTime:  # retry's clock only: the process's time module stays as it is
            @staticmethod
            def sleep(seconds):
                clock[0] += seconds

            @staticmethod
            def monotonic():
                return clock[0]

        patch = mock.patch.object(retry, "time", FakeTime)
        patch.start()
        self.addCleanup(patch.stop)
        calls = [0]

        def attempt():
            calls[0] += 1
            raise errors.Aborted("request_id: the same request is still in flight",
                                 request_id="r-1")

        with self.assertRaises(errors.Aborted) as caught:
            retry.with_retries(attempt, retries=3, backoff=0.05, aborted_wait=3600.0)
        self.assertEqual(caught.exception.request_id, "r-1")
        self.assertGreater(calls[0], 1100)
        self.assertGreaterEqual(clock[0], 3600.0)


if __name__ == "__main__":
    unittest.main()
