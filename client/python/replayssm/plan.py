"""Planned forwards (docs/data-plane.md): every layer's inputs and output named at the begin,
in registered regions, with two uint32 doorbell arrays. The engine writes layer l's inputs,
rings ready[l]; the server runs the layer and writes done[l]; the engine waits for it before
reading the output. No message per layer.

- Doorbells: uint32 [count] in a region, rung and waited on from the host (shared memory) or
  from a torch CUDA stream (CUDA regions: cuStreamWriteValue32 / cuStreamWaitValue32).
- ForwardPlan: the per-layer RegionTensors and the two doorbell arrays, with the counter that
  gives each forward its value; ForwardStream.begin(..., plan=) sends it.

Values compare cyclically, (int32)(word - value) >= 0, as CUDA's stream waits do: each forward
takes a new value, so old rings never satisfy new waits and no word is ever reset.

Memory ordering, shared memory: write() of the inputs completes before ring() in program
order, and ring() is one aligned 32-bit store (numpy's uint32 element store); x86 keeps
stores in order (TSO), so the server sees the inputs once it sees the ring. Likewise a done
word read before the outputs (loads are not reordered with loads). Other architectures would
need fences that Python cannot issue: the shared-memory doorbells assume x86-64.
"""

import sys
import time
from typing import NamedTuple

import numpy as np

from replayssm import cuda_memops, dtypes, errors
from replayssm.regions import CudaRegion, RegionTensor, _check_fits
from replayssm.v1 import regions_pb2
from replayssm.v1 import replayssm_pb2 as pb

DOORBELL_ALIGNMENT = 4  # what the server checks for doorbell arrays
# ForwardPlan.layout places each tensor at a multiple of this from the plan's offset: on a cache
# line when the offset is on one. Relative to the offset, so that nbytes() fits from any offset.
LAYOUT_ALIGNMENT = 64
_WORD = 0xFFFFFFFF


def reached(word, value):
    """The plan's compare: (int32)(word - value) >= 0."""
    return ((int(word) - int(value)) & _WORD) < 0x80000000


def _latest(words):
    """The cyclically largest word (the value a new plan must go past)."""
    latest = int(words[0])
    for w in words[1:]:
        if not reached(latest, int(w)):
            latest = int(w)
    return latest


class Doorbells:
    """uint32 [count] at `offset` of a region (4-byte aligned). Shared memory: rung and polled
    from the host. CUDA (a CudaRegion from a tensor): rung and waited on from a torch stream."""

    def __init__(self, region, offset, count, field="doorbells"):
        _check_fits(region, offset, 4 * count, field, DOORBELL_ALIGNMENT)
        self.region, self.offset, self.count = region, offset, count
        self._cuda = isinstance(region, CudaRegion)
        if self._cuda:
            torch = sys.modules["torch"]
            self._words = region.tensor(offset, (count,), torch.int32, DOORBELL_ALIGNMENT)
        else:
            self._words = region.ndarray(offset, (count,), np.uint32, DOORBELL_ALIGNMENT)

    def ref(self):
        return regions_pb2.RegionRef(region=self.region.name, offset=self.offset)

    def words(self):
        """The current words, read on the host (CUDA: a synchronizing copy)."""
        if self._cuda:
            return [w & _WORD for w in self._words.tolist()]
        return [int(w) for w in self._words]

    def _index(self, index):
        if not 0 <= index < self.count:
            raise errors.InvalidArgument(f"layer: expected 0..{self.count - 1}, got {index}")
        return index

    def ring(self, index, value, stream=None):
        """Sets word `index` to `value`. CUDA: queued on `stream` (default: torch's current
        stream) after the work already there, e.g. the kernels that wrote the inputs."""
        index = self._index(index)
        if not self._cuda:
            self._words[index] = np.uint32(value & _WORD)  # one aligned 32-bit store
            return
        torch = sys.modules["torch"]
        stream = stream or torch.cuda.current_stream(self._words.device)
        word = self._words[index]
        if not cuda_memops.write_value32(stream.cuda_stream, word.data_ptr(), value):
            with torch.cuda.stream(stream):  # an old driver: a one-element fill kernel
                word.fill_(value - (1 << 32) if value & 0x80000000 else value)

    def wait(self, index, value, timeout=10.0, stream=None):
        """Until word `index` reaches `value` (cyclically). Shared memory: polls on the host,
        DeadlineExceeded after `timeout` seconds. CUDA: queues the wait on `stream` and returns
        at once; later work on the stream runs after the word is written."""
        index = self._index(index)
        if self._cuda:
            torch = sys.modules["torch"]
            stream = stream or torch.cuda.current_stream(self._words.device)
            address = self._words[index].data_ptr()
            if cuda_memops.wait_value32(stream.cuda_stream, address, value):
                return
            stream.synchronize()  # an old driver: wait on the host instead
        self._poll(index, value, timeout)

    def _poll(self, index, value, timeout):
        end = time.monotonic() + timeout
        spins = 0
        while not reached(self._read(index), value):
            if time.monotonic() > end:
                raise errors.DeadlineExceeded(
                    f"done[{index}]: expected {value}, got {self._read(index)} after "
                    f"{timeout} s (the server has not finished layer {index})")
            spins += 1
            time.sleep(0 if spins < 1000 else 20e-6)

    def _read(self, index):
        return int(self._words[index]) & _WORD


