"""Request ids and the retry policy shared by unary calls and stream forwards.

A mutating call gets one request id, made before its first attempt and reused by every retry,
so a retry after a lost reply is answered from the server's request log instead of being
applied twice (docs/api.md, Request ids).
"""

import time
import uuid

import grpc

from replayssm import errors

# A lost reply (DEADLINE_EXCEEDED), a broken connection or a draining server (UNAVAILABLE), or
# the same id still in flight (ABORTED): safe to retry with the same request id.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.ABORTED})


def new_request_id():
    """A random 128-bit id, hex."""
    return uuid.uuid4().hex


def with_retries(attempt, retries, backoff, before_retry=None):
    """attempt() until it succeeds, raises a non-RETRYABLE ReplaySSMError, or `retries` extra
    attempts, `backoff` seconds apart and doubling, have failed too."""
    for n in range(retries + 1):
        try:
            return attempt()
        except errors.ReplaySSMError as e:
            if e.code not in RETRYABLE or n == retries:
                raise
        if before_retry is not None:
            before_retry()
        time.sleep(backoff * (2 ** n))
    raise AssertionError("unreachable")
