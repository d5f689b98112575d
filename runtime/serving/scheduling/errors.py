"""The errors a request can get from the scheduler, and what each transport answers:
`InvalidBatch` -> 400 (`InputsRefused`, its kind: the engine refusing a request's inputs,
which never counts toward the replica's health but is counted apart, outcome "refused"), `Overloaded` -> 429 with Retry-After (`ShuttingDown`, a subclass, while
draining), `ExecutionFailed` -> 500."""

from __future__ import annotations


class SchedulerError(Exception):
    """Base of the errors a request can get from the scheduler."""


class Overloaded(SchedulerError):
    """The queue is full: answer 429 and ask the client to come back after `retry_after` s."""

    def __init__(self, retry_after: float, message: str | None = None):
        self.retry_after = retry_after
        super().__init__(message or f"too many requests waiting; retry after {retry_after:.3f} s")

    def __reduce__(self):  # raised in the engine process, re-raised in a front end
        return type(self), (self.retry_after, str(self))


class ShuttingDown(Overloaded):
    """The scheduler is draining for shutdown; another replica should take the request."""


class InvalidBatch(SchedulerError):
    """The request's own batch cannot run: answer 400."""


class InputsRefused(InvalidBatch):
    """The engine refused the request's inputs (ONNX Runtime's INVALID_ARGUMENT, such as an
    index outside an embedding): answer 400. Whose mistake that is the engine cannot say (the
    same input may be answered by the stable version), so it is counted apart from requests
    malformed on arrival."""


class ExecutionFailed(SchedulerError):
    """The engine failed on the request's batch (after retries): answer 500."""
