"""CUDA stream memory operations through the driver (libcuda.so.1, by ctypes): a 32-bit write
and a 32-bit wait queued on a stream, the engine's side of a plan's doorbells. No CUDA toolkit
or Python binding is needed; the symbols are looked up on first use, and a missing one (an old
driver) makes the call return False so that the caller can fall back.
"""

import ctypes

from replayssm import errors

CU_STREAM_WAIT_VALUE_GEQ = 0  # (int32)(*addr - value) >= 0, the plan's cyclic compare
CU_STREAM_WRITE_VALUE_DEFAULT = 0

_driver = None
_symbols = {}


def _function(name):
    """The driver function `name` with its argtypes, or None when the driver lacks it."""
    global _driver
    if name not in _symbols:
        if _driver is None:
            _driver = ctypes.CDLL("libcuda.so.1")
        fn = getattr(_driver, name, None)
        if fn is not None:
            # (CUstream, CUdeviceptr, cuuint32_t value, unsigned int flags) -> CUresult
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
        _symbols[name] = fn
    return _symbols[name]


def _call(name, stream, address, value, flags):
    fn = _function(name)
    if fn is None:
        return False
    result = fn(ctypes.c_void_p(stream or None), address, value & 0xFFFFFFFF, flags)
    if result != 0:
        raise errors.Internal(f"{name}: CUresult {result} (stream {stream:#x}, address "
                              f"{address:#x}, value {value})")
    return True


def write_value32(stream, address, value):
    """Queues *address = value on `stream` (a CUstream handle, e.g. torch's
    Stream.cuda_stream). False when the driver lacks cuStreamWriteValue32_v2."""
    return _call("cuStreamWriteValue32_v2", stream, address, value,
                 CU_STREAM_WRITE_VALUE_DEFAULT)


def wait_value32(stream, address, value):
    """Queues a wait until (int32)(*address - value) >= 0 on `stream`: later work on it runs
    only after. False when the driver lacks cuStreamWaitValue32_v2."""
    return _call("cuStreamWaitValue32_v2", stream, address, value, CU_STREAM_WAIT_VALUE_GEQ)
