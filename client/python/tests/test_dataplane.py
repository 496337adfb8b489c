"""The data plane from Python against a real server (CPU backend, POSIX shared memory), as
tests/dataplane_test.cc does it in C++: planned forwards of every kind, bit for bit against the
inline forms; layer messages naming regions; a doorbell never rung; a client process killed
mid-forward; a region unregistered while a forward uses it; and the client-side pieces
(cyclic doorbell values, plan layout, refusals before sending, the MPS warning)."""

import os
import subprocess
import sys
import threading
import time
import unittest
import warnings

import numpy as np

import replayssm
from replayssm import pb, plan, regions
from replayssm.v1 import regions_pb2
from support import ServerTest, rows_of


class Engine:
    """The test's engine: a shm region holding a ForwardPlan for up to max_tokens tokens."""

    def __init__(self, model, max_tokens, name="engine", offset=0):
        self.region = regions.SharedMemoryRegion(
            name, offset + plan.ForwardPlan.nbytes(model, max_tokens))
        self.plan = plan.ForwardPlan.layout(self.region, model, max_tokens, offset)

    def write(self, l, inputs):
        """Layer l's inputs into the region (what the engine's previous layer would write)."""
        for tensor, x in zip(self.plan.layers[l].head(len(inputs[0])), inputs):
            tensor.write(x)

    def out(self, l, n):
        return self.plan.layers[l].out.head(n).read()

    def drive(self, layers):
        """Layer by layer: inputs written only after the previous layer's output is done."""
        for l, inputs in enumerate(layers):
            self.write(l, inputs)
            self.plan.ring(l)
            self.plan.wait_done(l, timeout=20)


class EngineTest(ServerTest):
    """A server, and an Engine whose region is registered as "engine"."""

    def setUp(self):
        super().setUp()
        self.engine = Engine(self.model, 64)
        self.addCleanup(self.engine.region.close)
        self.client.register_region(self.engine.region)

    def slots(self, n):
        return [self.client.allocate().slot for _ in range(n)]

    def in_use(self, name="engine"):
        [status] = self.client.region_status(name)
        return status.in_use

    def run_planned(self, stream, begin, layers):
        """begin() a planned forward, drive it from a thread as an engine would, commit."""
        begin(self.engine.plan)
        error = []

        def drive():
            try:
                self.engine.drive(layers)
            except replayssm.ReplaySSMError as e:
                error.append(e)

        engine = threading.Thread(target=drive)
        engine.start()
        try:
            return stream.commit()
        finally:
            engine.join()
            self.assertEqual(error, [])

    def assertOutputsEqual(self, n, want):
        for l, w in enumerate(want):
            np.testing.assert_array_equal(self.engine.out(l, n), w, err_msg=f"layer {l}")


