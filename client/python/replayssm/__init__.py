"""replayssm: the Python client of replayssm-server (docs/python.md).

    import replayssm
    with replayssm.Client("127.0.0.1:50051") as client:
        slot = client.allocate().slot
        ...

The generated wire messages are replayssm.v1.replayssm_pb2 (and transfer_pb2).
"""

from replayssm.client import Client
from replayssm.dtypes import BF16, F16, F32
from replayssm.errors import (Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded,
                              FailedPrecondition, Internal, InvalidArgument, NotFound,
                              OutOfRange, PermissionDenied, ReplaySSMError, ResourceExhausted,
                              Unauthenticated, Unavailable, Unimplemented, Unknown)
from replayssm.plan import Doorbells, ForwardPlan, PlannedLayer, RankedForwardPlan
from replayssm.reference import Reference
from replayssm.regions import CudaRegion, RegionTensor, SharedMemoryRegion
from replayssm.results import Allocation, DecodeResult, ExportedState, PrefillResult
from replayssm.retry import RETRYABLE, new_request_id
from replayssm.stream import ForwardStream
from replayssm import tp
from replayssm.tensors import Activations
from replayssm.v1 import replayssm_pb2 as pb

__version__ = "0.1.0"

__all__ = [
    "Aborted", "Activations", "AlreadyExists", "Allocation", "BF16", "Cancelled", "Client",
    "CudaRegion", "DataLoss", "DeadlineExceeded", "DecodeResult", "Doorbells", "ExportedState",
    "F16", "F32", "FailedPrecondition", "ForwardPlan", "ForwardStream", "Internal",
    "InvalidArgument", "NotFound", "OutOfRange", "PermissionDenied", "PlannedLayer",
    "PrefillResult", "RETRYABLE", "RankedForwardPlan", "Reference", "RegionTensor",
    "ReplaySSMError", "ResourceExhausted", "SharedMemoryRegion", "Unauthenticated",
    "Unavailable", "Unimplemented", "Unknown", "new_request_id", "pb", "tp",
]
