"""The plain recurrence (docs/math-and-abi.md, "One step of the recurrence") in numpy
float64: the oracle a client checks the server's outputs against, built from GetInfo's model and layer parameters.

A sequence's state is a list of per-layer arrays S [HV, V, K] (value rows x key columns),
followed, for a model with a short convolution (conv_width W > 0), by one window [W-1, C] per
layer: the last W-1 pre-convolution inputs (zeros before the first token). Each layer's
mixed_qkv goes through silu(bias + causal depthwise conv) first, its output rounded to the
activation dtype as the server (and the Hugging Face models) round it. Inputs are rounded to
the model's activation dtype first, exactly as they travel on the wire, so the reference sees
what the server sees. Two of the model's options change the numbers (GetInfo reports them):
`round_beta` rounds beta = sigmoid(b) to the activation dtype (Hugging Face's Qwen3-Next in
bf16), and a 16-bit `ring_dtype` adds each step's d and k to the state rounded to it, as the
server's ring holds them (the outputs use them unrounded).
"""

import numpy as np

from replayssm import tensors
from replayssm.v1 import replayssm_pb2 as pb


def _softplus(x):
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def _l2norm(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


class Reference:
    """Runs tokens through the recurrence of one model; stateless apart from the states the
    caller passes in (so sequences can be copied, forked and compared freely)."""

    def __init__(self, model):
        """`model`: a ModelInfo (GetInfo().model) with its layer_params."""
        if len(model.layer_params) != model.num_layers:
            raise ValueError("reference: the model info lacks its layer parameters")
        self.model = model
        self.h, self.hv = model.num_qk_heads, model.num_v_heads
        self.k, self.v = model.head_k, model.head_v
        self.kda = model.gate == pb.GATE_KDA
        self.width = model.conv_width
        self.channels = 2 * self.h * self.k + self.hv * self.v
        # Rounding to fp32 activations is no rounding (the server's beta is fp32 then).
        self.round_beta = model.round_beta and model.act_dtype != pb.DTYPE_F32
        # DTYPE_UNSPECIFIED (a server before ring dtypes) rounds nothing, as an f32 ring.
        self.ring_dtype = (model.ring_dtype if model.ring_dtype in (pb.DTYPE_BF16, pb.DTYPE_F16)
                           else None)
        self._conv = []
        for p in model.layer_params:
            if self.width:
                w = np.asarray(p.conv_weight, dtype=np.float64).reshape(self.channels, self.width)
                b = (np.asarray(p.conv_bias, dtype=np.float64) if len(p.conv_bias)
                     else np.zeros(self.channels))
                self._conv.append((w, b))
        self._params = []
        for p in model.layer_params:
            a_log = np.asarray(p.a_log, dtype=np.float64)
            dt_bias = np.asarray(p.dt_bias, dtype=np.float64)
            self._params.append((a_log, dt_bias.reshape(self.hv, -1), p.scale, p.use_qk_l2norm))

    def new_state(self):
        """A fresh sequence: every layer's state zero (then every layer's conv window)."""
        layers = self.model.num_layers
        states = [np.zeros((self.hv, self.v, self.k)) for _ in range(layers)]
        if self.width:
            states += [np.zeros((self.width - 1, self.channels)) for _ in range(layers)]
        return states

    def conv_window(self, state, layer):
        """The conv window [W-1, C] of `layer` in a sequence's state (None without one)."""
        return state[self.model.num_layers + layer] if self.width else None

    def _convolve(self, state, layer, x):
        """x [C] (pre-convolution, one token) -> its convolution output; the window slides."""
        if not self.width:
            return x
        w, b = self._conv[layer]
        slot = self.model.num_layers + layer
        window = np.concatenate([state[slot], x[None, :]], axis=0)  # [W, C], oldest first
        y = b + np.sum(w.T * window, axis=0)
        state[slot] = window[1:]
        return self._wire(y / (1.0 + np.exp(-y)))

    def _wire(self, x):
        """x as the server receives it: rounded to the activation dtype, in float64."""
        return self._round(x, self.model.act_dtype)

    @staticmethod
    def _round(x, dtype):
        """x rounded to a wire dtype (nearest even), in float64."""
        return tensors.to_numpy(tensors.to_proto(x, dtype)).astype(np.float64)

    def run_layer(self, state, layer, mixed_qkv, a, b):
        """N consecutive tokens of one sequence through `layer`: updates state[layer] in place
        and returns the outputs [N, HV, V]."""
        x, a, b = self._wire(mixed_qkv), self._wire(a), self._wire(b)
        out = np.zeros((x.shape[0], self.hv, self.v))
        for t in range(x.shape[0]):
            xt = self._convolve(state, layer, x[t])
            state[layer], out[t] = self._step(layer, state[layer], xt, a[t], b[t])
        return out

    def decode_layer(self, states, layer, mixed_qkv, a, b):
        """One token per row through `layer`; states[i] is row i's sequence (None: a padding
        row, whose output is zero). Returns [B, HV, V]."""
        x, a, b = self._wire(mixed_qkv), self._wire(a), self._wire(b)
        out = np.zeros((x.shape[0], self.hv, self.v))
        for i, state in enumerate(states):
            if state is not None:
                xi = self._convolve(state, layer, x[i])
                state[layer], out[i] = self._step(layer, state[layer], xi, a[i], b[i])
        return out

    def _step(self, layer, s, x, a, b):
        a_log, dt_bias, scale, l2norm = self._params[layer]
        hk = self.h * self.k
        q = x[:hk].reshape(self.h, self.k)
        k = x[hk:2 * hk].reshape(self.h, self.k)
        v = x[2 * hk:].reshape(self.hv, self.v)
        if l2norm:
            q, k = _l2norm(q), _l2norm(k)
        q = q * scale
        group = self.hv // self.h  # v-head h uses qk-head h / (HV/H)
        q, k = np.repeat(q, group, axis=0), np.repeat(k, group, axis=0)
        g = -np.exp(a_log)[:, None] * _softplus(a.reshape(self.hv, -1) + dt_bias)
        alpha = np.exp(g)  # GDN [HV, 1], KDA [HV, K]: the decay of each key column
        beta = 1.0 / (1.0 + np.exp(-b))
        if self.round_beta:
            beta = self._wire(beta)
        s = s * alpha[:, None, :]
        d = beta[:, None] * (v - np.einsum("hvk,hk->hv", s, k))
        # o = S'q + d (k.q) from the step's own d, k; the state takes them as the ring holds them.
        o = np.einsum("hvk,hk->hv", s, q) + d * np.sum(k * q, axis=1)[:, None]
        if self.ring_dtype is not None:
            d, k = self._round(d, self.ring_dtype), self._round(k, self.ring_dtype)
        return s + d[:, :, None] * k[:, None, :], o
