"""Test support: the real replayssm-server started as a child process on free loopback ports
(port 0; the server writes the bound addresses to its ready file), random activations, and a
test case base that gives each test its own server, client and numpy reference.

The server binary comes from $REPLAYSSM_SERVER (ctest sets it to the built replayssm-server).
"""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import unittest
import zlib

import numpy as np

import replayssm
from replayssm import pb

TOLERANCE = {replayssm.F32: 1e-4, replayssm.F16: 5e-3, replayssm.BF16: 3e-2}


class ServerProcess:
    """replayssm-server --device=cpu on 127.0.0.1 port 0 with `flags`; stop() kills it."""

    def __init__(self, *flags, model="tiny-gdn"):
        binary = os.environ.get("REPLAYSSM_SERVER")
        if not binary:
            raise RuntimeError("set REPLAYSSM_SERVER to the replayssm-server binary")
        self.dir = tempfile.mkdtemp(prefix="replayssm-pytest-")
        ready = os.path.join(self.dir, "ready")
        args = [binary, f"--model={model}", "--device=cpu", "--grpc-address=127.0.0.1:0",
                "--metrics-address=127.0.0.1:0", f"--ready-file={ready}", *flags]
        self.log_path = os.path.join(self.dir, "server.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self.grpc_address = self._wait_ready(ready)

    def _wait_ready(self, ready):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if os.path.exists(ready):
                with open(ready) as f:
                    for line in f:
                        if line.startswith("grpc=") and line.strip() != "grpc=":
                            return line.strip()[len("grpc="):]
            if self.proc.poll() is not None:
                with open(self.log_path) as f:
                    log = f.read()
                self.stop()
                raise RuntimeError(f"replayssm-server exited ({self.proc.returncode}):\n{log}")
            time.sleep(0.01)
        self.stop()
        raise RuntimeError("replayssm-server did not become ready in 60 s")

    def signal(self, sig):
        self.proc.send_signal(sig)
        if sig == signal.SIGSTOP:  # stopped once this returns, not when the kernel gets to it
            deadline = time.monotonic() + 10
            while self._state() not in ("T", "t") and time.monotonic() < deadline:
                time.sleep(0.001)

    def _state(self):
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return ""

    def wait_exit(self, timeout):
        return self.proc.wait(timeout=timeout)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


# A small Qwen3-Next-like config.json with bf16 activations (two linear-attention layers).
BF16_CONFIG = {"layer_types": ["linear_attention", "full_attention", "linear_attention"],
               "linear_num_key_heads": 2, "linear_num_value_heads": 4,
               "linear_key_head_dim": 32, "linear_value_head_dim": 32,
               "torch_dtype": "bfloat16"}


def config_file(test, config):
    """A model's Hugging Face config.json written for `test` (removed at its cleanup)."""
    directory = tempfile.mkdtemp(prefix="replayssm-pytest-model-")
    test.addCleanup(shutil.rmtree, directory)
    path = os.path.join(directory, "config.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def activations(model, n, rng):
    """Every layer's random Activations for n tokens of `model`, float32 in [-1, 1)."""
    h, hv, k, v = model.num_qk_heads, model.num_v_heads, model.head_k, model.head_v
    a_shape = (n, hv, k) if model.gate == pb.GATE_KDA else (n, hv)

    def uniform(*shape):
        return rng.uniform(-1.0, 1.0, size=shape).astype(np.float32)

    return [replayssm.Activations(uniform(n, 2 * h * k + hv * v), uniform(*a_shape),
                                  uniform(n, hv)) for _ in range(model.num_layers)]


def rows_of(layers, begin, count):
    """Tokens begin..begin+count-1 of every layer's Activations."""
    return [replayssm.Activations(*(x[begin:begin + count] for x in layer)) for layer in layers]


class ServerTest(unittest.TestCase):
    """Each test gets a fresh server (SERVER_FLAGS, MODEL), a client and a reference."""

    SERVER_FLAGS = ("--track-interval=16",)
    MODEL = "tiny-gdn"

    def setUp(self):
        self.server = ServerProcess(*self.SERVER_FLAGS, model=self.MODEL)
        self.addCleanup(self.server.stop)
        self.client = replayssm.Client(self.server.grpc_address, timeout=30)
        self.addCleanup(self.client.close)
        self.info = self.client.info()
        self.model = self.info.model
        self.ref = replayssm.Reference(self.model)
        self.rng = np.random.default_rng(zlib.crc32(self.id().encode()))
        self.tol = TOLERANCE[self.model.act_dtype]

    def layers(self, n):
        return activations(self.model, n, self.rng)

    def assertClose(self, got, want, msg=None):
        np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, rtol=self.tol,
                                   atol=self.tol, err_msg=msg or "")

    def prefill(self, slot, state, n, first_token=100):
        """Prefills n tokens into the server's slot and the reference state; checks outputs."""
        layers = self.layers(n)
        got = self.client.prefill(slot, range(first_token, first_token + n), layers,
                                  return_outputs=True)
        for l, x in enumerate(layers):
            self.assertClose(got.outputs[l], self.ref.run_layer(state, l, *x), f"layer {l}")
        return got

    def decode(self, slots, states):
        """One unary decode step on the server and the reference; checks outputs."""
        layers = self.layers(len(slots))
        got = self.client.decode([(s, 7) for s in slots], layers)
        for l, x in enumerate(layers):
            self.assertClose(got.outputs[l], self.ref.decode_layer(states, l, *x), f"layer {l}")
        return got

    def observe(self, slot):
        """Everything observable about a slot: its exported state and its cursors."""
        exported = self.client.export_state(slot)
        state = self.client.get_slot(slot)
        return (exported.seq_len, exported.tokens, [c.tobytes() for c in exported.checkpoints],
                [w.tobytes() for w in exported.conv_windows], state.seq_len)

