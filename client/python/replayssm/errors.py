"""Typed errors: one exception class per gRPC status code, all subclasses of ReplaySSMError.

The server's code and message are carried unchanged (`.code`, `.details`); the message names
the offending field with what was expected and what came (docs/api.md, Errors). Input the client
refuses before sending (a tensor it cannot encode, ragged drafts) raises InvalidArgument in the
same form.

A failure of a call that sent a request id (every mutating call, a stream's forward) carries
it as `.request_id`, also at the end of the message: the call may have been applied (its reply
lost), so a retry by hand passes that id again and is answered from the server's request log
rather than applied twice (docs/api.md, Request ids).
"""

import grpc


class ReplaySSMError(Exception):
    """A failed call. `code` is a grpc.StatusCode, `details` the server's message,
    `request_id` the id the failed call sent (None: the call has none, or nothing was sent)."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, details, *, code=None, method=None, request_id=None):
        if code is not None:
            self.code = code
        self.details = details
        self.method = method
        self.request_id = request_id or None
        where = f"{method}: " if method else ""
        sent = f" [request_id {request_id}]" if request_id else ""
        super().__init__(f"{where}{self.code.name}: {details}{sent}")


class Cancelled(ReplaySSMError):
    code = grpc.StatusCode.CANCELLED


class Unknown(ReplaySSMError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(ReplaySSMError):
    """A dtype, shape, range or request id is wrong; the details name the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(ReplaySSMError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(ReplaySSMError):
    """An unknown, freed, donated or foreign slot handle."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ReplaySSMError):
    """A retried call that was applied but whose reply was too large for the server to keep."""

    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(ReplaySSMError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(ReplaySSMError):
    """No free slot, or a message over the size limit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(ReplaySSMError):
    """A state invariant: a slot in an open forward, drafts awaiting Accept, a stream out of
    order."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(ReplaySSMError):
    """The same request id is still in flight: retry later with the same id (the client does,
    for up to its `aborted_wait` seconds; replayssm.retry). Or, from TransferSlot / PullSlot,
    the move was aborted (by the peer, or the receiver's abort passed on): final, the state
    stayed at the source; not retried."""

    code = grpc.StatusCode.ABORTED


class OutOfRange(ReplaySSMError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(ReplaySSMError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(ReplaySSMError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(ReplaySSMError):
    """The server is draining or cannot be reached."""

    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(ReplaySSMError):
    """A slot whose device launch failed after validation; only Free works on it."""

    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(ReplaySSMError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE = {cls.code: cls for cls in ReplaySSMError.__subclasses__()}


def error_for(code, details, method=None, request_id=None):
    """The typed error of a gRPC status code."""
    cls = _BY_CODE.get(code, ReplaySSMError)
    return cls(details, code=code, method=method, request_id=request_id)


def from_rpc_error(error, method=None, request_id=None):
    """A grpc.RpcError (a failed call, or a stream the server ended) as a typed error;
    `request_id`: the id the call sent, if any."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return error_for(code, details or "", method, request_id)
