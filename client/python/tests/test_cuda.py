"""CUDA regions from torch tensors (registered with ctest only where torch sees a GPU and CuPy
is installed): the IPC handle and offset that CudaRegion.from_tensor registers, opened in a
second process as the server opens them, read back the tensor's bytes; and a plan's doorbells
on torch streams, against a second process that plays the server's part of a layer."""

import subprocess
import sys
import unittest

import numpy as np
import torch

import replayssm
from replayssm import cuda_memops, plan, regions

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


# The server's part of one planned layer, in another process: behind a GPU wait on ready[0],
# copy mixed_qkv's first bytes to out, then write done[0] -- all queued on one stream.
SERVER_LAYER = """
import sys, cupy
from replayssm import cuda_memops
handle = bytes.fromhex(sys.argv[1])
offset, ready, done, src, dst, n, value = map(int, sys.argv[2:])
base = cupy.cuda.runtime.ipcOpenMemHandle(handle) + offset
stream = cupy.cuda.Stream(non_blocking=True)
assert cuda_memops.wait_value32(stream.ptr, base + ready, value)
cupy.cuda.runtime.memcpyAsync(base + dst, base + src, n, 3, stream.ptr)  # device to device
assert cuda_memops.write_value32(stream.ptr, base + done, value)
print("queued", flush=True)
stream.synchronize()
"""


class CudaDoorbellTest(unittest.TestCase):
    MODEL = replayssm.pb.ModelInfo(num_layers=2, num_qk_heads=2, num_v_heads=4, head_k=16,
                                   head_v=16, gate=replayssm.pb.GATE_GDN,
                                   act_dtype=replayssm.pb.DTYPE_BF16)

    def setUp(self):
        buffer = torch.zeros(plan.ForwardPlan.nbytes(self.MODEL, 4), dtype=torch.uint8,
                             device="cuda")
        torch.cuda.synchronize()
        self.region = regions.CudaRegion.from_tensor("engine", buffer)
        self.plan = plan.ForwardPlan.layout(self.region, self.MODEL, 4)
        self.stream = torch.cuda.Stream()

    def test_a_layer_handed_to_another_process_runs_between_the_rings(self):
        layer = self.plan.layers[0]
        value = self.plan.next_value()
        n = 4 * 16 * 2  # one token's output, HV * V bf16
        server = subprocess.Popen(
            [sys.executable, "-c", SERVER_LAYER, self.region.raw_handle.hex(),
             str(self.region.offset), str(self.plan.ready.offset), str(self.plan.done.offset),
             str(layer.mixed_qkv.offset), str(layer.out.offset), str(n), str(value)],
            stdout=subprocess.PIPE, text=True)
        self.addCleanup(server.wait)
        self.assertEqual(server.stdout.readline().strip(), "queued")
        x = torch.randn(layer.mixed_qkv.shape, device="cuda")
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(50_000_000)  # the ring must wait for the write behind it
            layer.mixed_qkv.write(x)
            self.plan.ring(0)
            self.plan.wait_done(0)
            got = layer.out.view().reshape(-1).view(torch.uint8)[:n].clone()
        self.stream.synchronize()
        want = layer.mixed_qkv.view().reshape(-1).view(torch.uint8)[:n]
        self.assertTrue(torch.equal(got, want))
        self.assertEqual(server.wait(timeout=30), 0)
        self.assertEqual(self.plan.done.words()[0], value)

    def test_a_cuda_region_takes_numpy_as_torch(self):
        layer = self.plan.layers[1]
        x = np.random.default_rng(1).uniform(-1, 1, layer.a.shape).astype(np.float32)
        layer.a.write(x)
        torch.cuda.synchronize()
        want = torch.from_numpy(x).to(torch.bfloat16)
        self.assertTrue(torch.equal(layer.a.view().cpu(), want))

    def test_without_the_driver_symbols_the_ring_is_a_kernel_and_the_wait_a_poll(self):
        saved = dict(cuda_memops._symbols)
        self.addCleanup(cuda_memops._symbols.update, saved)
        cuda_memops._symbols.update({"cuStreamWriteValue32_v2": None,
                                     "cuStreamWaitValue32_v2": None})
        self.plan.value = 0xFFFFFFFE  # a value with the sign bit set
        with torch.cuda.stream(self.stream):
            self.plan.ring(1)
            self.plan.done.ring(1, self.plan.value)
            self.plan.wait_done(1, timeout=5)
        self.assertEqual(self.plan.ready.words()[1], 0xFFFFFFFE)
        with self.assertRaises(replayssm.DeadlineExceeded):  # done[0] is 0, before 0x7fffffff
            self.plan.done.wait(0, 0x7FFFFFFF, timeout=0.05, stream=self.stream)


if __name__ == "__main__":
    unittest.main()