class DataPlaneTest(EngineTest):
    def test_planned_decode_matches_inline_bit_for_bit_across_folds(self):
        planned, inline = self.slots(2), self.slots(2)
        with self.client.open_stream() as stream:
            for f in range(6):  # past a ring fold (L = 4 for tiny-gdn)
                layers = self.layers(2)
                rows = self.run_planned(
                    stream, lambda p: stream.begin([(s, 9) for s in planned], plan=p), layers)
                self.assertEqual([r.seq_len for r in rows], [f + 1, f + 1])
                want = stream.forward([(s, 9) for s in inline], layers)
                self.assertOutputsEqual(2, want.outputs)
        for p, i in zip(planned, inline):
            self.assertEqual(self.observe(p), self.observe(i))
        self.assertEqual(self.in_use(), 0)
        self.assertEqual(self.engine.plan.value, 6)

    def test_pipelined_begins_close_the_planned_forward_before_them(self):
        planned, inline = self.slots(2), self.slots(2)
        with self.client.open_stream() as stream, self.client.open_stream() as reference:
            for f in range(6):
                layers = self.layers(2)
                # Sent without waiting: the engine drives the layers before reading the reply.
                self.assertIsNone(stream.begin([(s, 9) for s in planned], plan=self.engine.plan,
                                               wait=False))
                with self.assertRaises(replayssm.FailedPrecondition):
                    stream.commit()  # the begin's reply comes first
                self.engine.drive(layers)
                begun = stream.await_begun()
                self.assertEqual([r.seq_len for r in begun.closed.rows], [f, f] if f else [])
                want = reference.forward([(s, 9) for s in inline], layers)
                self.assertOutputsEqual(2, want.outputs)
            rows = stream.commit()
            self.assertEqual([r.seq_len for r in rows], [6, 6])
        for p, i in zip(planned, inline):
            self.assertEqual(self.observe(p), self.observe(i))
        self.assertEqual(self.in_use(), 0)

    def test_a_refused_pipelined_begin_rings_done_and_raises(self):
        [s] = self.slots(1)
        self.client.free(s)
        with self.client.open_stream() as stream:
            stream.begin([(s, 9)], plan=self.engine.plan, wait=False)
            for l in range(self.model.num_layers):
                self.engine.plan.ring(l)
                self.engine.plan.wait_done(l, timeout=10)  # rung by the server for the refusal
            with self.assertRaises(replayssm.NotFound):
                stream.await_begun()
        self.assertEqual(self.in_use(), 0)

    def test_planned_prefill_and_verify_match_the_inline_forms(self):
        planned, inline = self.slots(2), self.slots(2)
        tokens = [[50, 51, 52], [50, 51, 52, 53, 54]]  # 3 + 5 tokens packed in row order
        layers = self.layers(8)
        with self.client.open_stream() as stream:
            self.run_planned(stream, lambda p: stream.begin_prefill(
                list(zip(planned, tokens)), plan=p), layers)
            stream.begin_prefill(list(zip(inline, tokens)))
            want = [stream.run_layer(l, *x) for l, x in enumerate(layers)]
            stream.commit()
            self.assertOutputsEqual(8, want)
            for p, i in zip(planned, inline):
                self.assertEqual(self.observe(p), self.observe(i))

            drafts = [[1, 2], [3, 4]]
            layers = self.layers(4)
            self.run_planned(stream, lambda p: stream.begin_verify(planned, drafts, plan=p),
                             layers)
        want = self.client.verify(inline, drafts, layers)
        self.assertOutputsEqual(4, want)
        for p, i in zip(planned, inline):
            self.client.accept(p, 1)
            self.client.accept(i, 1)
            self.assertEqual(self.observe(p), self.observe(i))

    def test_a_plan_at_an_offset_fits_offset_plus_nbytes_and_matches_inline(self):
        shifted = Engine(self.model, 2, "shifted", offset=16)
        self.addCleanup(shifted.region.close)
        self.client.register_region(shifted.region)
        planned, inline = self.slots(2), self.slots(2)
        layers = self.layers(2)
        with self.client.open_stream() as stream:
            stream.begin([(s, 9) for s in planned], plan=shifted.plan)
            shifted.drive(layers)
            self.assertEqual([r.seq_len for r in stream.commit()], [1, 1])
            want = stream.forward([(s, 9) for s in inline], layers)
        for l, w in enumerate(want.outputs):
            np.testing.assert_array_equal(shifted.out(l, 2), w, err_msg=f"layer {l}")
        for p, i in zip(planned, inline):
            self.assertEqual(self.observe(p), self.observe(i))

    def test_unary_calls_take_layers_in_regions_as_layer_messages_do(self):
        [a], [b] = self.slots(1), self.slots(1)
        prompt = self.layers(3)
        for l, x in enumerate(prompt):
            self.engine.write(l, x)
        named = [self.engine.plan.layers[l].head(3) for l in range(self.model.num_layers)]
        got = self.client.prefill(a, [1, 2, 3], named, return_outputs=True)
        want = self.client.prefill(b, [1, 2, 3], prompt, return_outputs=True)
        self.assertEqual(got.outputs, [layer.out for layer in named])
        self.assertOutputsEqual(3, want.outputs)
        self.assertEqual(got.state.seq_len, 3)
        step = self.layers(1)
        for l, x in enumerate(step):
            self.engine.write(l, x)
        named = [self.engine.plan.layers[l].head(1) for l in range(self.model.num_layers)]
        got = self.client.decode([(a, 4)], named)
        want = self.client.decode([(b, 4)], step)
        self.assertEqual(got.outputs, [layer.out for layer in named])
        self.assertOutputsEqual(1, want.outputs)
        drafts = self.layers(2)
        for l, x in enumerate(drafts):
            self.engine.write(l, x)
        named = [self.engine.plan.layers[l].head(2) for l in range(self.model.num_layers)]
        self.client.verify([a], [[5, 6]], named)
        self.assertOutputsEqual(2, self.client.verify([b], [[5, 6]], drafts))
        self.client.accept(a, 1)
        self.client.accept(b, 1)
        self.assertEqual(self.observe(a), self.observe(b))
        self.assertEqual(self.in_use(), 0)
        mixed = list(named)
        mixed[1] = replayssm.Activations(*named[1][:3])  # regions without an output
        with self.assertRaises(replayssm.InvalidArgument) as caught:
            self.client.verify([a], [[7, 8]], mixed)
        self.assertIn("layers[1].out: expected a RegionTensor", caught.exception.details)

    def test_layer_messages_naming_regions_match_inline(self):
        [a], [b] = self.slots(1), self.slots(1)
        layers = self.layers(1)
        with self.client.open_stream() as stream:
            stream.begin([(a, 9)])
            for l, x in enumerate(layers):
                self.engine.write(l, x)
                named = self.engine.plan.layers[l].head(1)
                self.assertIs(stream.run_layer(l, *named[:3], out=named.out), named.out)
            stream.commit()
            want = stream.forward([(b, 9)], layers)
        self.assertOutputsEqual(1, want.outputs)
        self.assertEqual(self.observe(a), self.observe(b))

    def test_a_layer_message_mixing_regions_and_inline_is_refused_before_sending(self):
        [s] = self.slots(1)
        layers = self.layers(1)
        x = layers[0]
        named = self.engine.plan.layers[0].head(1)
        with self.client.open_stream() as stream:
            stream.begin([(s, 9)])
            with self.assertRaises(replayssm.InvalidArgument) as caught:
                stream.run_layer(0, named.mixed_qkv, x.a, named.b, out=named.out)
            self.assertIn("layer.a: expected a RegionTensor", caught.exception.details)
            stream.begin([(s, 9)])  # the refusal abandoned the forward, as an error does
            with self.assertRaises(replayssm.InvalidArgument) as caught:
                stream.run_layer(0, *named[:3])
            self.assertIn("layer.out: expected a RegionTensor", caught.exception.details)
            self.assertEqual(self.client.get_slot(s).seq_len, 0)
            self.assertEqual(stream.forward([(s, 9)], layers).rows[0].seq_len, 1)

    def test_a_planned_forward_takes_no_layer_messages(self):
        [s] = self.slots(1)
        with self.client.open_stream() as stream:
            stream.begin([(s, 9)], plan=self.engine.plan)
            with self.assertRaises(replayssm.FailedPrecondition) as caught:
                stream.run_layer(0, *self.layers(1)[0])
            self.assertIn("layer 0: the open forward is planned", caught.exception.details)
            self.engine.drive(self.layers(1))
            self.assertEqual(stream.commit()[0].seq_len, 1)

    def test_a_client_process_killed_mid_forward_changes_nothing_and_releases_its_region(self):
        slots = self.slots(2)
        before = [self.observe(s) for s in slots]
        key = f"/replayssm-pychild-{os.getpid()}"
        self.addCleanup(_unlink_shm, key)
        child = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(__file__), "dataplane_child.py"),
             self.server.grpc_address, "child", key, *map(str, slots)],
            stdout=subprocess.PIPE, text=True)
        self.addCleanup(child.wait)
        self.addCleanup(child.kill)
        self.assertEqual(child.stdout.readline().strip(), "rung")  # layer 0 ran
        self.assertEqual(self.in_use("child"), 1)
        child.kill()
        child.wait()
        child.stdout.close()
        end = time.monotonic() + 5
        while self.in_use("child") != 0 and time.monotonic() < end:
            time.sleep(0.01)
        self.assertEqual(self.in_use("child"), 0)
        self.assertEqual([self.observe(s) for s in slots], before)
        with self.client.open_stream() as stream:
            rows = stream.forward([(s, 9) for s in slots], self.layers(2)).rows
        self.assertEqual([r.seq_len for r in rows], [1, 1])

    def test_unregistering_a_region_in_use_waits_for_the_forward(self):
        [s] = self.slots(1)
        with self.client.open_stream() as stream:
            stream.begin([(s, 9)], plan=self.engine.plan)
            self.assertEqual(self.in_use(), 1)
            self.client.unregister_region("engine")
            with self.assertRaises(replayssm.NotFound):
                self.client.region_status("engine")
            engine = threading.Thread(target=self.engine.drive, args=(self.layers(1),))
            engine.start()
            self.assertEqual(stream.commit()[0].seq_len, 1)
            engine.join()
            with self.assertRaises(replayssm.NotFound) as caught:  # a new forward naming it
                stream.begin([(s, 9)], plan=self.engine.plan)
        self.assertIn("begin.plan.ready.region", caught.exception.details)
        self.assertEqual(self.client.get_slot(s).seq_len, 1)

    def test_a_bad_plan_is_refused_by_field_and_changes_nothing(self):
        [s] = self.slots(1)
        before = self.observe(s)
        good = self.engine.plan
        elsewhere = regions.SharedMemoryRegion("unregistered", self.engine.region.nbytes)
        self.addCleanup(elsewhere.close)
        cases = [
            (plan.ForwardPlan([good.layers[0]._replace(a=regions.RegionTensor.at(
                elsewhere, 0, self.model.act_dtype, good.layers[0].a.shape))] +
                good.layers[1:], good.ready, good.done),
             replayssm.NotFound, "begin.plan.layers[0].a.region"),
            (plan.ForwardPlan(good.layers[:-1], *_doorbells(good, self.model.num_layers - 1)),
             replayssm.InvalidArgument, "begin.plan.layers: expected"),
        ]
        for bad, error, field in cases:
            with self.client.open_stream() as stream, self.assertRaises(error) as caught:
                stream.begin([(s, 9)], plan=bad)
            self.assertIn(field, caught.exception.details)
        self.assertEqual(self.observe(s), before)
        self.assertEqual(self.in_use(), 0)


