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


class UnreadableFile(ValueError):
    """A local file that cannot be read within its bounds, with the reason for people."""


def read_bounded(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """The bytes of the regular file `path`, at most `limit`; UnreadableFile naming `what`
    and the reason otherwise (no such file, not a regular file, unreadable, too large)."""
    name = f"{what} {os.fspath(path)}"
    try:
        with open_regular(path) as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise UnreadableFile(f"{name} does not exist") from None
    except NotARegularFile as e:
        raise UnreadableFile(f"{what}: {e}") from None
    except OSError as e:
        raise UnreadableFile(f"{name} cannot be read: {e.strerror or e}") from None
    if len(data) > limit:
        raise UnreadableFile(f"{name} is larger than {limit} bytes, the limit for it")
    return data


def read_json(path: str | os.PathLike, limit: int, what: str) -> object:
    """The JSON document in the regular file `path`, of at most `limit` bytes of UTF-8.

    Raises UnreadableFile naming `what` ("the request file") and the reason: no such file,
    not a regular file (a FIFO would block, /dev/zero never ends), too large, not UTF-8,
    not JSON, nested too deep or a number too long for Python's int."""
    import json

    name = f"{what} {os.fspath(path)}"
    data = read_bounded(path, limit, what)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UnreadableFile(f"{name} is not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise UnreadableFile(f"{name} is not valid JSON: {e}") from None
    except RecursionError:
        raise UnreadableFile(f"{name} nests too deeply to be a JSON document Kiln reads") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise UnreadableFile(f"{name} is refused: {e}") from None
