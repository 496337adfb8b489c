"""Registered memory regions (replayssm.v1.Regions, docs/data-plane.md): memory a co-located
client registers once under a name, so that tensors and doorbells can live there instead of
travelling inline.

- SharedMemoryRegion: a POSIX shm object this process creates (and unlinks) or attaches to,
  with numpy views into it.
- CudaRegion: device memory by its CUDA IPC handle, e.g. a torch CUDA tensor's
  (CudaRegion.from_tensor).
- RegionTensor: a dtype and shape at an offset of a region, checked against its bounds and
  ALIGNMENT; ref() is the wire RegionRef that a ForwardPlan (replayssm.plan) or a stream's
  layer message names; write() and read() move values in and out of it.

Client.register_region / unregister_region / region_status talk to the server. A forward's
layer names regions for all four of its tensors or none: in a ForwardStream layer message, in
the unary prefill / decode / verify (e.g. a plan.PlannedLayer's head(n)), or every layer at once
in a plan. Other calls carry tensors inline: a RegionTensor given to one is refused with
Unimplemented before anything is sent.
"""

import _posixshmem
import abc
import atexit
import contextlib
import sys
import threading
from multiprocessing import resource_tracker, shared_memory
from typing import NamedTuple

import numpy as np

from replayssm import dtypes, errors
from replayssm.dtypes import BF16, F16, F32
from replayssm.v1 import regions_pb2

# Offsets of tensors in a region (the server checks the same): what its kernels' vector loads
# need.
ALIGNMENT = 16


class Region(abc.ABC):
    """Memory shared with the server under `name` (unique on the server)."""

    def __init__(self, name, nbytes):
        self.name = name
        self.nbytes = nbytes

    @abc.abstractmethod
    def register_request(self):
        """The RegisterSystemRegionRequest or RegisterCudaRegionRequest of this region."""

    def start(self):
        """Where the region starts past an aligned boundary, in bytes: the server checks a
        tensor's alignment on its address, so offset 0 of a region that starts 4 bytes into its
        allocation is not 16-byte aligned. Shared memory is mapped at a page: 0."""
        return 0


# The shm names this process created and has not unlinked yet. Python's resource tracker keeps
# one entry per name for the whole process, so an attachment to one of these must leave it.
_owned = set()

# Owned names the resource tracker cannot hold (below), unlinked by this process at its exit.
_owned_untracked = set()


def _untrackable(shm_name):
    """Whether Python's resource tracker cannot hold `shm_name`: before 3.13 its messages are
    split at ':', so a tenant's key ("/search:engine0", docs/python.md) makes every register
    and unregister print a ValueError traceback from the tracker, and the object is never
    tracked (one left by a process that did not close() it stayed in /dev/shm)."""
    return shm_name is not None and ":" in shm_name


# Held while this module creates, attaches or removes shared memory and while the tracker is
# off: two threads switching it off at once left it off for good (the second saved the first's
# stand-ins and restored them last), and another thread's tracked region made meanwhile was
# never registered.
_shm_lock = threading.RLock()


@contextlib.contextmanager
def _tracker_off():
    """SharedMemory's calls to the resource tracker do nothing meanwhile (Python < 3.13 has no
    track=False)."""
    with _shm_lock:
        register, unregister = resource_tracker.register, resource_tracker.unregister
        resource_tracker.register = resource_tracker.unregister = lambda *args, **kwargs: None
        try:
            yield
        finally:
            resource_tracker.register, resource_tracker.unregister = register, unregister


@atexit.register
def _unlink_untracked():
    """What the resource tracker would have done for the names it cannot hold: the objects this
    process created and did not close() are removed when it exits (not when it is killed)."""
    for name in list(_owned_untracked):
        try:
            _posixshmem.shm_unlink("/" + name.lstrip("/"))
        except OSError:
            pass
    _owned_untracked.clear()


def _create(shm_name, nbytes):
    with _shm_lock:
        return _create_locked(shm_name, nbytes)


def _create_locked(shm_name, nbytes):
    if not _untrackable(shm_name):
        shm = shared_memory.SharedMemory(name=shm_name, create=True, size=nbytes)
        _owned.add(shm._name)
        return shm
    if sys.version_info >= (3, 13):
        shm = shared_memory.SharedMemory(name=shm_name, create=True, size=nbytes, track=False)
    else:
        with _tracker_off():
            shm = shared_memory.SharedMemory(name=shm_name, create=True, size=nbytes)
    _owned.add(shm._name)
    _owned_untracked.add(shm._name)
    return shm


def _attach(shm_name):
    """The existing shm object `shm_name`, left out of this process's resource tracker: Python
    (before 3.13's track=False) registers attachments too, and the tracker unlinks whatever its
    process registered when that process exits; the owner's object would vanish under it."""
    with _shm_lock:
        return _attach_locked(shm_name)