class ForwardTimeoutTest(EngineTest):
    """A server that abandons a planned forward 1 s after its begin."""

    SERVER_FLAGS = ("--track-interval=16", "--forward-timeout=1")

    def test_a_doorbell_never_rung_fails_the_commit_and_moves_no_cursor(self):
        [s] = self.slots(1)
        before = self.observe(s)
        layers = self.layers(1)
        with self.client.open_stream() as stream:
            stream.begin([(s, 9)], plan=self.engine.plan)
            self.engine.write(0, layers[0])
            self.engine.plan.ring(0)  # layer 0 only
            with self.assertRaises(replayssm.DeadlineExceeded) as caught:
                stream.commit()
        self.assertIn("layer 1", caught.exception.details)
        self.assertEqual(self.observe(s), before)
        self.assertEqual(self.in_use(), 0)
        with self.client.open_stream() as again:  # the slot takes the next forward
            self.assertEqual(again.forward([(s, 9)], layers).rows[0].seq_len, 1)

def _doorbells(good, count):
    return (plan.Doorbells(good.ready.region, good.ready.offset, count),
            plan.Doorbells(good.done.region, good.done.offset, count))


def _unlink_shm(key):
    try:
        os.unlink("/dev/shm" + key)
    except FileNotFoundError:
        pass