class PlannedLayer(NamedTuple):
    """One layer's RegionTensors, shaped for the plan's capacity in tokens. On a TP server's
    group form each holds the T ranks' tensors rank-major: [T, N, width / T]."""

    mixed_qkv: RegionTensor  # [N, 2*H*K + HV*V]
    a: RegionTensor  # GDN [N, HV], KDA [N, HV, K]
    b: RegionTensor  # [N, HV]
    out: RegionTensor  # [N, HV, V]

    def head(self, n, ranks=1):
        """What a forward of n tokens reads and writes: the first n tokens of each; with
        ranks = T > 1 (tensors [T, N, ...]) each rank's n tokens, packed: [T, n, ...] from the
        same offset, as the server reads a group tensor of n tokens."""
        if ranks == 1:
            return PlannedLayer(*(t.head(n) for t in self))
        return PlannedLayer(*(_group_head(t, n) for t in self))

    def proto(self):
        return regions_pb2.PlannedLayer(mixed_qkv=self.mixed_qkv.ref(), a=self.a.ref(),
                                        b=self.b.ref(), out=self.out.ref())


def _group_head(t, n):
    if not 0 <= n <= t.shape[1]:
        raise errors.InvalidArgument(f"{t.region.name}@{t.offset}: n: expected "
                                     f"0..{t.shape[1]}, got {n}")
    return t._replace(shape=(t.shape[0], n, *t.shape[2:]))


def _ranks(model):
    return max(int(getattr(model, "tp_size", 1)), 1)


def layer_shapes(model, n, rank=False):
    """The shapes of one layer's mixed_qkv, a, b, out for n tokens of `model` (a ModelInfo).
    On a TP server (model.tp_size = T > 1, docs/api.md "Tensor parallelism") they are the
    group's rank-major tensors, [T, n, width / T]; rank=True: one rank's own, [n, width / T]
    (what a RankPlan names)."""
    t = _ranks(model)
    h, hv, k, v = model.num_qk_heads // t, model.num_v_heads // t, model.head_k, model.head_v
    a = (hv, k) if model.gate == pb.GATE_KDA else (hv,)
    shapes = (2 * h * k + hv * v,), a, (hv,), (hv, v)
    lead = (n,) if t == 1 or rank else (t, n)
    return tuple(lead + s for s in shapes)


def _up(x):
    return (x + LAYOUT_ALIGNMENT - 1) // LAYOUT_ALIGNMENT * LAYOUT_ALIGNMENT


