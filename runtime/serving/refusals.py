"""What the dataplane refuses, as a kind: each transport answers it with its own status.

The checks (tensors, bounds, tenancy, sequences, admission, readiness) raise `Refusal`
with a `Kind` and a message for people; REST maps the kind to an HTTP status and gRPC to
a status code, each from one table (`HTTP_STATUS` here, `grpc.endpoint.CODES`), so
the same mistake gets the same answer on every door. The request's outcome in
kiln_requests_total is the kind's too (`OUTCOME`), counted once, by the dataplane.
"""

from __future__ import annotations

import enum
import logging
import secrets

from kiln.runtime.serving.scheduling.errors import (ExecutionFailed, InputsRefused, InvalidBatch, Overloaded,
                                                    ShuttingDown)

# Retry-After (seconds) while a model loads, is unhealthy, or the server drains.
NOT_READY_RETRY_AFTER = 5
# Error messages are cut to this: what a client sent is never echoed back whole.
_MAX_ERROR_CHARS = 1024


class Kind(enum.Enum):
    INVALID = "invalid"                # malformed, or does not fit the model
    REFUSED = "refused"                # well formed, but the engine refused the inputs
    NOT_FOUND = "not_found"            # no such model, version or sequence
    CONFLICT = "conflict"              # a stored sequence state that does not fit the engine
    TOO_LARGE = "too_large"            # over a size bound, before it is read
    TIMEOUT = "timeout"                # the request did not arrive in time
    UNSUPPORTED_MEDIA = "unsupported_media"  # a content type `kiln dev` does not take
    OVERLOADED = "overloaded"          # full: come back after Retry-After
    UNAVAILABLE = "unavailable"        # not ready, draining, a store that does not answer
    FAILED = "failed"                  # the engine (or the server) failed


# Each kind's HTTP status: the REST doors' one table (gRPC's: grpc.endpoint.CODES).
HTTP_STATUS = {Kind.INVALID: 400, Kind.REFUSED: 400, Kind.NOT_FOUND: 404, Kind.TIMEOUT: 408,
               Kind.CONFLICT: 409, Kind.TOO_LARGE: 413, Kind.UNSUPPORTED_MEDIA: 415, Kind.OVERLOADED: 429,
               Kind.FAILED: 500, Kind.UNAVAILABLE: 503}


# kiln_requests_total's outcome for each kind.
# "refused" is apart from "bad_request": an input the engine refuses may be the version's fault
# (the stable version answers it), and the canary analysis compares the tracks' shares of both.
OUTCOME = {Kind.INVALID: "bad_request", Kind.REFUSED: "refused", Kind.NOT_FOUND: "bad_request",
           Kind.CONFLICT: "bad_request",
           Kind.TOO_LARGE: "bad_request", Kind.TIMEOUT: "bad_request",
           Kind.UNSUPPORTED_MEDIA: "bad_request", Kind.OVERLOADED: "overloaded",
           Kind.UNAVAILABLE: "unavailable", Kind.FAILED: "error"}


class Refusal(Exception):
    """A request the dataplane refuses: its kind, a message, and Retry-After seconds when
    waiting can help."""

    def __init__(self, kind: Kind, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after = retry_after

    def __reduce__(self):  # raised in a decoding worker process, re-raised here
        return type(self), (self.kind, self.message, self.retry_after)


class ModelUnavailable(Refusal):
    """A model that cannot answer now (loading, failed, unhealthy, stopping, or the server
    draining): beside the message, its name and state (REST answers them in the body)."""

    def __init__(self, model: str, state: str, message: str, retry_after: float | None = None):
        super().__init__(Kind.UNAVAILABLE, message, retry_after)
        self.model = model
        self.state = state

    def __reduce__(self):
        return type(self), (self.model, self.state, self.message, self.retry_after)


def internal_error(log: logging.Logger, what: str) -> Refusal:
    """An unexpected failure (a bug), called in its `except` block: logged with its
    traceback under a new request id, and answered as FAILED with that id, never with the
    exception's text (which may hold paths, a peer's bytes, or internals)."""
    request_id = secrets.token_hex(8)
    log.exception("%s failed unexpectedly (request id %s)", what, request_id)
    return Refusal(Kind.FAILED, f"internal error (request id {request_id}); "
                                f"the server's log has the details")


def invalid(message: str) -> Refusal:
    return Refusal(Kind.INVALID, message)


def cut(message: str) -> str:
    """An error message as answered: what a client sent is never echoed back whole."""
    if len(message) > _MAX_ERROR_CHARS:
        message = message[:_MAX_ERROR_CHARS - 1] + "…"
    return message


def overloaded(model: str, why: str, retry_after: float) -> Refusal:
    return Refusal(Kind.OVERLOADED, f"model '{model}' is overloaded: {why}", retry_after)


def scheduler_refusal(model: str, e: Exception) -> Refusal:
    """A scheduler's refusal (raised by `model`'s scheduler, or by the engine process's
    for a front end) as the Refusal every door answers."""
    if isinstance(e, InputsRefused):
        return Refusal(Kind.REFUSED, str(e))
    if isinstance(e, InvalidBatch):
        return Refusal(Kind.INVALID, str(e))
    if isinstance(e, ShuttingDown):
        return Refusal(Kind.UNAVAILABLE, str(e), e.retry_after)
    if isinstance(e, Overloaded):
        return overloaded(model, str(e), e.retry_after)
    if isinstance(e, ExecutionFailed):
        return Refusal(Kind.FAILED, f"inference failed: {e}")
    raise TypeError(f"not a scheduler refusal: {e!r}")
