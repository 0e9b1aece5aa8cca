"""Where the Tinker service keeps training runs and checkpoints across restarts.

A directory holds `tinker.db` (SQLite: one row per training run, one per checkpoint)
and `checkpoints/RUN/weights/NAME` (a training state: adapter and AdamW moments) or
`checkpoints/RUN/sampler_weights/NAME` (a PEFT adapter directory: what a sampler, or
transformers/PEFT and vLLM, load). A checkpoint directory is written atomically before
its row is added, so a crash leaves either both or neither.

Paths are the SDK's: `tinker://RUN/weights/NAME`, `tinker://RUN/sampler_weights/NAME`.
"""

import json
import os
import re
import shutil
import sqlite3
import threading
import time

from .tinker_wire import BadRequest

KINDS = {"weights": "training", "sampler_weights": "sampler"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def parse_path(path: str) -> tuple[str, str, str]:
    """`(run, kind, name)` of `tinker://RUN/KIND/NAME`; `BadRequest` naming what is wrong."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise BadRequest(f"checkpoint path {path!r} must look like tinker://RUN/weights/NAME "
                         "or tinker://RUN/sampler_weights/NAME")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not _NAME.match(parts[2]):
        raise BadRequest(f"checkpoint path {path!r} must look like tinker://RUN/weights/NAME "
                         "or tinker://RUN/sampler_weights/NAME (NAME: letters, digits, '.', '_', '-')")
    return parts[0], parts[1], parts[2]


def check_name(name: str) -> str:
    if not _NAME.match(name or ""):
        raise BadRequest(f"checkpoint name {name!r}: use 1-128 letters, digits, '.', '_', '-' (not starting with "
                         "'.', '_' or '-')")
    return name


class CheckpointStore:
    """Training runs and checkpoints under `root` (created if missing); thread-safe."""

    def __init__(self, root: str | os.PathLike):
        self.root = os.fspath(root)
        os.makedirs(os.path.join(self.root, "checkpoints"), exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(os.path.join(self.root, "tinker.db"), check_same_thread=False)
        with self._lock, self._db:
            self._db.execute("CREATE TABLE IF NOT EXISTS runs (run TEXT PRIMARY KEY, info TEXT NOT NULL, "
                             "created REAL NOT NULL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS checkpoints (run TEXT NOT NULL, kind TEXT NOT NULL, "
                             "name TEXT NOT NULL, created REAL NOT NULL, size INTEGER NOT NULL, info TEXT NOT NULL, "
                             "PRIMARY KEY (run, kind, name))")

    # -- runs ------------------------------------------------------------------------------

    def add_run(self, run: str, info: dict) -> None:
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO runs VALUES (?, ?, ?)", (run, json.dumps(info), time.time()))

    def run(self, run: str) -> dict | None:
        with self._lock:
            row = self._db.execute("SELECT info, created FROM runs WHERE run = ?", (run,)).fetchone()
        return None if row is None else {**json.loads(row[0]), "created": row[1]}

    def runs(self) -> list[tuple[str, dict]]:
        with self._lock:
            rows = self._db.execute("SELECT run, info, created FROM runs ORDER BY created").fetchall()
        return [(r, {**json.loads(i), "created": c}) for r, i, c in rows]

    # -- checkpoints -----------------------------------------------------------------------

    def directory(self, run: str, kind: str, name: str) -> str:
        return os.path.join(self.root, "checkpoints", run, kind, name)

    def add(self, run: str, kind: str, name: str, info: dict) -> None:
        """Record the checkpoint whose directory was just written."""
        directory = self.directory(run, kind, name)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(directory) for f in fs)
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?)",
                             (run, kind, name, time.time(), size, json.dumps(info)))

    def get(self, path: str) -> dict:
        """The checkpoint at `path` (`BadRequest` if there is none)."""
        run, kind, name = parse_path(path)
        with self._lock:
            row = self._db.execute("SELECT created, size, info FROM checkpoints "
                                   "WHERE run = ? AND kind = ? AND name = ?", (run, kind, name)).fetchone()
        if row is None or not os.path.isdir(self.directory(run, kind, name)):
            raise BadRequest(f"no checkpoint at {path}")
        return self._entry(run, kind, name, *row)

    def exists(self, run: str, kind: str, name: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM checkpoints WHERE run = ? AND kind = ? AND name = ?",
                                    (run, kind, name)).fetchone() is not None

    def list(self, run: str | None = None) -> list[dict]:
        query = "SELECT run, kind, name, created, size, info FROM checkpoints"
        with self._lock:
            rows = (self._db.execute(query + " ORDER BY created").fetchall() if run is None else
                    self._db.execute(query + " WHERE run = ? ORDER BY created", (run,)).fetchall())
        return [self._entry(*row) for row in rows]

    def delete(self, path: str) -> None:
        entry = self.get(path)
        with self._lock, self._db:
            self._db.execute("DELETE FROM checkpoints WHERE run = ? AND kind = ? AND name = ?",
                             (entry["run"], entry["kind"], entry["name"]))
        shutil.rmtree(entry["directory"], ignore_errors=True)

    def _entry(self, run: str, kind: str, name: str, created: float, size: int, info: str) -> dict:
        return dict(run=run, kind=kind, name=name, created=created, size=size, info=json.loads(info),
                    path=f"tinker://{run}/{kind}/{name}", directory=self.directory(run, kind, name))