class ForwardPlan:
    """Every layer's RegionTensors and the ready/done doorbells of planned forwards, reused
    forward after forward. `value` is the current forward's doorbell value: begin(plan=)
    advances it (next_value), ring / wait_done use it. It starts past every word already in
    the doorbells, so memory reused from an earlier plan cannot satisfy a new wait."""

    def __init__(self, layers, ready, done, ranks=1):
        """`ranks`: T when the tensors are a TP group's, rank-major [T, N, ...]; else 1."""
        layers = [PlannedLayer(*layer) for layer in layers]
        for name, bells in (("ready", ready), ("done", done)):
            if bells.count != len(layers):
                raise errors.InvalidArgument(f"plan.{name}: expected {len(layers)} doorbells "
                                             f"(one per layer), got {bells.count}")
        self.layers, self.ready, self.done, self.ranks = layers, ready, done, ranks
        self.value = _latest(ready.words() + done.words())

    @staticmethod
    def nbytes(model, max_tokens, rank=False):
        """Bytes layout() needs for `model` and forwards of up to max_tokens tokens from its
        offset, whatever the offset (a region of offset + nbytes holds the plan); rank=True:
        one rank's part of a TP server's RankedForwardPlan."""
        per_layer = sum(_up(int(np.prod(s)) * _itemsize(model)) for s in
                        layer_shapes(model, max_tokens, rank))
        return _up(8 * model.num_layers) + model.num_layers * per_layer

    @classmethod
    def layout(cls, region, model, max_tokens, offset=0, rank=False, field="plan"):
        """A plan over `region` from `offset` (a multiple of 16, regions.ALIGNMENT; of 64 to
        put every tensor on a cache line): ready [L], done [L], then per layer mixed_qkv, a, b,
        out for max_tokens tokens in the model's activation dtype, each at a multiple of
        LAYOUT_ALIGNMENT bytes from `offset` (nbytes() in all). On a TP server the tensors are
        the group's, [T, max_tokens, width / T]; rank=True: one rank's
        (RankedForwardPlan.layout)."""
        num_layers = model.num_layers
        ready = Doorbells(region, offset, num_layers, f"{field}.ready")
        done = Doorbells(region, offset + 4 * num_layers, num_layers, f"{field}.done")
        at = _up(8 * num_layers)  # from offset, as nbytes() counts
        layers = []
        for l in range(num_layers):
            tensors = []
            for part, shape in zip(PlannedLayer._fields, layer_shapes(model, max_tokens, rank)):
                tensors.append(RegionTensor.at(region, offset + at, model.act_dtype, shape,
                                               f"{field}.layers[{l}].{part}"))
                at = _up(at + int(np.prod(shape)) * _itemsize(model))
            layers.append(PlannedLayer(*tensors))
        return cls(layers, ready, done, 1 if rank else _ranks(model))

    def layer(self, l, n):
        """Layer l's tensors for a forward of n tokens (PlannedLayer.head)."""
        return self.layers[l].head(n, self.ranks)

    def next_value(self):
        """A new forward: the next value (cyclic uint32; never reuses the last one)."""
        self.value = (self.value + 1) & _WORD
        return self.value

    def proto(self):
        """The wire ForwardPlan of the current value."""
        return regions_pb2.ForwardPlan(layers=[layer.proto() for layer in self.layers],
                                       ready=self.ready.ref(), done=self.done.ref(),
                                       value=self.value)

    def ring(self, layer, stream=None):
        """Layer `layer`'s inputs are written: ready[layer] = value (see Doorbells.ring)."""
        self.ready.ring(layer, self.value, stream)

    def wait_done(self, layer, timeout=10.0, stream=None):
        """Until the server has written layer `layer`'s output (see Doorbells.wait)."""
        self.done.wait(layer, self.value, timeout, stream)


def _itemsize(model):
    return dtypes.itemsize(model.act_dtype)


class RankedForwardPlan:
    """A TP server's planned forward in its `ranks` form (docs/api.md, "Tensor parallelism"):
    one ForwardPlan per rank, each in memory that rank's engine registered (its GPU), with the
    rank's own tensors ([N, width / T]) and doorbells. Rank r's layer l waits for its
    ready[l] and writes its done[l]; one value for all ranks per forward."""

    def __init__(self, ranks):
        if not ranks:
            raise errors.InvalidArgument("plan.ranks: expected one ForwardPlan per rank, got none")
        for r, p in enumerate(ranks):
            if p.ranks != 1 or len(p.layers) != len(ranks[0].layers):
                raise errors.InvalidArgument(f"plan.ranks[{r}]: expected a rank's plan of "
                                             f"{len(ranks[0].layers)} layers (layout(rank=True))")
        self.plans = list(ranks)
        self.value = _latest([p.value for p in self.plans])
        for p in self.plans:
            p.value = self.value

    @staticmethod
    def nbytes(model, max_tokens):
        """Bytes each rank's region needs from its offset (whatever the offset)."""
        return ForwardPlan.nbytes(model, max_tokens, rank=True)

    @classmethod
    def layout(cls, regions, model, max_tokens, offsets=None):
        """One rank's plan in each of `regions` (rank order, model.tp_size of them), from
        offsets[r] (0 when not given)."""
        if len(regions) != _ranks(model):
            raise errors.InvalidArgument(f"regions: expected {_ranks(model)} (one per rank, "
                                         f"tp_size), got {len(regions)}")
        offsets = offsets or [0] * len(regions)
        return cls([ForwardPlan.layout(region, model, max_tokens, offset, rank=True,
                                       field=f"plan.ranks[{r}]")
                    for r, (region, offset) in enumerate(zip(regions, offsets))])

    def next_value(self):
        self.value = (self.value + 1) & _WORD
        for p in self.plans:
            p.value = self.value
        return self.value

    def proto(self):
        return regions_pb2.ForwardPlan(
            ranks=[regions_pb2.RankPlan(layers=[layer.proto() for layer in p.layers],
                                        ready=p.ready.ref(), done=p.done.ref())
                   for p in self.plans], value=self.value)

    def layer(self, rank, l, n):
        """Rank `rank`'s layer l tensors for a forward of n tokens."""
        return self.plans[rank].layer(l, n)

    def ring(self, rank, layer, stream=None):
        """Rank `rank`'s layer `layer` inputs are written."""
        self.plans[rank].ring(layer, stream)

    def wait_done(self, rank, layer, timeout=10.0, stream=None):
        """Until the server has written rank `rank`'s layer `layer` output."""
        self.plans[rank].wait_done(layer, timeout, stream)
