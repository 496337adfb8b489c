"""Tensors on the wire: numpy arrays and torch tensors to and from `replayssm.v1.Tensor`.

A wire tensor is raw little-endian bytes, row-major and dense, with a dtype (f32, bf16, f16)
and a shape. numpy has no bfloat16, so bf16 data reads back as float32 arrays (exact: every
bf16 value is a float32) and numpy input is rounded to bf16 (nearest even, as the server and the
C++ client do; float64 input is first rounded to float32, as torch's conversion does, so numpy
and torch give the same bits). torch tensors keep their dtype, bf16 included; torch is imported
only by callers that pass torch tensors, so it stays optional.
"""

import sys
from typing import NamedTuple

import numpy as np

from replayssm import regions
from replayssm.dtypes import (BF16, F16, F32, bf16_bits_to_float, dtype_code, dtype_name,
                              float_to_bf16_bits, itemsize)
from replayssm.errors import InvalidArgument
from replayssm.v1 import replayssm_pb2 as pb


class Activations(NamedTuple):
    """One layer's inputs for N tokens (arrays or tensors; docs/api.md, Tensors)."""

    mixed_qkv: object  # [N, 2*H*K + HV*V]: q | k | v
    a: object  # GDN [N, HV], KDA [N, HV, K]
    b: object  # [N, HV]


def _torch_of(x):
    """The torch module when x is a torch tensor (torch already imported by the caller)."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and isinstance(x, torch.Tensor) else None


def _numpy_bytes(x, code, field):
    arr = np.asarray(x)
    if arr.dtype.kind != "f":
        raise InvalidArgument(f"{field}.dtype: expected a floating-point array, got {arr.dtype}")
    if code is None:
        if arr.dtype not in (np.float32, np.float16):
            raise InvalidArgument(f"{field}.dtype: expected float32 or float16 (or a dtype to "
                                  f"cast to), got {arr.dtype}")
        code = F32 if arr.dtype == np.float32 else F16
    if code == BF16:
        data = float_to_bf16_bits(arr).astype("<u2").tobytes()
    else:
        data = arr.astype("<f4" if code == F32 else "<f2", copy=False).tobytes()
    return data, list(arr.shape), code


def _torch_bytes(torch, x, code, field):
    if not x.is_floating_point():
        raise InvalidArgument(f"{field}.dtype: expected a floating-point tensor, got {x.dtype}")
    code = dtype_code(x.dtype) if code is None else code
    target = {F32: torch.float32, BF16: torch.bfloat16, F16: torch.float16}[code]
    t = x.detach().to(device="cpu", dtype=target).contiguous()
    raw = t.view(torch.int16) if code == BF16 else t
    return raw.numpy().tobytes(), list(t.shape), code


def to_proto(x, dtype=None, field="tensor"):
    """A wire Tensor from a numpy array, a torch tensor or a Tensor (returned as is).

    With `dtype` the values are cast to it (a float32 array sent as bf16 is rounded); without,
    the array's own dtype is sent. Non-float input raises InvalidArgument naming `field`.
    """
    if isinstance(x, pb.Tensor):
        return x
    regions.refuse_inline(x, field)
    code = None if dtype is None else dtype_code(dtype)
    torch = _torch_of(x)
    if torch is not None:
        data, shape, code = _torch_bytes(torch, x, code, field)
    else:
        data, shape, code = _numpy_bytes(x, code, field)
    return pb.Tensor(dtype=code, shape=shape, data=data)


def _checked_size(t, field):
    if t.dtype not in (F32, BF16, F16):
        raise InvalidArgument(f"{field}.dtype: expected f32, bf16 or f16, got {t.dtype}")
    n = int(np.prod(t.shape, dtype=np.int64)) if t.shape else 0
    if n * itemsize(t.dtype) != len(t.data):
        raise InvalidArgument(f"{field}.data: expected {n * itemsize(t.dtype)} bytes for "
                              f"{dtype_name(t.dtype)} {list(t.shape)}, got {len(t.data)}")
    return n


def to_numpy(t, field="tensor"):
    """A wire Tensor as a writable numpy array: float32 for f32 and bf16, float16 for f16."""
    _checked_size(t, field)
    shape = tuple(t.shape)
    if t.dtype == BF16:
        return bf16_bits_to_float(np.frombuffer(t.data, dtype="<u2")).reshape(shape)
    wire = "<f4" if t.dtype == F32 else "<f2"
    return np.frombuffer(t.data, dtype=wire).astype(wire[1:], copy=True).reshape(shape)


def to_torch(t, device=None, field="tensor"):
    """A wire Tensor as a torch tensor of its own dtype (bf16 included), on `device`."""
    import torch  # optional dependency: only callers that want torch tensors need it

    _checked_size(t, field)
    target = {F32: torch.float32, BF16: torch.bfloat16, F16: torch.float16}[t.dtype]
    out = torch.frombuffer(bytearray(t.data), dtype=target) if t.data else torch.empty(
        0, dtype=target)
    out = out.reshape(tuple(t.shape))
    return out if device is None else out.to(device)


def like(t, template, field="tensor"):
    """A wire Tensor in the kind of `template`: torch on its device when it is a torch tensor,
    else numpy. Outputs follow the inputs this way."""
    if _torch_of(template) is not None:
        return to_torch(t, template.device, field)
    return to_numpy(t, field)


def layer_input(layer, inputs, act_dtype, field):
    """A wire LayerInput from Activations (or a 3-tuple, or a LayerInput, returned as is); the
    tensors are cast to the model's activation dtype."""
    if isinstance(inputs, pb.LayerInput):
        return inputs
    try:
        mixed_qkv, a, b = inputs
    except (TypeError, ValueError):
        raise InvalidArgument(f"{field}: expected Activations(mixed_qkv, a, b), "
                              f"got {type(inputs).__name__}") from None
    return pb.LayerInput(layer=layer,
                         mixed_qkv=to_proto(mixed_qkv, act_dtype, f"{field}.mixed_qkv"),
                         a=to_proto(a, act_dtype, f"{field}.a"),
                         b=to_proto(b, act_dtype, f"{field}.b"))


