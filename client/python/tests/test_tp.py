"""A tensor-parallel server (--tp-size 2, 4) through the Python client: replayssm.tp turns the
unsharded activations of the numpy reference into the server's rank-major tensors and its
outputs back, and prefill, decode (past a ring fold) and the stream match the reference, for
both gates; shard and unshard are each other's inverse and split mixed_qkv by section; planned
forwards in both of a TP server's forms (one group plan, rank-major; one plan per rank, each
rank's engine on its own thread and region) match the inline forward bit for bit."""

import threading
import unittest

import numpy as np

import replayssm
from replayssm import plan, regions, tp
from support import ServerTest


class ShardLayoutTest(unittest.TestCase):
    class Model:  # the fields tp reads (GetInfo's ModelInfo has them)
        tp_size, num_qk_heads, num_v_heads, head_k, head_v = 2, 2, 4, 3, 5

    def test_mixed_qkv_is_split_per_section_and_round_trips(self):
        m = self.Model
        width = 2 * 2 * 3 + 4 * 5
        x = np.arange(2 * width, dtype=np.float32).reshape(2, width)
        y = tp.shard(m, "mixed_qkv", x)
        self.assertEqual(y.shape, (2, 2, width // 2))
        # Rank 0: q head 0, k head 0, v heads 0-1 -- not the first half of the row.
        want = np.concatenate([x[0, 0:3], x[0, 6:9], x[0, 12:22]])
        np.testing.assert_array_equal(y[0, 0], want)
        np.testing.assert_array_equal(tp.unshard(m, "mixed_qkv", y), x)

    def test_head_tensors_split_by_v_head_and_round_trip(self):
        m = self.Model
        out = np.arange(3 * 4 * 5, dtype=np.float32).reshape(3, 4, 5)
        y = tp.shard(m, "out", out)
        self.assertEqual(y.shape, (2, 3, 2, 5))
        np.testing.assert_array_equal(y[1, :, 0], out[:, 2])
        np.testing.assert_array_equal(tp.unshard(m, "out", y), out)
        b = np.arange(3 * 4, dtype=np.float32).reshape(3, 4)
        np.testing.assert_array_equal(tp.unshard(m, "b", tp.shard(m, "b", b)), b)


class TpServerTest(ServerTest):
    TP = 2

    def setUp(self):
        self.SERVER_FLAGS = ("--track-interval=16", f"--tp-size={self.TP}")
        super().setUp()

    def test_prefill_decode_and_stream_match_the_reference(self):
        m = self.model
        self.assertEqual(m.tp_size, self.TP)
        slot = self.client.allocate().slot
        state = self.ref.new_state()
        layers = self.layers(5)
        got = self.client.prefill(slot, range(100, 105),
                                  [tp.shard_activations(m, x) for x in layers],
                                  return_outputs=True)
        for l, (x, out) in enumerate(zip(layers, tp.unshard_outputs(m, got.outputs))):
            self.assertClose(out, self.ref.run_layer(state, l, *x), f"prefill layer {l}")
        for step in range(m.ring_len + 1):  # past a fold
            layers = self.layers(1)
            got = self.client.decode([(slot, 7)], [tp.shard_activations(m, x) for x in layers])
            for l, (x, out) in enumerate(zip(layers, tp.unshard_outputs(m, got.outputs))):
                self.assertClose(out, self.ref.decode_layer([state], l, *x), f"step {step}")
        with self.client.open_stream() as stream:
            layers = self.layers(1)
            got = stream.forward([(slot, 2)], [tp.shard_activations(m, x) for x in layers])
        for l, (x, out) in enumerate(zip(layers, tp.unshard_outputs(m, got.outputs))):
            self.assertClose(out, self.ref.decode_layer([state], l, *x))

    def test_unsharded_activations_are_refused_naming_the_field(self):
        slot = self.client.allocate().slot
        with self.assertRaises(replayssm.InvalidArgument) as caught:
            self.client.decode([(slot, 7)], self.layers(1))
        self.assertIn("mixed_qkv", caught.exception.details)


class TpKdaServerTest(TpServerTest):
    MODEL = "tiny-kda"


class TpPlannedTest(ServerTest):
    """Planned forwards on a TP server, driven as engines would: layer by layer, inputs written,
    ready rung, done waited for. Each step runs the same activations inline on twin slots."""

    TP = 2
    MAX_TOKENS = 4

    def setUp(self):
        self.SERVER_FLAGS = ("--track-interval=16", f"--tp-size={self.TP}")
        super().setUp()

    def region(self, name, nbytes):
        r = regions.SharedMemoryRegion(name, nbytes)
        self.addCleanup(r.close)
        self.client.register_region(r)
        return r

    def run_planned(self, stream, rows, the_plan, engines):
        """Begins a planned forward over rows and runs `engines` (callables) on threads."""
        stream.begin(rows, plan=the_plan)
        errors = []

        def run(engine):
            try:
                engine()
            except replayssm.ReplaySSMError as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(e,)) for e in engines]
        for t in threads:
            t.start()
        try:
            return stream.commit()
        finally:
            for t in threads:
                t.join()
            self.assertEqual(errors, [])

    def check_steps(self, the_plan, engines_for, outputs_of):
        """ring_len + 1 decode steps (past a fold) of 2 planned rows and 2 inline twins."""
        m = self.model
        planned = [self.client.allocate().slot for _ in range(2)]
        inline = [self.client.allocate().slot for _ in range(2)]
        with self.client.open_stream() as stream:
            for step in range(m.ring_len + 1):
                layers = [tp.shard_activations(m, x) for x in self.layers(2)]
                self.run_planned(stream, [(s, 9) for s in planned], the_plan,
                                 engines_for(layers))
                want = self.client.decode([(s, 9) for s in inline], layers).outputs
                for l, w in enumerate(want):
                    np.testing.assert_array_equal(outputs_of(l, 2), w,
                                                  err_msg=f"step {step}, layer {l}")

    def test_a_group_plan_holds_the_ranks_tensors_rank_major(self):
        m = self.model
        region = self.region("group", plan.ForwardPlan.nbytes(m, self.MAX_TOKENS))
        p = plan.ForwardPlan.layout(region, m, self.MAX_TOKENS)
        width = 2 * m.num_qk_heads * m.head_k + m.num_v_heads * m.head_v
        self.assertEqual(p.layers[0].mixed_qkv.shape, (self.TP, self.MAX_TOKENS,
                                                       width // self.TP))
        self.assertEqual(p.layer(0, 2).out.shape, (self.TP, 2, m.num_v_heads // self.TP,
                                                   m.head_v))

        def engines_for(layers):
            def engine():
                for l, x in enumerate(layers):
                    for tensor, value in zip(p.layer(l, 2), x):
                        tensor.write(value)
                    p.ring(l)
                    p.wait_done(l, timeout=20)
            return [engine]

        self.check_steps(p, engines_for, lambda l, n: p.layer(l, n).out.read())

    def test_a_plan_per_rank_runs_each_rank_on_its_own_doorbells(self):
        m = self.model
        nbytes = plan.RankedForwardPlan.nbytes(m, self.MAX_TOKENS)
        p = plan.RankedForwardPlan.layout(
            [self.region(f"rank{r}", nbytes) for r in range(self.TP)], m, self.MAX_TOKENS)
        self.assertEqual(p.layer(1, 0, 2).b.shape, (2, m.num_v_heads // self.TP))

        def engines_for(layers):
            def engine(r):
                for l, x in enumerate(layers):
                    for tensor, value in zip(p.layer(r, l, 2), x):
                        tensor.write(value[r])  # this rank's share of the rank-major tensor
                    p.ring(r, l)
                    p.wait_done(r, l, timeout=20)
            return [lambda r=r: engine(r) for r in range(self.TP)]

        self.check_steps(p, engines_for, lambda l, n: np.stack(
            [p.layer(r, l, n).out.read() for r in range(self.TP)]))

    def test_a_plan_per_rank_needs_one_region_per_rank(self):
        region = self.region("one", plan.RankedForwardPlan.nbytes(self.model, 1))
        with self.assertRaises(replayssm.InvalidArgument) as caught:
            plan.RankedForwardPlan.layout([region], self.model, 1)
        self.assertIn("regions: expected 2", str(caught.exception))


class TpKdaPlannedTest(TpPlannedTest):
    MODEL = "tiny-kda"


class Tp4ServerTest(TpServerTest):
    TP = 4
    MODEL = "tiny-gdn-tp"


if __name__ == "__main__":
    unittest.main()
