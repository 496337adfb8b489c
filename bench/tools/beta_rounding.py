#!/usr/bin/env python3
"""How far rounding beta = sigmoid(b) to bf16 moves a layer (docs/cache.md, "The short
convolution"): the Python client's fp64 Reference run twice over the same bf16 inputs, with
ModelInfo.round_beta false and true, at a Qwen3-Next-like head shape (H=4 HV=8 K=V=128, one
layer, no convolution, 256 tokens from a zero state). Prints the relative L2 difference of each
token's output and of the final state, per gate.

  build-cpu/tests/python-venv/bin/python bench/tools/beta_rounding.py
(the venv the Python client's tests install; run it from outside client/python.)
"""
import numpy as np

from replayssm import Reference
from replayssm.v1 import replayssm_pb2 as pb

H, HV, K, V, T = 4, 8, 128, 128, 256


def model(gate, round_beta):
    m = pb.ModelInfo(num_layers=1, gate=gate, num_qk_heads=H, num_v_heads=HV, head_k=K,
                     head_v=V, ring_len=16, state_dtype=pb.DTYPE_F32, act_dtype=pb.DTYPE_BF16,
                     round_beta=round_beta)
    rng = np.random.default_rng(7)
    per = K if gate == pb.GATE_KDA else 1
    m.layer_params.add(a_log=list(0.125 + 0.375 * rng.uniform(-1, 1, HV)),
                       dt_bias=list(0.5 * rng.uniform(-1, 1, HV * per)), scale=K ** -0.5,
                       use_qk_l2norm=True)
    return m


def main():
    for gate, name in ((pb.GATE_GDN, "GDN"), (pb.GATE_KDA, "KDA")):
        rng = np.random.default_rng(1)
        x = rng.standard_normal((T, 2 * H * K + HV * V)).astype(np.float32)
        a = rng.standard_normal((T, HV * (K if gate == pb.GATE_KDA else 1))).astype(np.float32)
        b = rng.standard_normal((T, HV)).astype(np.float32)
        runs = {}
        for round_beta in (False, True):
            ref = Reference(model(gate, round_beta))
            state = ref.new_state()
            runs[round_beta] = (ref.run_layer(state, 0, x, a, b), state[0])
        (o0, s0), (o1, s1) = runs[False], runs[True]
        per_token = np.linalg.norm(o1 - o0, axis=(1, 2)) / np.linalg.norm(o0, axis=(1, 2))
        print(f"{name}: output difference per token median {np.median(per_token):.2e}, "
              f"max {per_token.max():.2e}; state after {T} tokens "
              f"{np.linalg.norm(s1 - s0) / np.linalg.norm(s0):.2e}")


if __name__ == "__main__":
    main()
