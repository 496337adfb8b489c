"""Tensor-parallel servers (`--tp-size N`): their tensors are rank-major, each rank's heads
after the previous rank's (docs/api.md, "Tensor parallelism"). These convert between the
unsharded layout a model (and `replayssm.Reference`) uses and a TP server's:

- `shard(model, name, x)`: an unsharded tensor -> the server's `[N, tokens, ...]`;
- `unshard(model, name, y)`: back;
- `shard_activations(model, acts)`, `unshard_outputs(model, outs)`: a layer's inputs, every
  layer's outputs.

`name` is one of "mixed_qkv" ([tokens, 2*H*K + HV*V]: q | k | v, each section split by heads
separately), "a" (GDN [tokens, HV], KDA [tokens, HV, K]), "b" ([tokens, HV]) and "out"
([tokens, HV, V]). Rank r holds qk heads [r*H/N, (r+1)*H/N) and v heads [r*HV/N, ...), as
Hugging Face, sglang and vLLM split the linear attention. numpy arrays (torch tensors: call
.cpu().numpy() first, or use the same index arithmetic). With tp_size 1 both are the identity.
"""

import numpy as np

from replayssm.tensors import Activations


def _n(model):
    return max(int(model.tp_size), 1)


def _qkv_columns(model, rank):
    """The unsharded mixed_qkv columns of `rank`'s row, in the rank's order (q | k | v)."""
    n, h, hv, k, v = _n(model), model.num_qk_heads, model.num_v_heads, model.head_k, model.head_v
    qk, vh = h // n * k, hv // n * v
    q0, v0 = rank * qk, rank * vh
    return np.concatenate([np.arange(q0, q0 + qk), np.arange(h * k + q0, h * k + q0 + qk),
                           np.arange(2 * h * k + v0, 2 * h * k + v0 + vh)])


def _check(name):
    if name not in ("mixed_qkv", "a", "b", "out"):
        raise ValueError(f"name: expected mixed_qkv, a, b or out, got {name!r}")


def shard(model, name, x):
    """Unsharded `x` -> the rank-major tensor a TP server takes (`[N, tokens, ...]`)."""
    _check(name)
    n, x = _n(model), np.asarray(x)
    if n == 1:
        return x
    if name == "mixed_qkv":
        return np.stack([x[:, _qkv_columns(model, r)] for r in range(n)])
    heads = x.shape[1]  # a, b, out: the v heads are the second axis
    split = x.reshape(x.shape[0], n, heads // n, *x.shape[2:])
    return np.ascontiguousarray(np.moveaxis(split, 1, 0))


def unshard(model, name, y):
    """A TP server's rank-major tensor -> the unsharded one."""
    _check(name)
    n, y = _n(model), np.asarray(y)
    if n == 1:
        return y
    if name == "mixed_qkv":
        tokens = y.shape[1]
        width = 2 * model.num_qk_heads * model.head_k + model.num_v_heads * model.head_v
        x = np.empty((tokens, width), dtype=y.dtype)
        for r in range(n):
            x[:, _qkv_columns(model, r)] = y[r]
        return x
    joined = np.moveaxis(y, 0, 1)  # [tokens, N, heads/N, ...]
    return np.ascontiguousarray(joined.reshape(joined.shape[0], -1, *joined.shape[3:]))


def shard_activations(model, acts):
    """A layer's unsharded Activations -> the TP server's."""
    return Activations(shard(model, "mixed_qkv", acts.mixed_qkv), shard(model, "a", acts.a),
                       shard(model, "b", acts.b))


def unshard_outputs(model, outputs):
    """Every layer's outputs from a TP server -> unsharded [tokens, HV, V] each."""
    return [unshard(model, "out", o) for o in outputs]
