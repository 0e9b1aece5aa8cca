"""Files on disk: atomic directory writes (build in a temporary sibling, then swap it
in) and safetensors files opened with errors that say what is wrong."""

import contextlib
import json
import os
import shutil
import tempfile

from safetensors import safe_open


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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def usual_modes(path: str) -> None:
    """Give `path` and what is below it the modes a plain `mkdir` / `open` would
    (`0o777` / `0o666` less the umask): temporary directories are created 0700 and
    safetensors writes its files 0600, which other users and containers cannot read."""
    mask = _umask()
    os.chmod(path, 0o777 & ~mask)
    for root, dirs, files in os.walk(path):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~mask)


@contextlib.contextmanager
def atomic_directory(directory: str | os.PathLike):
    """Yield a temporary directory that replaces `directory` only if the block succeeds.

    The temporary directory is a sibling (same filesystem), its files are fsynced,
    and the swap is two renames: the old directory aside, the new one in place; the
    old one is deleted last. A crash before the swap leaves the previous directory
    untouched (plus a `.tmp-` sibling); between the two renames the previous version
    survives as `<name>.old-<pid>`. The result has the usual modes (`usual_modes`).
    """
    directory = os.path.abspath(os.fspath(directory))
    parent, name = os.path.split(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        yield tmp
        usual_modes(tmp)
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


def _safetensors_problem(path: str) -> str | None:
    """What is wrong with the safetensors file at `path` (`None`: nothing found).

    The layout is an 8-byte little-endian header size, a JSON header with each
    tensor's `data_offsets`, then the data: the file must end where the last tensor does.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, too short for a safetensors header"
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            return f"its header claims {n} bytes but the file has only {size} (truncated, or not safetensors)"
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            return f"unreadable header ({type(e).__name__}: {e})"
    if 8 + n + end != size:
        return f"its tensors need {8 + n + end} bytes but the file has {size} (truncated or corrupt)"
    return None


def open_safetensors(path: str):
    """`safetensors.safe_open(path, framework="flax")`, after checking that the file is
    whole; a truncated or corrupt file raises `ValueError` naming it and the problem."""
    problem = _safetensors_problem(path)
    if problem is None:
        try:
            return safe_open(path, framework="flax")
        except Exception as e:  # safetensors raises its own error types
            problem = str(e)
    raise ValueError(f"{path}: not a valid safetensors file: {problem}")
