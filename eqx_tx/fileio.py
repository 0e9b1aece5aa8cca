"""Atomic directory writes: build in a temporary sibling, then swap it in."""

import contextlib
import os
import shutil
import tempfile


def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_text_durably(path: str, text: str) -> None:
    """Write `text` to `path` and fsync it before returning."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_directory(directory: str | os.PathLike):
    """Yield a temporary directory that replaces `directory` only if the block succeeds.

    The temporary directory is a sibling (same filesystem), its files are fsynced,
    and the swap is two renames: the old directory aside, the new one in place; the
    old one is deleted last. A crash before the swap leaves the previous directory
    untouched (plus a `.tmp-` sibling); between the two renames the previous version
    survives as `<name>.old-<pid>`.
    """
    directory = os.path.abspath(os.fspath(directory))
    parent, name = os.path.split(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        yield tmp
        for entry in os.scandir(tmp):
            if entry.is_file():
                fsync_file(entry.path)
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.exists(directory):
        old = f"{directory}.old-{os.getpid()}"
        os.rename(directory, old)
    os.rename(tmp, directory)
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def barrier(name: str) -> None:
    """Wait for every process of a multi-host run (no-op with one process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
