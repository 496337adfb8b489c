"""CUDA regions from torch tensors (registered with ctest only where torch sees a GPU and CuPy
is installed): the IPC handle and offset that CudaRegion.from_tensor registers, opened in a
second process as the server opens them, read back the tensor's bytes."""

import subprocess
import sys
import unittest

import torch

import replayssm
from replayssm import regions

# The server's side of a CUDA region, in another process: open the handle, read at the offset.
READER = """
import sys, cupy
handle, offset, n = bytes.fromhex(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
base = cupy.cuda.runtime.ipcOpenMemHandle(handle)
memory = cupy.cuda.UnownedMemory(base, offset + n, None)
view = cupy.ndarray((n,), cupy.uint8, cupy.cuda.MemoryPointer(memory, offset))
print(view.get().tobytes().hex())
"""


class CudaRegionTest(unittest.TestCase):
    def test_a_tensor_slice_is_found_by_its_handle_and_offset_in_another_process(self):
        buffer = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
        tensor = buffer[4096:4096 + 768]
        raw = bytes(tensor.untyped_storage()._share_cuda_()[1])
        region = regions.CudaRegion.from_tensor("acts", tensor)
        self.assertEqual((len(region.raw_handle), region.nbytes), (64, 768), raw[:2])
        self.assertEqual(region.device_id, torch.cuda.current_device())
        torch.cuda.synchronize()
        read = subprocess.run([sys.executable, "-c", READER, region.raw_handle.hex(),
                               str(region.offset), str(region.nbytes)],
                              capture_output=True, text=True, check=True).stdout.strip()
        self.assertEqual(read, tensor.cpu().numpy().tobytes().hex())

    def test_a_host_or_strided_tensor_is_refused_naming_the_region(self):
        for t in (torch.zeros(4), torch.zeros(4, 4, device="cuda").t()):
            with self.assertRaises(replayssm.InvalidArgument) as caught:
                regions.CudaRegion.from_tensor("acts", t)
            self.assertIn("acts: expected a contiguous CUDA tensor", caught.exception.details)


if __name__ == "__main__":
    unittest.main()
