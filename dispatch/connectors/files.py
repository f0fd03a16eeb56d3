"""The files a file connector commits through: the CSV state file and the Parquet
manifest. Both are opened without following links, replaced atomically (write, fsync,
rename, fsync the directory) and written under a lock file that is never replaced (`flock`
on a file that is renamed over would let two writers hold "the" lock), waited for with a
bound."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator

from dispatch.connectors.base import PermanentError, TransientError

# How long a commit waits for another writer of the same file to finish its own.
LOCK_WAIT_SECONDS = 10.0


def open_no_follow(path: str, flags: int, what: str) -> int:
    """`os.open` that refuses a symlink and a file with more than one hard link (neither
    carries a path the base-directory check saw); `what` names the file in errors."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermanentError(f"{what} is a symlink; it is not followed") from None
        raise PermanentError(f"cannot open {what}: {exc.strerror}") from None
    if os.fstat(fd).st_nlink > 1:
        os.close(fd)
        raise PermanentError(f"{what} has more than one hard link; it is not used")
    return fd


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(path: str, data: bytes, *, prefix: str, suffix: str) -> None:
    """Make `path` hold `data` in one step: a temporary file of the same directory (named
    `prefix...suffix`), fsynced, renamed over `path`, then the directory fsynced."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=suffix)
    try:
        with open(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


@contextlib.contextmanager
def commit_lock(path: str, what: str, name: str) -> Iterator[None]:
    """Hold the lock file at `path` (created if missing, `what` in errors), waiting at most
    LOCK_WAIT_SECONDS: a writer that holds it longer is another attempt's commit, and this
    one is retried (TransientError naming `name`)."""
    fd = open_no_follow(path, os.O_RDWR | os.O_CREAT, what)
    try:
        waited_until = time.monotonic() + LOCK_WAIT_SECONDS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= waited_until:
                    raise TransientError(
                        f"another commit to {name!r} held its lock for {LOCK_WAIT_SECONDS:.0f}s"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock
