"""The wire dtypes (replayssm.v1.DType) and their names, numpy and torch spellings."""

import numpy as np

from replayssm.errors import InvalidArgument
from replayssm.v1 import replayssm_pb2 as pb

F32 = pb.DTYPE_F32
BF16 = pb.DTYPE_BF16
F16 = pb.DTYPE_F16

_BY_NAME = {
    "f32": F32, "float32": F32, "fp32": F32,
    "bf16": BF16, "bfloat16": BF16,
    "f16": F16, "float16": F16, "fp16": F16, "half": F16,
}
_NAME = {F32: "f32", BF16: "bf16", F16: "f16"}
_ITEMSIZE = {F32: 4, BF16: 2, F16: 2}


def dtype_code(dtype):
    """A wire dtype from a DType value, a name ("bf16", "float32"), a numpy or a torch dtype."""
    if isinstance(dtype, int) and dtype in _NAME:
        return dtype
    name = dtype.lower() if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in _BY_NAME and not isinstance(dtype, str):
        try:
            name = np.dtype(dtype).name
        except TypeError:
            pass
    if name in _BY_NAME:
        return _BY_NAME[name]
    raise InvalidArgument(f"dtype: expected f32, bf16 or f16, got {dtype!r}")


def dtype_name(code):
    """"f32", "bf16" or "f16" (the enum's name or the number for anything else)."""
    return _NAME.get(code, pb.DType.Name(code) if code in pb.DType.values() else str(code))


def itemsize(code):
    """Bytes per element of a wire dtype."""
    return _ITEMSIZE[code]


def float_to_bf16_bits(x):
    """float32 values -> bf16 bit patterns (uint16), round to nearest even; NaN stays NaN.

    Other floats are converted to float32 first, so float64 is rounded twice (to float32, then
    to bf16): a float64 value within half a float32 ulp of a bf16 midpoint rounds as the
    midpoint does (to even), not always to the nearer bf16. torch's float64 -> bfloat16
    conversion does the same, so numpy and torch input give the same bits."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    bits = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    bits[nan] = ((u[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    return bits


def bf16_bits_to_float(bits):
    """bf16 bit patterns (uint16) -> float32 values (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
