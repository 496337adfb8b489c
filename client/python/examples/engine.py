#!/usr/bin/env python3
"""A worked example of the data plane (docs/python.md): a small "engine" that runs its own
layers and hands its linear-attention layers to replayssm-server through a registered region
and doorbells, with no message per layer.

Per token the engine embeds it, then per layer projects the hidden state to the layer's
mixed_qkv | a | b straight into the region, rings ready[l], waits for done[l], and adds an
output projection of the layer's output (read from the region) back into the hidden state
that feeds the next layer; the last hidden state picks the next token (greedy, through an
unembedding). Prompts go through one planned prefill, then every step is one planned decode of
all requests. Every layer's output is checked against the plain recurrence (replayssm's numpy
Reference) on the very inputs the engine wrote.

    --device cpu   numpy, a POSIX shared-memory region; a CPU-backend server (CI runs this).
    --device cuda  torch on the GPU, a CUDA region; rings and waits are queued on the
                   engine's torch stream (cuStreamWriteValue32 / cuStreamWaitValue32), so
                   the engine's kernels and the server's interleave without the CPU. Needs a
                   CUDA-backend server on the same GPU, under MPS.

    python engine.py --address 127.0.0.1:50051 [--device cuda] [--requests 3] [--steps 8]
"""

import argparse
import os
import sys
from contextlib import ExitStack, nullcontext
import time

import numpy as np

import replayssm
from replayssm import plan, regions

TOLERANCE = {replayssm.F32: 1e-4, replayssm.F16: 5e-3, replayssm.BF16: 3e-2}


class Weights:
    """The engine's own parameters: an embedding, an unembedding and, per layer, the
    projections into and out of the linear-attention layer. numpy float32, or torch on
    `device`."""

    def __init__(self, model, hidden, vocab, rng, torch=None, device=None):
        shapes = plan.layer_shapes(model, 1)
        self.widths = [int(np.prod(s[1:])) for s in shapes]  # qkv, a, b, out per token
        scale = 1.0 / np.sqrt(hidden)

        def param(*shape, std):
            x = (rng.standard_normal(shape) * std).astype(np.float32)
            return x if torch is None else torch.from_numpy(x).to(device)

        self.embedding = param(vocab, hidden, std=1.0)
        self.unembedding = param(hidden, vocab, std=scale)
        self.project_in = [param(hidden, sum(self.widths[:3]), std=scale)
                           for _ in range(model.num_layers)]
        self.project_out = [param(self.widths[3], hidden, std=1.0 / np.sqrt(self.widths[3]))
                            for _ in range(model.num_layers)]


class Engine:
    """Runs forwards of the engine over a plan in `region`; `xp` is numpy or torch."""

    def __init__(self, client, region, weights, max_tokens, xp, stream=None):
        self.client, self.weights, self.xp, self.stream = client, weights, xp, stream
        self.model = client.model
        self.plan = plan.ForwardPlan.layout(region, self.model, max_tokens)
        self.ref = replayssm.Reference(self.model)
        self.worst = 0.0  # the largest |server - reference| seen
        self.split = np.cumsum(weights.widths[:2]).tolist()  # mixed_qkv | a | b columns

    def forward(self, tokens, begin, check):
        """One planned forward of the packed `tokens` (begin opens it on the server with the
        plan); check(l, inputs, out) compares layer l. Returns the hidden states [N, hidden]."""
        n = len(tokens)
        begin(self.plan)
        h = self.weights.embedding[self._index(tokens)]
        for l in range(self.model.num_layers):
            layer = self.plan.layers[l].head(n)
            proj = h @ self.weights.project_in[l]
            qkv_end, a_end = self.split
            parts = (proj[:, :qkv_end], proj[:, qkv_end:a_end], proj[:, a_end:])
            for tensor, x in zip(layer, parts):
                tensor.write(x.reshape(tensor.shape))
            self.plan.ring(l, stream=self.stream)  # after the writes, on the same stream
            self.plan.wait_done(l, stream=self.stream)
            out = layer.out.read()
            if check:
                check(l, [t.read() for t in layer[:3]], out)
            out = out.reshape(n, -1)  # numpy float32; torch in the wire dtype
            out = out if self.xp is np else out.float()
            h = h + self.xp.tanh(out @ self.weights.project_out[l])
        return h

    def _index(self, tokens):
        if self.xp is np:
            return np.asarray(tokens)
        return self.xp.as_tensor(tokens, device=self.weights.embedding.device)

    def next_tokens(self, h):
        logits = h @ self.weights.unembedding
        return [int(t) for t in logits.argmax(-1).tolist()]

    def checker(self, states, rows):
        """Compares layer outputs with the reference: rows[i] is the (start, count) of request
        i's tokens in the packed forward."""
        tol = TOLERANCE[self.model.act_dtype]

        def check(l, inputs, out):
            inputs = [_host(x) for x in inputs]
            got = _host(out)
            for state, (start, count) in zip(states, rows):
                part = [x[start:start + count] for x in inputs]
                want = self.ref.run_layer(state, l, *part)
                err = np.abs(got[start:start + count].astype(np.float64) - want)
                self.worst = max(self.worst, float(err.max()))
                if not np.all(err <= tol + tol * np.abs(want)):
                    raise AssertionError(f"layer {l}: output differs from the reference by "
                                         f"{err.max():.3g} (tolerance {tol})")

        return check


