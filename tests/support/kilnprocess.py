"""`kiln` as a subprocess whose output (stdout and the stderr log) is collected as it
arrives, so a test can wait for a line (the runtime tests' `kiln_process` fixture, and
support.serving's ServeProcess)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

KILN = Path(sys.executable).parent / "kiln"


class KilnProcess:
    """A `kiln` subprocess whose output (stdout and the stderr log) is collected as it
    arrives, so a test can wait for a line."""

    def __init__(self, args: list[str], cwd: Path, command: tuple[str, ...] = (str(KILN),)):
        # One process unless a test asks for front-end workers (`--workers`): the default
        # follows the machine's CPUs, and the tests' expectations should not.
        env = {**os.environ, "KILN_WORKERS": os.environ.get("KILN_WORKERS", "1")}
        self.proc = subprocess.Popen([*command, *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def wait_for(self, pattern: str, timeout: float = 30) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            assert self.proc.poll() is None, "\n".join(self.lines)
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in the output:\n" + "\n".join(self.lines))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(15)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(5)
            self._reader.join(5)
