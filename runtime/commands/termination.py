"""What a Job's command leaves for the operator: progress lines on stderr, and its result as
JSON in the termination log, which Kubernetes keeps only up to 4 KiB (`kiln build`,
`kiln cache-gc`)."""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from kiln.runtime.api.contract import TERMINATION_LOG as DEFAULT_TERMINATION_LOG

TERMINATION_LOG_LIMIT = 4096  # Kubernetes keeps at most 4 KiB of a termination message


def stderr_logger(command: str) -> Callable[[str], None]:
    """A log function printing `<UTC time> kiln <command>: <message>` lines on stderr."""
    def log(message: str) -> None:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        print(f"{now[:-4]}Z kiln {command}: {message}", file=sys.stderr, flush=True)
    return log


def termination_log(path: str | None) -> Path | None:
    """The path given, else the pod's termination log when writable (None outside a pod)."""
    if path:
        return Path(path)
    default = Path(DEFAULT_TERMINATION_LOG)
    return default if os.access(default, os.W_OK) else None


def result_json(result: dict[str, Any]) -> str:
    """The termination message, its "message" shortened to fit Kubernetes' 4 KiB."""
    text = json.dumps(result, separators=(",", ":"))
    while len(text.encode()) > TERMINATION_LOG_LIMIT and result.get("message"):
        message = result["message"]
        result = {**result, "message": message[: max(0, len(message) - 256)] + "…"}
        if len(result["message"]) <= 1:
            result["message"] = ""
        text = json.dumps(result, separators=(",", ":"))
    return text


def write_result(path: Path | None, result: dict[str, Any], log: Callable[[str], None]) -> None:
    write_message(path, result_json(result), log)


def write_message(path: Path | None, text: str, log: Callable[[str], None]) -> None:
    """Write the termination message (already within the limit); a failure is logged."""
    if path is None:
        return
    try:
        path.write_text(text)
    except OSError as e:
        log(f"cannot write the termination log {path}: {e}")
