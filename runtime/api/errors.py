"""Typed failures of `kiln build` and `kiln serve`, each with the exit code and reason their
pod reports.

The operator reads the reason from the Job's termination message and turns it into a
condition on the InferenceModel, so the set of reasons is part of the contract:

    exit  reason             meaning
    1     BuildFailed        any other failure (the backend's builder refused, ...)
    2     BadRequest         the request is malformed or names inputs the model lacks
    3     SourceUnreachable  the model URI could not be read (network, missing file, too big)
    4     DigestMismatch     the model file's sha256 differs from the pinned one
    5     InvalidModel       the file is not a valid ONNX model
    6     Unsupported        the backend or precision cannot work here
    7     OutOfDisk          no space left while downloading or publishing
    8     KeyMismatch        the request's engine key is not what this builder computes

`kiln serve` exits with its own code for a model that can never become Ready, and writes
`<reason>: <message>` (one line) to its termination log; the operator reads it from the
runtime pod's container status:

    exit  reason             meaning
    9     WarmupFailed       a sample request of spec.runtime.warmup failed or answered
                             other than expected (or the samples could not be read)
"""

from __future__ import annotations


class BuildError(Exception):
    """A build failure a person can act on; `exit_code` and `reason` go to the Job."""

    exit_code = 1
    reason = "BuildFailed"


class BadRequest(BuildError):
    exit_code = 2
    reason = "BadRequest"


class SourceUnreachable(BuildError):
    exit_code = 3
    reason = "SourceUnreachable"


class DigestMismatch(BuildError):
    exit_code = 4
    reason = "DigestMismatch"


class InvalidModel(BuildError):
    exit_code = 5
    reason = "InvalidModel"


class Unsupported(BuildError):
    exit_code = 6
    reason = "Unsupported"


class OutOfDisk(BuildError):
    exit_code = 7
    reason = "OutOfDisk"


class KeyMismatch(BuildError):
    exit_code = 8
    reason = "KeyMismatch"


class ServeError(Exception):
    """A `kiln serve` failure that no restart can mend; `exit_code` and `reason` go to the pod."""

    exit_code = 1
    reason = "ServeFailed"

    def termination_message(self) -> str:
        """`<reason>: <message>` on one line, as the operator reads it."""
        return f"{self.reason}: {' '.join(str(self).split())}"


class WarmupFailed(ServeError):
    exit_code = 9
    reason = "WarmupFailed"


# The tables above, as the operator reads a build pod's or a runtime pod's exit code.
EXIT_REASONS: dict[int, str] = {c.exit_code: c.reason for c in (
    BuildError, BadRequest, SourceUnreachable, DigestMismatch, InvalidModel, Unsupported, OutOfDisk, KeyMismatch)}
SERVE_EXIT_REASONS: dict[int, str] = {c.exit_code: c.reason for c in (WarmupFailed,)}
