"""Tensors, dtypes and the reference without a server: bf16 rounding as the C++
client does it, the bytes a Tensor carries, what the client refuses and how it names it."""

import unittest

import numpy as np

import replayssm
from replayssm import dtypes, pb, tensors


class Bf16Test(unittest.TestCase):
    def test_rounding_is_to_nearest_even(self):
        x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, -2.5],
                     np.float32)
        got = tensors.bf16_bits_to_float(tensors.float_to_bf16_bits(x))
        np.testing.assert_array_equal(got, [1.0, 1.0, 1.0 + 2**-6, 1.0 + 2**-7, -2.5])

    def test_nan_stays_nan_and_infinities_stay_infinite(self):
        x = np.array([np.nan, -np.nan, np.inf, -np.inf, 3.4e38], np.float32)
        got = tensors.bf16_bits_to_float(tensors.float_to_bf16_bits(x))
        self.assertTrue(np.isnan(got[0]) and np.isnan(got[1]))
        self.assertEqual(list(got[2:4]), [np.inf, -np.inf])
        self.assertEqual(got[4], np.inf)  # above bf16's largest finite value

    def test_float64_is_rounded_to_float32_first_as_torch_does(self):
        # 1 + 2^-8 + 2^-30 is above the bf16 midpoint 1 + 2^-8, but float32 drops the 2^-30,
        # and the midpoint rounds to even: 1.0 (nearest from float64 would be 1 + 2^-7).
        x = np.array([1 + 2 ** -8 + 2 ** -30, -(1 + 2 ** -8 + 2 ** -30)])
        bits = tensors.float_to_bf16_bits(x)
        np.testing.assert_array_equal(tensors.bf16_bits_to_float(bits), [1.0, -1.0])
        np.testing.assert_array_equal(bits, tensors.float_to_bf16_bits(x.astype(np.float32)))
        self.assertEqual(tensors.to_proto(x, "bf16").data, bits.astype("<u2").tobytes())

    def test_a_float32_array_sent_as_bf16_carries_two_bytes_per_value(self):
        t = tensors.to_proto(np.array([[1.0, -2.0], [0.5, 3.0]], np.float32), "bf16")
        self.assertEqual((t.dtype, list(t.shape)), (pb.DTYPE_BF16, [2, 2]))
        self.assertEqual(t.data, bytes.fromhex("803f00c0003f4040"))
        np.testing.assert_array_equal(tensors.to_numpy(t), [[1.0, -2.0], [0.5, 3.0]])


class TensorTest(unittest.TestCase):
    def test_an_array_keeps_its_dtype_and_shape_row_major(self):
        x = np.arange(6, dtype=np.float16).reshape(2, 3)
        t = tensors.to_proto(x.T)  # a transposed view is sent dense, row-major
        self.assertEqual((t.dtype, list(t.shape)), (pb.DTYPE_F16, [3, 2]))
        np.testing.assert_array_equal(tensors.to_numpy(t), x.T)
        self.assertEqual(tensors.to_numpy(t).dtype, np.float16)

    def test_a_dtype_casts_and_float64_needs_one(self):
        t = tensors.to_proto(np.array([0.1, 0.2]), replayssm.F32)
        self.assertEqual(t.data, np.array([0.1, 0.2], "<f4").tobytes())
        with self.assertRaises(replayssm.InvalidArgument) as caught:
            tensors.to_proto(np.array([0.1]), field="layers[0].b")
        self.assertIn("layers[0].b.dtype: expected float32 or float16", caught.exception.details)

    def test_integer_input_is_refused_naming_the_field(self):
        with self.assertRaises(replayssm.InvalidArgument) as caught:
            tensors.to_proto(np.arange(3), "f32", field="layers[2].a")
        self.assertEqual(caught.exception.details,
                         "layers[2].a.dtype: expected a floating-point array, got int64")

    def test_a_reply_whose_bytes_do_not_fit_its_shape_is_refused(self):
        t = pb.Tensor(dtype=pb.DTYPE_F32, shape=[2, 2], data=b"\0" * 12)
        with self.assertRaises(replayssm.InvalidArgument) as caught:
            tensors.to_numpy(t, "layers[0].out")
        self.assertIn("layers[0].out.data: expected 16 bytes for f32 [2, 2], got 12",
                      caught.exception.details)

    def test_dtype_spellings(self):
        for spelling, code in [("bf16", pb.DTYPE_BF16), ("bfloat16", pb.DTYPE_BF16),
                               ("float32", pb.DTYPE_F32), (np.float16, pb.DTYPE_F16),
                               (np.dtype("float32"), pb.DTYPE_F32), (pb.DTYPE_F16, pb.DTYPE_F16)]:
            self.assertEqual(dtypes.dtype_code(spelling), code, spelling)
        with self.assertRaises(replayssm.InvalidArgument):
            dtypes.dtype_code("int8")

    def test_a_layer_input_is_cast_to_the_activation_dtype(self):
        x = replayssm.Activations(np.ones((1, 4), np.float32), np.ones((1, 2), np.float32),
                                  np.ones((1, 2), np.float32))
        layer = tensors.layer_input(3, x, replayssm.BF16, "layers[3]")
        self.assertEqual(layer.layer, 3)
        self.assertEqual([layer.mixed_qkv.dtype, layer.a.dtype, layer.b.dtype],
                         [pb.DTYPE_BF16] * 3)
        with self.assertRaises(replayssm.InvalidArgument) as caught:
            tensors.layer_input(0, [np.ones(1)], replayssm.F32, "layers[0]")
        self.assertIn("layers[0]: expected Activations(mixed_qkv, a, b)", str(caught.exception))


