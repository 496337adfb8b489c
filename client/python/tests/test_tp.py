"""A tensor-parallel server (--tp-size 2, 4) through the Python client: replayssm.tp turns the
unsharded activations of the numpy reference into the server's rank-major tensors and its
outputs back, and prefill, decode (past a ring fold) and the stream match the reference, for
both gates; shard and unshard are each other's inverse and split mixed_qkv by section."""

import unittest

import numpy as np

import replayssm
from replayssm import tp
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


class Tp4ServerTest(TpServerTest):
    TP = 4
    MODEL = "tiny-gdn-tp"


if __name__ == "__main__":
    unittest.main()