def _host(x):
    """A float32 numpy copy of a numpy array or torch tensor."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float32)
    return x.float().cpu().numpy()


def make_region(model, max_tokens, device):
    """The engine's region: shared memory, or a zeroed CUDA buffer registered by IPC handle.
    Its name is the process's own: region names are server-wide, and two engines may share
    a server."""
    nbytes = plan.ForwardPlan.nbytes(model, max_tokens)
    name = f"engine-example-{os.getpid()}"
    if device == "cpu":
        return regions.SharedMemoryRegion(name, nbytes)
    import torch
    buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)  # the zeroed doorbells before any stream reads them
    return regions.CudaRegion.from_tensor(name, buffer)


def run(args):
    xp, torch, stream = np, None, None
    if args.device != "cpu":
        import torch
        xp = torch
        stream = torch.cuda.Stream(device=args.device)
    rng = np.random.default_rng(args.seed)
    with replayssm.Client(args.address) as client:
        info = client.info()
        model = info.model
        if model.tp_size > 1:
            raise TensorParallelServer(
                f"the server serves {model.tp_size} tensor-parallel ranks (--tp-size); this "
                "example's activations, weights and reference are unsharded: run it against a "
                "--tp-size=1 server (a TP engine writes rank-major tensors: docs/python.md, "
                "\"Tensor-parallel servers\")")
        prompts = [rng.integers(0, args.vocab, size=args.prompt).tolist()
                   for _ in range(args.requests)]
        max_tokens = max(args.requests * args.prompt, args.requests)
        weights = Weights(model, args.hidden, args.vocab, rng, torch, args.device)
        # Whatever was set up is undone, last first, however the run ends: a failed
        # Allocate must not leave the slots before it live, nor the region registered.
        with ExitStack() as undo:
            region = make_region(model, max_tokens, args.device)
            if args.device == "cpu":
                undo.callback(region.close)
            client.register_region(region)
            undo.callback(client.unregister_region, region)
            slots = []
            undo.callback(lambda: [client.free(slot) for slot in slots])
            for _ in prompts:
                slots.append(client.allocate().slot)
            states = [replayssm.Reference(model).new_state() for _ in prompts]
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                engine = Engine(client, region, weights, max_tokens, xp, stream)
                generated, seconds = decode(client, engine, slots, prompts, states, args)
    report(info, args, prompts, generated, seconds, engine)


class TensorParallelServer(Exception):
    """The server is a tensor-parallel group's: the example drives a TP = 1 server only."""


def decode(client, engine, slots, prompts, states, args):
    """The prompts in one planned prefill, then args.steps planned decodes of every request.
    Returns the generated tokens per request and the decode forwards' wall seconds."""
    check = not args.no_check
    starts = np.cumsum([0] + [len(p) for p in prompts]).tolist()
    rows = [(starts[i], len(p)) for i, p in enumerate(prompts)]
    with client.open_stream() as stream:
        h = engine.forward([t for p in prompts for t in p],
                           lambda p: stream.begin_prefill(list(zip(slots, prompts)), plan=p),
                           check and engine.checker(states, rows))
        stream.commit()
        last = engine.next_tokens(h[[s + n - 1 for s, n in rows]])
        generated = [[t] for t in last]
        one_each = [(i, 1) for i in range(len(slots))]
        seconds = 0.0
        for _ in range(args.steps):
            start = time.perf_counter()
            h = engine.forward(last, lambda p: stream.begin(list(zip(slots, last)), plan=p),
                               check and engine.checker(states, one_each))
            stream.commit()
            last = engine.next_tokens(h)
            seconds += time.perf_counter() - start
            for g, t in zip(generated, last):
                g.append(t)
    return generated, seconds


def report(info, args, prompts, generated, seconds, engine):
    model = engine.model
    print(f"engine: {args.device}, {args.requests} requests, {model.num_layers} "
          f"linear-attention layers (HV={model.num_v_heads} K={model.head_k} "
          f"V={model.head_v}), hidden {args.hidden}")
    print(f"server: {info.backend}, mps {info.mps}")
    for i, (p, g) in enumerate(zip(prompts, generated)):
        print(f"request {i}: prompt {p} -> {g}")
    per_forward = 1e3 * seconds / max(args.steps, 1)
    print(f"{args.steps} planned decodes: {per_forward:.2f} ms per forward"
          f"{' (with the reference check)' if not args.no_check else ''}")
    if not args.no_check:
        print(f"every layer of every forward checked against the reference: max |error| "
              f"{engine.worst:.3g} (tolerance {TOLERANCE[model.act_dtype]})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", required=True, help="replayssm-server host:port")
    parser.add_argument("--device", default="cpu", help="cpu, or a CUDA device (cuda, cuda:0)")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=4, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=8, help="decode steps")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-check", action="store_true", help="skip the reference check")
    try:
        run(parser.parse_args(argv))
    except (replayssm.ReplaySSMError, AssertionError, TensorParallelServer) as e:
        print(f"engine: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
