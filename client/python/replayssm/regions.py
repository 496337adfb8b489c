"""Registered memory regions: the client's side of the zero-copy data plane (issue 18 §1-2).

replayssm-server does not serve regions yet: tensors travel inline. This module holds what a
region is on the client (a POSIX shared-memory segment it owns, and a tensor placed in a region
by offset), so that code which lays activations out in shared memory today only swaps inline
tensors for RegionTensors once the server registers regions. A RegionTensor given to a call
now is refused with Unimplemented before anything is sent.

Planned on top (with the server's RPCs): Client.register_region / unregister_region /
region_status, CUDA IPC regions from a torch CUDA tensor, and per-layer doorbells.
"""

import abc
from multiprocessing import shared_memory
from typing import NamedTuple

import numpy as np

from replayssm import dtypes, errors

# Offsets of tensors in a region: what the service's kernels need for vector loads.
ALIGNMENT = 16


class Region(abc.ABC):
    """Memory a client shares with the server, named for registration."""

    @property
    @abc.abstractmethod
    def name(self):
        """The name the server would map it by."""

    @property
    @abc.abstractmethod
    def nbytes(self):
        """Usable bytes."""

    @abc.abstractmethod
    def describe(self):
        """The registration fields: kind, name, offset, bytes (and for CUDA, device)."""


class SharedMemoryRegion(Region):
    """A POSIX shared-memory segment (/dev/shm/NAME). create=True makes a new one that this
    object owns and unlinks on close(); create=False attaches to an existing one."""

    def __init__(self, nbytes, name=None, *, create=True):
        self._shm = shared_memory.SharedMemory(name=name, create=create, size=nbytes)
        self._owner = create
        self._nbytes = nbytes if create else self._shm.size

    @property
    def name(self):
        return self._shm.name

    @property
    def nbytes(self):
        return self._nbytes

    @property
    def buffer(self):
        return self._shm.buf

    def describe(self):
        return {"kind": "shm", "name": self.name, "offset": 0, "bytes": self.nbytes}

    def ndarray(self, offset, shape, dtype=np.float32):
        """A numpy view of the region at `offset` (writes go to the shared memory)."""
        dtype = np.dtype(dtype)
        _check_fits(self, offset, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, "ndarray")
        return np.ndarray(shape, dtype=dtype, buffer=self._shm.buf, offset=offset)

    def close(self):
        """Detaches; the owner also removes the segment."""
        if self._shm is None:
            return
        self._shm.close()
        if self._owner:
            self._shm.unlink()
        self._shm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_fits(region, offset, nbytes, field):
    if offset < 0 or offset % ALIGNMENT:
        raise errors.InvalidArgument(f"{field}.offset: expected a multiple of {ALIGNMENT} "
                                     f">= 0, got {offset}")
    if offset + nbytes > region.nbytes:
        raise errors.InvalidArgument(f"{field}: expected at most {region.nbytes - offset} bytes "
                                     f"at offset {offset} of region {region.name!r}, "
                                     f"got {nbytes}")


class RegionTensor(NamedTuple):
    """A tensor that lives in a region: `dtype` (a wire dtype or name) and `shape` at
    `offset`. Checked against the region's bounds and ALIGNMENT when made with at()."""

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


def refuse_inline(x, field):
    """Raises Unimplemented for a RegionTensor: the server takes inline tensors only."""
    if isinstance(x, RegionTensor):
        raise errors.Unimplemented(f"{field}: registered regions are not served yet; send the "
                                   "tensor inline")
