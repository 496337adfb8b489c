"""torch tensors inline (registered with ctest only where torch is importable): inputs keep or
take the wire dtype (bf16 included), outputs come back as torch tensors on the inputs' device
(CUDA too where a GPU is visible), equal to what the same numpy inputs give."""

import unittest

import numpy as np
import torch

import replayssm
from replayssm import pb, regions, tensors
from support import ServerTest

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class TorchTensorTest(unittest.TestCase):
    def test_a_torch_tensor_written_into_shared_memory_reads_back_its_values(self):
        with regions.SharedMemoryRegion("acts", 1024) as region:
            for device in DEVICES:
                t = regions.RegionTensor.at(region, 64, "bf16", (2, 3))
                x = torch.randn(2, 3, device=device).to(torch.bfloat16)
                t.write(x)
                np.testing.assert_array_equal(t.read(), x.float().cpu().numpy())

    def test_bf16_tensors_travel_as_their_own_bits(self):
        for device in DEVICES:
            x = torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.bfloat16, device=device)
            t = tensors.to_proto(x)
            self.assertEqual((t.dtype, list(t.shape)), (pb.DTYPE_BF16, [2, 2]))
            self.assertEqual(t.data, bytes.fromhex("803f00c0003f4040"))
            back = tensors.like(t, x)
            self.assertEqual((back.dtype, back.device), (torch.bfloat16, x.device))
            self.assertTrue(torch.equal(back, x))

    def test_a_float32_tensor_cast_to_bf16_rounds_as_numpy_does(self):
        x = torch.randn(3, 5, dtype=torch.float32)
        self.assertEqual(tensors.to_proto(x, "bf16").data,
                         tensors.to_proto(x.numpy(), "bf16").data)

    def test_an_integer_tensor_is_refused_naming_the_field(self):
        with self.assertRaises(replayssm.InvalidArgument) as caught:
            tensors.to_proto(torch.arange(3), field="layers[0].a")
        self.assertIn("layers[0].a.dtype: expected a floating-point tensor", str(caught.exception))


class TorchServerTest(ServerTest):
    def test_torch_inputs_give_torch_outputs_equal_to_the_numpy_path(self):
        for device in DEVICES:
            slot = self.client.allocate().slot
            twin = self.client.allocate().slot
            layers = self.layers(1)
            as_torch = [replayssm.Activations(*(torch.from_numpy(x).to(device) for x in layer))
                        for layer in layers]
            got = self.client.decode([(slot, 1)], as_torch)
            want = self.client.decode([(twin, 1)], layers)
            with self.client.open_stream() as stream:
                stream.begin([(slot, 2)])
                streamed = stream.run_layer(0, *as_torch[0])
            for l in range(self.model.num_layers):
                self.assertEqual(got.outputs[l].device.type, device)
                self.assertEqual(got.outputs[l].dtype, torch.float32)
                np.testing.assert_array_equal(got.outputs[l].cpu().numpy(), want.outputs[l])
            self.assertEqual(streamed.device.type, device)


if __name__ == "__main__":
    unittest.main()
