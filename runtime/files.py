"""Writing whole files safely: exclusive temporaries with unpredictable names, fsync, atomic rename.

Every file the runtime writes in one piece (checkpoint shards, their side files and manifests,
a converted state_dict) goes through `atomic_file` (a file object, e.g. for torch.save) or
`write_atomic` (bytes):

1. The temporary is created by tempfile.mkstemp in the target's own directory (so the rename
   stays on one file system): a random name (".NAME.XXXXXXXX.tmp"), opened
   O_CREAT | O_EXCL | O_NOFOLLOW. Whatever is planted in the directory (a symlink at a name we
   might pick, a file we did not create) is never opened or written through: an existing name
   makes mkstemp draw another. The file gets the mode `open` would give it (0666 less the umask).
2. The data is flushed and fsync'ed, the temporary is renamed over the target with os.replace
   (atomic on POSIX: a reader sees the old file or the new one, never a mix; a symlink at the
   target is replaced, not followed), and the directory is fsync'ed so the rename itself is on disk.
3. On any error the temporary is removed (a full disk does not stay full of our partial files)
   and an OSError is re-raised as WriteError, a ValueError whose message names the path and the
   cause ("disk full", "file too large", "permission denied", ...).
"""

from __future__ import annotations

import errno
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

# errno -> (what happened, what to do), for the messages of WriteError.
_CAUSES = {
    errno.ENOSPC: ("disk full", "free space on its file system or write somewhere else"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota or write somewhere else"),
    errno.EFBIG: ("file too large (over the file-size limit, see ulimit -f)",
                  "raise the limit or write somewhere else"),
    errno.EACCES: ("permission denied", "write into a directory you may write to"),
    errno.EPERM: ("operation not permitted", "write into a directory you may write to"),
    errno.EROFS: ("read-only file system", "write somewhere else"),
    errno.ENOENT: ("its directory does not exist", "create the directory first"),
    errno.EISDIR: ("it is a directory", "give a file name"),
    errno.ENOTDIR: ("a part of the path is not a directory", "give a path through directories"),
    errno.ELOOP: ("it is a symbolic link, which is never followed", "remove the link"),
    errno.EIO: ("input/output error", "check the disk"),
}


class WriteError(ValueError):
    """A file could not be written; the message names the path, the cause and what to do.

    `errno` is the OSError's errno (errno.ENOSPC for a full disk), None if unknown.
    """

    def __init__(self, path: str | os.PathLike, err: OSError):
        self.path = Path(path)
        self.errno = err.errno
        cause, todo = _CAUSES.get(err.errno, (err.strerror or str(err), "check the path and the disk"))
        code = errno.errorcode.get(err.errno, "") if err.errno is not None else ""
        super().__init__(f"cannot write {self.path}: {cause}" + (f" ({code})" if code else "") + f"; {todo}")


def _file_mode() -> int:
    """The mode a plain open() would create a file with: 0666 less this process's umask.

    Read from /proc (Linux) because os.umask can only be read by setting it, which would race
    with other threads creating files.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o644


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make the directory's entries (a rename into it) durable.

    File systems that cannot fsync a directory (EINVAL) are accepted as they are.
    """
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise WriteError(directory, e) from e
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise WriteError(directory, e) from e
    finally:
        os.close(fd)


def make_dirs(directory: str | os.PathLike) -> Path:
    """`directory` and its parents, created if missing; WriteError names it if that fails."""
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WriteError(d, e) from e
    return d


# How often a shared directory removed under us is made again (see _temporary).
_DIRECTORY_ATTEMPTS = 3


def _temporary(path: Path, make_parent: bool) -> tuple[int, str]:
    """An exclusive temporary next to `path`: (fd, its name); with `make_parent` its directory is made too.

    Why the retry: processes that write into one directory (the ranks of a checkpoint) each
    remove it when they leave it empty after an error, so a peer's clean-up can remove the
    directory between our mkdir and our mkstemp. Once our temporary is in it, no peer's rmdir
    succeeds, so a few attempts are enough.
    """
    attempts_left = _DIRECTORY_ATTEMPTS if make_parent else 1
    while True:
        attempts_left -= 1
        if make_parent:
            make_dirs(path.parent)
        try:
            return tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        except OSError as e:
            if not (isinstance(e, FileNotFoundError) and attempts_left > 0):
                raise WriteError(path, e) from e


@contextmanager
def atomic_file(path: str | os.PathLike, *, make_parent: bool = False) -> Iterator[BinaryIO]:
    """A binary file object whose content replaces `path` atomically when the block ends without error.

    With `make_parent` the directory of `path` is created if missing (again if another process
    removes it before our temporary is in it). On an error inside the block or while finishing,
    the temporary is removed and the target is left as it was; OSErrors come out as WriteError
    naming `path`.
    """
    path = Path(path)
    fd, tmp = _temporary(path, make_parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(fd, _file_mode())
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        _remove(tmp)
        if isinstance(e, OSError):
            raise WriteError(path, e) from e
        raise
    fsync_dir(path.parent)


def write_atomic(path: str | os.PathLike, data: bytes, *, interrupt: Callable[[], None] | None = None,
                 make_parent: bool = False) -> None:
    """Write `data` to `path` so that `path` holds either its old content or all of `data`.

    `make_parent`: create the directory of `path` if missing (see atomic_file).

    `interrupt` (fault injection for tests) is called when half of the data is on disk; whatever it
    raises is handled as an error of the write (an OSError(ENOSPC) there is a disk that filled up).
    """
    with atomic_file(path, make_parent=make_parent) as f:
        half = len(data) // 2
        f.write(data[:half])
        if interrupt is not None:
            f.flush()
            os.fsync(f.fileno())
            interrupt()
        f.write(data[half:])
