"""The errors a request can get from the scheduler, and what each transport answers:
`InvalidBatch` -> 400 (also the engine refusing a request's inputs, which never counts
toward health), `Overloaded` -> 429 with Retry-After (`ShuttingDown`, a subclass, while
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


class ExecutionFailed(SchedulerError):
    """The engine failed on the request's batch (after retries): answer 500."""