def _attach_locked(shm_name):
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=shm_name, track=False)
    if _untrackable(shm_name):
        with _tracker_off():
            return shared_memory.SharedMemory(name=shm_name)
    shm = shared_memory.SharedMemory(name=shm_name)
    if shm._name not in _owned:
        resource_tracker.unregister(shm._name, "shared_memory")
    return shm


class SharedMemoryRegion(Region):
    """A POSIX shm object. create=True makes a new one (named `key`, or a fresh name) that this
    object owns and unlinks on close(); create=False attaches to the existing `key`, which
    stays its owner's: neither close() nor this process's exit removes it."""

    def __init__(self, name, nbytes, *, key=None, create=True):
        shm_name = key.lstrip("/") if key else None
        if create:
            self._shm = _create(shm_name, nbytes)
        else:
            self._shm = _attach(shm_name)
        self._owner = create
        self.key = "/" + self._shm.name.lstrip("/")  # the shm_open name
        super().__init__(name, nbytes if create else self._shm.size)

    def register_request(self):
        return regions_pb2.RegisterSystemRegionRequest(name=self.name, key=self.key, offset=0,
                                                       byte_size=self.nbytes)

    def ndarray(self, offset, shape, dtype=np.float32, alignment=ALIGNMENT):
        """A numpy view at `offset` (writes go to the shared memory)."""
        dtype = np.dtype(dtype)
        _check_fits(self, offset, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
                    "ndarray", alignment)
        return np.ndarray(shape, dtype=dtype, buffer=self._shm.buf, offset=offset)

    def close(self):
        """Detaches; the owner also removes the object (one already removed is no error)."""
        if self._shm is None:
            return
        self._shm.close()
        if self._owner:
            name = self._shm._name
            _owned.discard(name)
            tracked = name not in _owned_untracked
            _owned_untracked.discard(name)
            with _shm_lock, contextlib.nullcontext() if tracked else _tracker_off():
                try:
                    self._shm.unlink()
                except FileNotFoundError:
                    # Removed by someone else; unlink() raised before dropping the tracker's
                    # entry, which would otherwise try again at exit and warn of a leak.
                    resource_tracker.unregister(name, "shared_memory")
        self._shm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class CudaRegion(Region):
    """Device memory by its CUDA IPC handle: `nbytes` at `offset` in the allocation the 64-byte
    `raw_handle` (cudaIpcGetMemHandle) names, on `device_id`. Keep the memory alive while the
    region is registered (from_tensor keeps a reference to its tensor)."""

    def __init__(self, name, raw_handle, device_id, offset, nbytes, *, owner=None):
        super().__init__(name, nbytes)
        self.raw_handle = bytes(raw_handle)
        self.device_id = device_id
        self.offset = offset
        self._owner = owner

    @classmethod
    def from_tensor(cls, name, tensor):
        """The memory of a contiguous torch CUDA tensor (the handle names its allocation; the
        offset is the tensor's place in it). Uses torch's own IPC export, as
        torch.multiprocessing does."""
        if not tensor.is_cuda or not tensor.is_contiguous():
            raise errors.InvalidArgument(f"{name}: expected a contiguous CUDA tensor, got "
                                         f"device {tensor.device}, contiguous "
                                         f"{tensor.is_contiguous()}")
        device, handle, _, storage_offset, *_ = tensor.untyped_storage()._share_cuda_()
        offset = storage_offset + tensor.storage_offset() * tensor.element_size()
        return cls(name, _cuda_ipc_handle(bytes(handle), name), device, offset,
                   tensor.numel() * tensor.element_size(), owner=tensor)

    def tensor(self, offset, shape, dtype, alignment=ALIGNMENT):
        """A torch view of `shape` and torch `dtype` at `offset` of the region (from_tensor's
        regions only: the view shares the registered tensor's memory)."""
        if self._owner is None:
            raise errors.FailedPrecondition(f"{self.name}: a view needs the region's tensor "
                                            "(make the region with CudaRegion.from_tensor)")
        torch = sys.modules["torch"]
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        _check_fits(self, offset, nbytes, "tensor", alignment)
        raw = self._owner.reshape(-1).view(torch.uint8)
        return raw[offset:offset + nbytes].view(dtype).view(tuple(shape))

    def start(self):
        return self.offset  # cudaMalloc allocations start at 256-byte boundaries

    def register_request(self):
        return regions_pb2.RegisterCudaRegionRequest(name=self.name, raw_handle=self.raw_handle,
                                                     device_id=self.device_id,
                                                     offset=self.offset, byte_size=self.nbytes)


