"""The other gate and dtype paths against the reference: Kimi Delta Attention (per-channel
decay, `a` of [N, HV, K]) and a model with bf16 activations (from a Hugging Face config.json),
whose tensors the client rounds to bf16 on the way in and widens on the way out."""

import unittest

import numpy as np

import replayssm
from support import BF16_CONFIG, ServerTest, config_file


class KdaTest(ServerTest):
    MODEL = "tiny-kda"

    def test_kda_prefill_decode_and_stream_match_the_reference(self):
        self.assertEqual(self.model.gate, replayssm.pb.GATE_KDA)
        slot = self.client.allocate().slot
        state = self.ref.new_state()
        self.prefill(slot, state, 4)
        for _ in range(self.model.ring_len + 1):
            self.decode([slot], [state])
        with self.client.open_stream() as stream:
            layers = self.layers(1)
            got = stream.forward([(slot, 2)], layers)
        for l, x in enumerate(layers):
            self.assertClose(got.outputs[l], self.ref.decode_layer([state], l, *x))


class Bf16ActivationsTest(ServerTest):
    def setUp(self):
        self.MODEL = config_file(self, BF16_CONFIG)
        super().setUp()

    def test_float32_inputs_are_sent_as_bf16_and_outputs_match_the_reference(self):
        self.assertEqual((self.model.act_dtype, self.model.num_layers), (replayssm.BF16, 2))
        self.assertTrue(self.model.params_from_seed)
        slot = self.client.allocate().slot
        state = self.ref.new_state()
        self.prefill(slot, state, 3)
        got = self.decode([slot], [state])
        self.assertEqual(got.outputs[0].dtype, np.float32)
        self.assertEqual(got.outputs[0].shape, (1, 4, 32))
        # bf16 widens to float32 exactly: the low 16 bits of every output are zero.
        widened = got.outputs[0].view(np.uint32)
        self.assertFalse(np.any(widened & 0xFFFF))


if __name__ == "__main__":
    unittest.main()