def any_layer_input(layer, inputs, act_dtype, field, out=None):
    """A wire LayerInput from one layer's inputs in any form a forward takes: a LayerInput (as
    is); Activations or a 3-tuple of arrays (inline, cast to the activation dtype); or
    RegionTensors for mixed_qkv, a, b and the output, the output as `out` or as a fourth
    element (a plan.PlannedLayer): then only their places travel. A mix of the two kinds is
    refused (InvalidArgument naming the field) before anything is sent."""
    if isinstance(inputs, pb.LayerInput):
        return inputs
    try:
        parts = tuple(inputs)
    except TypeError:
        parts = ()
    if len(parts) == 4 and out is None:
        *parts, out = parts
    if len(parts) != 3:
        raise InvalidArgument(f"{field}: expected Activations(mixed_qkv, a, b) or a "
                              f"PlannedLayer, got {type(inputs).__name__}")
    if out is not None or any(isinstance(x, regions.RegionTensor) for x in parts):
        return region_layer_input(layer, parts, out, field)
    return layer_input(layer, parts, act_dtype, field)


def layer_output(out, inputs, field="tensor"):
    """A reply's output tensor for the layer given as `inputs` (what any_layer_input took):
    its output RegionTensor when the output went to a region, else the bytes in the kind of
    the inputs (output_template)."""
    if out.HasField("region"):
        if not isinstance(inputs, pb.LayerInput) and len(inputs) == 4:
            return inputs[3]
        return out  # a caller's own LayerInput: the wire tensor naming its region
    return like(out, output_template(inputs), field)


def region_layer_input(layer, inputs, out, field):
    """A wire LayerInput whose tensors and output all name regions (RegionTensors); a mix of
    regions and inline tensors is refused here, before anything is sent."""
    names = (*Activations._fields, "out")
    for name, x in zip(names, (*inputs, out)):
        if not isinstance(x, regions.RegionTensor):
            raise InvalidArgument(f"{field}.{name}: expected a RegionTensor (a layer message "
                                  f"names regions for all of its tensors or none), got "
                                  f"{type(x).__name__}")
    wire = [pb.Tensor(dtype=x.dtype, shape=list(x.shape), region=x.ref()) for x in inputs]
    return pb.LayerInput(layer=layer, mixed_qkv=wire[0], a=wire[1], b=wire[2], out=out.ref())


def output_template(inputs):
    """What a layer's output should look like: its mixed_qkv (numpy for wire LayerInputs)."""
    return None if isinstance(inputs, pb.LayerInput) else inputs[0]
