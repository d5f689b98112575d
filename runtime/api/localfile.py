"""Open a local file only when it is a regular file.

Every local read of Kiln (a model on a pvc:// volume or `kiln dev`'s file://, a manifest)
goes through `open_regular`: a FIFO would block the reader forever, /dev/zero never ends,
and a directory or a device is no model or manifest.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


class NotARegularFile(ValueError):
    """The path names something other than a regular file."""


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """`path` opened for binary reading (symlinks followed).

    Raises NotARegularFile for a directory, FIFO, device or socket, and OSError
    (FileNotFoundError, PermissionError, ...) as open() does.
    """
    # O_NONBLOCK: opening a FIFO that has no writer returns at once instead of waiting.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            raise NotARegularFile(f"{os.fspath(path)} is {kind}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