class DoorbellTest(unittest.TestCase):
    """The client's side alone: no server."""

    def model(self, num_layers=3):
        return pb.ModelInfo(num_layers=num_layers, num_qk_heads=2, num_v_heads=4, head_k=8,
                            head_v=8, gate=pb.GATE_GDN, act_dtype=pb.DTYPE_BF16)

    def test_values_compare_cyclically_across_the_wrap(self):
        self.assertTrue(plan.reached(5, 5))
        self.assertTrue(plan.reached(6, 5))
        self.assertFalse(plan.reached(4, 5))
        self.assertTrue(plan.reached(2, 0xFFFFFFFE))  # rung past the wrap
        self.assertFalse(plan.reached(0xFFFFFFFE, 2))
        self.assertFalse(plan.reached(0, 1))  # fresh memory does not satisfy the first value

    def test_a_plan_starts_past_every_word_already_in_its_doorbells(self):
        model = self.model()
        with regions.SharedMemoryRegion("p", plan.ForwardPlan.nbytes(model, 4)) as region:
            first = plan.ForwardPlan.layout(region, model, 4)
            self.assertEqual(first.value, 0)
            first.value = 0xFFFFFFFF
            self.assertEqual(first.next_value(), 0)  # wraps
            first.ring(1)
            region.ndarray(4 * 3, (3,), np.uint32, 4)[2] = 0xFFFFFFF0  # an old done word
            again = plan.ForwardPlan.layout(region, model, 4)
            self.assertEqual(again.next_value(), 1)
            self.assertFalse(plan.reached(again.ready.words()[1], again.value))

    def test_a_layout_places_every_tensor_aligned_and_inside_the_region(self):
        model = self.model()
        nbytes = plan.ForwardPlan.nbytes(model, 5)
        with regions.SharedMemoryRegion("p", nbytes) as region:
            p = plan.ForwardPlan.layout(region, model, 5)
            refs = p.proto()
            self.assertEqual((refs.ready.offset, refs.done.offset), (0, 12))
            ends = []
            for layer in p.layers:
                self.assertEqual([t.shape for t in layer], [(5, 64), (5, 4), (5, 4), (5, 4, 8)])
                for t in layer:
                    self.assertEqual(t.offset % 64, 0)
                    ends.append((t.offset, t.offset + 2 * int(np.prod(t.shape))))
            ends.sort()
            self.assertTrue(all(a[1] <= b[0] for a, b in zip(ends, ends[1:])))  # disjoint
            self.assertLessEqual(ends[-1][1], nbytes)
            with self.assertRaises(replayssm.InvalidArgument):
                plan.ForwardPlan.layout(region, model, 6)

    def test_nbytes_from_any_aligned_offset_holds_the_whole_layout(self):
        model = self.model()
        nbytes = plan.ForwardPlan.nbytes(model, 5)
        for offset in (16, 48, 64, 4096 + 32):
            with regions.SharedMemoryRegion("p", offset + nbytes) as region:
                p = plan.ForwardPlan.layout(region, model, 5, offset)
                self.assertEqual((p.ready.offset, p.done.offset), (offset, offset + 12))
                for layer in p.layers:
                    for t in layer:
                        self.assertEqual((t.offset - offset) % 64, 0, f"offset {offset}")
                        self.assertLessEqual(t.offset + 2 * int(np.prod(t.shape)),
                                             offset + nbytes)
                with self.assertRaises(replayssm.InvalidArgument):
                    plan.ForwardPlan.layout(region, model, 5, offset + 16)

    def test_a_wait_never_answered_raises_deadline_exceeded_naming_the_word(self):
        model = self.model()
        with regions.SharedMemoryRegion("p", plan.ForwardPlan.nbytes(model, 1)) as region:
            p = plan.ForwardPlan.layout(region, model, 1)
            p.next_value()
            with self.assertRaises(replayssm.DeadlineExceeded) as caught:
                p.wait_done(2, timeout=0.05)
            self.assertIn("done[2]: expected 1, got 0", caught.exception.details)
            with self.assertRaises(replayssm.InvalidArgument):
                p.ring(3)

    def test_a_region_tensor_round_trips_bf16_values_rounded_as_on_the_wire(self):
        with regions.SharedMemoryRegion("p", 1024) as region:
            t = regions.RegionTensor.at(region, 64, "bf16", (2, 3))
            x = np.array([[1.0, 1.00390625, -2.5], [3.0e-3, 7.0, 1.0 + 2 ** -9]], np.float32)
            t.write(x)
            wire = replayssm.tensors.to_numpy(replayssm.tensors.to_proto(x, "bf16"))
            np.testing.assert_array_equal(t.read(), wire)
            with self.assertRaises(replayssm.InvalidArgument) as caught:
                t.write(x[:1])
            self.assertIn("p@64.shape: expected [2, 3], got [1, 3]", caught.exception.details)


class MpsWarningTest(unittest.TestCase):
    """The warning once per client when a CUDA region meets a CUDA server without MPS."""

    class Regions:
        def RegisterCudaRegion(self, request, timeout=None):
            return regions_pb2.RegisterRegionResponse()

    def register_twice(self, backend, mps):
        client = replayssm.Client("127.0.0.1:1")
        self.addCleanup(client.close)
        client.regions_stub = self.Regions()
        client._info = pb.GetInfoResponse(backend=backend, mps=mps)
        region = regions.CudaRegion("gpu", bytes(64), device_id=0, offset=0, nbytes=1024)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            client.register_region(region)
            client.register_region(region)
        return [str(w.message) for w in caught]

    def test_a_cuda_server_without_mps_is_warned_about_once(self):
        [message] = self.register_twice("cuda:0", False)
        self.assertIn("without MPS", message)
        self.assertIn("nvidia-cuda-mps-control -d", message)

    def test_a_server_under_mps_is_not_warned_about(self):
        self.assertEqual(self.register_twice("cuda:0", True), [])


if __name__ == "__main__":
    unittest.main()
