"""Store faults in plain words: an ``OSError`` or a TensorStore I/O error met while a harvest
reads or writes its store becomes one :class:`~hookax._util.errors.StoreError` that names the
store, the cause, the batch reached and what was kept.

Only errors of store operations come here (the model's own exceptions never do), so every
``OSError`` is a store fault; TensorStore reports its I/O failures as ``ValueError`` whose text
starts with a status code (``PERMISSION_DENIED: Error writing local file ...``).

Examples:
  >>> e = fault("acts", NotADirectoryError(20, "Not a directory", "acts/progress"), 3, 3)
  >>> print(e)  # doctest: +NORMALIZE_WHITESPACE
  hx.harvest: cannot write the store 'acts' at batch 3: a part of its path is a file, not a
  folder (was the store's folder moved or replaced by a file?) [NotADirectoryError: [Errno 20]
  Not a directory: 'acts/progress']. The 3 batches committed before are kept. Fix: put the
  store's folder back at store='acts', then run again with the same arguments: it resumes at
  batch 3.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .._util.errors import HookaxError, StoreError

__all__ = ["fault", "is_fault", "store_faults"]

# the causes, in plain words, and what fixes them
_CAUSES: dict[int, tuple[str, str]] = {
    errno.ENOTDIR: (
        "a part of its path is a file, not a folder (was the store's folder moved or "
        "replaced by a file?)",
        "put the store's folder back at store={path!r}",
    ),
    errno.ENOENT: (
        "a file or folder of the store is missing (was the store moved or deleted?)",
        "put the store's folder back at store={path!r}",
    ),
    errno.EACCES: (
        "permission denied: this location is not writable",
        "make it writable (chmod u+w) or move the store to a writable place",
    ),
    errno.EPERM: (
        "the operation is not permitted at this location",
        "make it writable or move the store to a writable place",
    ),
    errno.EROFS: (
        "the file system is read-only",
        "move the store to a writable file system",
    ),
    errno.ENOSPC: ("the disk is full", "free disk space"),
    errno.EDQUOT: ("the disk quota is used up", "free disk space or raise the quota"),
    errno.EIO: ("the disk reported an input/output error", "check the disk"),
    errno.EISDIR: (
        "a folder stands where the store keeps a file",
        "remove what was put into the store's folder",
    ),
}
# before anything is written (the path was checked): the cause and fix for the path as it is
_BEFORE: dict[int, tuple[str, str]] = {
    errno.ENOTDIR: ("a part of its path is a file, not a folder", "move that file away"),
    errno.EACCES: (
        "permission denied: this location is not writable",
        "make the folder writable (chmod u+w)",
    ),
    errno.EROFS: ("the file system is read-only", "choose a writable file system"),
}
_STATUS = re.compile(
    r"^(PERMISSION_DENIED|NOT_FOUND|FAILED_PRECONDITION|RESOURCE_EXHAUSTED|UNKNOWN|DATA_LOSS|"
    r"INTERNAL|ABORTED|ALREADY_EXISTS|UNAVAILABLE|OUT_OF_RANGE|INVALID_ARGUMENT): "
)
_BY_STATUS = {
    "NOT_FOUND": errno.ENOENT,
    "PERMISSION_DENIED": errno.EACCES,
    "RESOURCE_EXHAUSTED": errno.ENOSPC,
}
_OS_CODE = re.compile(r"\[os_error_code='?(\d+)'?\]")


def is_fault(e: BaseException) -> bool:
    """Whether ``e``, raised by a store operation, is an I/O fault of the store."""
    if isinstance(e, HookaxError):
        return False
    return isinstance(e, OSError) or (isinstance(e, ValueError) and bool(_STATUS.match(str(e))))


def _errno(e: BaseException) -> int | None:
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno
    text = str(e)
    if m := _OS_CODE.search(text):
        return int(m.group(1))
    for code in _CAUSES:  # TensorStore names some errors only by the system's words
        if os.strerror(code) in text:
            return code
    if m := _STATUS.match(text):
        return _BY_STATUS.get(m.group(1))
    return None


def _os_error(e: BaseException) -> str:
    """The error as the system gave it, on one line (TensorStore's spec left out)."""
    text = str(e).split(" [tensorstore_spec=")[0]
    text = _OS_CODE.sub("", text).strip()
    return f"{type(e).__name__}: {' '.join(text.split())}"


def fault(
    path: str | Path, e: BaseException, batch: int, committed: int | None, *, before: bool = False
) -> StoreError:
    """The :class:`StoreError` for ``e``, met at ``batch`` with ``committed`` batches committed
    (None: not known, the store could not be read); ``before``: before anything was written
    (a check of the path)."""
    code = _errno(e)
    default = ("it could not be read or written", "remove the cause")
    cause, fix = (_BEFORE if before and code in _BEFORE else _CAUSES).get(code or -1, default)
    path = str(path)
    fix = fix.format(path=path)
    head = f"hx.harvest: cannot write the store {path!r}"
    if before:
        return StoreError(
            f"{head}: {cause} [{_os_error(e)}]. Nothing was written. Fix: {fix}, or give "
            f"another store=PATH."
        )
    if committed is None:
        kept, resumes = "Every batch committed before is kept.", "after the last committed batch"
    elif committed == 0:
        kept, resumes = "No batch was committed yet.", "at batch 0"
    else:
        many = committed > 1
        batches, are = ("batches", "are") if many else ("batch", "is")
        kept = f"The {committed} {batches} committed before {are} kept."
        resumes = f"at batch {committed}"
    return StoreError(
        f"{head} at batch {batch}: {cause} [{_os_error(e)}]. {kept} Fix: {fix}, then run "
        f"again with the same arguments: it resumes {resumes}."
    )


@contextmanager
def store_faults(path: str | Path, batch: int, committed: int | None) -> Iterator[None]:
    """Raise a store fault met inside as a :class:`StoreError` (other errors unchanged)."""
    try:
        yield
    except Exception as e:
        if is_fault(e):
            raise fault(path, e, batch, committed) from e
        raise