def _cuda_ipc_handle(handle, name):
    """The cudaIpcMemHandle in torch's export: torch 2.2+ prefixes it with a format version and
    the allocation's kind ('c' cudaMalloc; 'e' an expandable segment, which has none)."""
    if len(handle) == 64:
        return handle
    if len(handle) == 66 and handle[1:2] == b"c":
        return handle[2:]
    raise errors.InvalidArgument(f"{name}: expected the IPC handle of a cudaMalloc allocation, "
                                 f"got {len(handle)} bytes of kind {handle[1:2]!r} (torch's "
                                 "expandable segments cannot be shared by handle)")


def _check_fits(region, offset, nbytes, field, alignment=ALIGNMENT):
    start = region.start() % alignment
    if offset < 0 or (start + offset) % alignment:
        past = (f" (region {region.name!r} starts {start} bytes past a {alignment}-byte boundary:"
                f" offsets {(alignment - start) % alignment} + k * {alignment} are)"
                if start else "")
        raise errors.InvalidArgument(f"{field}.offset: expected a {alignment}-byte aligned "
                                     f"offset >= 0{past}, got {offset}")
    if offset + nbytes > region.nbytes:
        raise errors.InvalidArgument(f"{field}: expected at most {region.nbytes - offset} bytes "
                                     f"at offset {offset} of region {region.name!r}, "
                                     f"got {nbytes}")


class RegionTensor(NamedTuple):
    """A tensor that lives in a region: `dtype` (a wire dtype) and `shape` at `offset`. Made
    with at(), which checks it against the region's bounds and ALIGNMENT."""

    region: Region
    offset: int
    dtype: int
    shape: tuple

    @classmethod
    def at(cls, region, offset, dtype, shape, field="tensor"):
        code = dtypes.dtype_code(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtypes.itemsize(code)
        _check_fits(region, offset, nbytes, field)
        return cls(region, offset, code, tuple(shape))

    def ref(self):
        """The wire RegionRef (region name + offset)."""
        return regions_pb2.RegionRef(region=self.region.name, offset=self.offset)

    def head(self, n):
        """The first n rows (a forward of n tokens in a tensor laid out for more)."""
        if not 0 <= n <= self.shape[0]:
            raise errors.InvalidArgument(f"{self.region.name}@{self.offset}.rows: expected "
                                         f"0..{self.shape[0]}, got {n}")
        return self._replace(shape=(n, *self.shape[1:]))

    def view(self):
        """The memory itself: a numpy array in a SharedMemoryRegion (float32, float16, or the
        uint16 bits of bf16), a torch tensor of the wire dtype in a CudaRegion."""
        if isinstance(self.region, CudaRegion):
            torch = sys.modules["torch"]
            dtype = {F32: torch.float32, BF16: torch.bfloat16, F16: torch.float16}[self.dtype]
            return self.region.tensor(self.offset, self.shape, dtype)
        numpy_dtype = {F32: "<f4", BF16: "<u2", F16: "<f2"}[self.dtype]
        return self.region.ndarray(self.offset, self.shape, numpy_dtype)

    def write(self, x):
        """Stores x (numpy or torch, any float dtype, this shape) cast to the wire dtype; bf16
        from numpy is rounded to nearest even as inline tensors are. CUDA regions: a copy on
        torch's current stream."""
        if tuple(x.shape) != self.shape:
            raise errors.InvalidArgument(f"{self.region.name}@{self.offset}.shape: expected "
                                         f"{list(self.shape)}, got {list(x.shape)}")
        dst = self.view()
        if isinstance(self.region, CudaRegion):
            if isinstance(x, np.ndarray):  # copy_ takes tensors only
                x = sys.modules["torch"].from_numpy(np.ascontiguousarray(x))
            dst.copy_(x)  # casts to the wire dtype (round to nearest even for bf16)
            return
        if not isinstance(x, np.ndarray) and hasattr(x, "detach"):  # a torch tensor
            x = x.detach().float().cpu().numpy()
        if self.dtype == BF16:
            dst[...] = dtypes.float_to_bf16_bits(np.asarray(x, dtype=np.float32))
        else:
            dst[...] = np.asarray(x)

    def read(self):
        """The values: a float32 numpy copy (f16: float16) from shared memory, a torch view
        from a CUDA region."""
        src = self.view()
        if isinstance(self.region, CudaRegion):
            return src
        if self.dtype == BF16:
            return dtypes.bf16_bits_to_float(src)
        return np.array(src)


def refuse_inline(x, field):
    """Raises Unimplemented for a RegionTensor where a tensor travels inline (a forward's layer
    names regions whole: tensors.any_layer_input)."""
    if isinstance(x, RegionTensor):
        raise errors.Unimplemented(f"{field}: this call carries tensors inline; a region tensor "
                                   "goes in a forward's layer (all four of its tensors in "
                                   "regions) or a plan (the server takes Import and Export "
                                   "checkpoints in regions too: build the request with "
                                   "replayssm.pb and call client.stub)")