class ReferenceTest(unittest.TestCase):
    def model(self, kda=False, act=pb.DTYPE_F32, ring=pb.DTYPE_F32, round_beta=False):
        m = pb.ModelInfo(num_layers=1, gate=pb.GATE_KDA if kda else pb.GATE_GDN,
                         num_qk_heads=1, num_v_heads=2, head_k=2, head_v=2, ring_len=4,
                         state_dtype=pb.DTYPE_F32, act_dtype=act, ring_dtype=ring,
                         round_beta=round_beta)
        m.layer_params.add(a_log=[0.0, 0.0], dt_bias=[0.0] * (4 if kda else 2), scale=1.0,
                           use_qk_l2norm=False)
        return m

    def test_one_step_from_zero_is_beta_v_times_k_dot_q(self):
        ref = replayssm.Reference(self.model())
        state = ref.new_state()
        q, k, v = [1.0, 2.0], [0.5, -1.0], [[1.0, 2.0], [3.0, 4.0]]
        x = np.array([q + k + v[0] + v[1]], np.float32)
        out = ref.run_layer(state, 0, x, np.zeros((1, 2), np.float32),
                            np.zeros((1, 2), np.float32))
        beta, kq = 0.5, 0.5 * 1.0 + -1.0 * 2.0  # sigmoid(0); both v-heads share the qk-head
        np.testing.assert_allclose(out[0], beta * kq * np.array(v), rtol=1e-12)
        np.testing.assert_allclose(state[0][1], beta * np.outer(v[1], k), rtol=1e-12)

    def test_the_second_step_decays_the_state_by_the_gate(self):
        ref = replayssm.Reference(self.model(kda=True))
        state = ref.new_state()
        state[0][:] = 1.0
        a = np.array([[[0.0, 30.0], [0.0, 0.0]]], np.float32)  # [1, HV, K]: per-channel decay
        x = np.zeros((1, 8), np.float32)  # q [1, 2] | k [1, 2] | v [2, 2]
        ref.run_layer(state, 0, x, a, np.zeros((1, 2), np.float32))
        decay = np.exp(-np.log1p(np.exp(0.0)))  # g = -exp(0) * softplus(0)
        np.testing.assert_allclose(state[0][0], [[decay, np.exp(-30.0)]] * 2, rtol=1e-12)
        np.testing.assert_allclose(state[0][1], decay, rtol=1e-12)

    def test_round_beta_rounds_sigmoid_b_to_the_act_dtype(self):
        b = np.full((1, 2), 0.3125, np.float32)  # bf16-exact input; its sigmoid is not
        x = np.array([[1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]], np.float32)
        a = np.zeros((1, 2), np.float32)
        beta = 1.0 / (1.0 + np.exp(-0.3125))
        beta_bf16 = float(tensors.to_numpy(tensors.to_proto(np.array([beta]), pb.DTYPE_BF16))[0])
        self.assertNotEqual(beta, beta_bf16)
        for round_beta, expected in ((False, beta), (True, beta_bf16)):
            ref = replayssm.Reference(self.model(act=pb.DTYPE_BF16, round_beta=round_beta))
            out = ref.run_layer(ref.new_state(), 0, x, a, b)
            np.testing.assert_allclose(out[0], expected, rtol=1e-12)  # k.q = 1, v = 1
        # With fp32 activations the option changes nothing.
        ref = replayssm.Reference(self.model(round_beta=True))
        out = ref.run_layer(ref.new_state(), 0, x, a, b)
        np.testing.assert_allclose(out[0], beta, rtol=1e-12)

    def test_a_bf16_ring_rounds_the_state_update_but_not_the_output(self):
        x = np.array([[1.0, 0.0, 1.0, 0.0, 0.3, 0.3, 0.3, 0.3]], np.float32)  # d = 0.15 + ...
        a, b = np.zeros((1, 2), np.float32), np.zeros((1, 2), np.float32)
        results = {}
        for ring in (pb.DTYPE_F32, pb.DTYPE_BF16):
            ref = replayssm.Reference(self.model(ring=ring))
            state = ref.new_state()
            results[ring] = (ref.run_layer(state, 0, x, a, b), state[0])
        d = 0.5 * 0.30000001192092896  # beta * v (the state starts at zero)
        d_bf16 = float(tensors.to_numpy(tensors.to_proto(np.array([d]), pb.DTYPE_BF16))[0])
        self.assertNotEqual(d, d_bf16)
        np.testing.assert_allclose(results[pb.DTYPE_BF16][0], results[pb.DTYPE_F32][0], rtol=0)
        np.testing.assert_allclose(results[pb.DTYPE_F32][1][:, :, 0], d, rtol=1e-12)
        np.testing.assert_allclose(results[pb.DTYPE_BF16][1][:, :, 0], d_bf16, rtol=1e-12)


if __name__ == "__main__":
    unittest.main()
