"""Request ids and the retry policy shared by unary calls and stream forwards.

A mutating call gets one request id, made before its first attempt and reused by every retry,
so a retry after a lost reply is answered from the server's request log instead of being
applied twice (docs/api.md, Request ids). The error a call finally raises carries that id
(ReplaySSMError.request_id) for a retry by hand.

UNAVAILABLE and DEADLINE_EXCEEDED are retried `retries` times, `backoff` seconds apart and
doubling. ABORTED is different: it says an earlier attempt with this id is still running on the
server (e.g. one whose deadline passed while it waited for its slots), and that attempt takes as
long as the call itself can; a few short retries would give up while it is still at work. So
ABORTED is retried, without using up `retries`, for up to `aborted_wait` seconds (the client's
default: its call timeout), the backoff doubling from `backoff` to at most
ABORTED_MAX_BACKOFF. Only that ABORTED: a transfer whose move was decided and aborted (by the
peer, or the receiver's abort passed on) is answered ABORTED too, and is final: retried with
the same id it would run anew, a new move after a failed one.
"""

import time
import uuid

import grpc

from replayssm import errors

# A lost reply (DEADLINE_EXCEEDED), a broken connection or a draining server (UNAVAILABLE), or
# the same id still in flight (ABORTED): safe to retry with the same request id.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.ABORTED})

# What the server's request log says of an id whose earlier attempt is still running
# (service/operations.cc, forward_session.cc): the one ABORTED that is retried.
IN_FLIGHT = "still in flight"

# The longest pause between two attempts of a call answered ABORTED: the attempt in flight is
# noticed finished within this.
ABORTED_MAX_BACKOFF = 1.0


def new_request_id():
    """A random 128-bit id, hex."""
    return uuid.uuid4().hex


def with_retries(attempt, retries, backoff, before_retry=None, aborted_wait=0.0):
    """attempt() until it succeeds or raises a ReplaySSMError that is not retried: a code
    outside RETRYABLE; UNAVAILABLE or DEADLINE_EXCEEDED after `retries` retries, `backoff`
    seconds apart and doubling; ABORTED once `aborted_wait` seconds have passed since the first
    ABORTED, the pauses doubling from `backoff` up to ABORTED_MAX_BACKOFF. retries=0 retries
    nothing, ABORTED included. before_retry() runs before each retry."""
    failures = aborts = 0
    aborted_until = None
    while True:
        try:
            return attempt()
        except errors.ReplaySSMError as e:
            if e.code not in RETRYABLE or retries == 0:
                raise
            if e.code == grpc.StatusCode.ABORTED:
                if IN_FLIGHT not in (e.details or ""):
                    raise  # a decided abort (a transfer's), not an attempt still running
                now = time.monotonic()
                if aborted_until is None:
                    aborted_until = now + aborted_wait
                if now >= aborted_until:
                    raise
                # The exponent stops growing once past the cap: 2 ** 1024 as a float overflows
                # (after ~17 min of waiting at the cap, an OverflowError lost the request id).
                pause = min(backoff * (2 ** min(aborts, 32)), ABORTED_MAX_BACKOFF,
                            aborted_until - now)
                aborts += 1
            else:
                if failures == retries:
                    raise
                pause = backoff * (2 ** failures)
                failures += 1
        if before_retry is not None:
            before_retry()
        time.sleep(pause)
