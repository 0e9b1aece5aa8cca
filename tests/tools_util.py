"""Helpers for the tests of `tools/`: import a script as a module, build its arguments, write a dataset."""

import dataclasses
import fcntl
import importlib.util
import json
import os
import socket
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tests compile hundreds of small programs and run each a few times: XLA:CPU's LLVM
# backend at -O0 compiles them about a third faster (the same HLO). The benchmarks keep
# the default level. Subprocesses of the tests take it too.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def shared_run(tmp_path_factory, worker_id, name: str, build) -> str:
    """`build(directory)` run once per test session, its `final` HF directory returned
    (read-only): xdist workers share it (the first to need it builds it under a lock,
    the others wait for it or find it)."""
    root = tmp_path_factory.getbasetemp()
    root = root if worker_id == "master" else root.parent  # the session's directory, shared by its workers
    out = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "final" / "model.safetensors").is_file():  # a worker that failed half-way left no final model
            build(out)
    return str(out / "final")


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_tool", os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tool_args(train_tool, *, steps: int, micro_batches: int = 1, **fields):
    """`tools/train.py`'s `Args` for a run of `steps` steps (its default optimizer
    otherwise) split into `micro_batches`, with `fields` set."""
    default = train_tool.DEFAULT_TRAIN
    train = dataclasses.replace(default, micro_batches=micro_batches,
                                optimizer=dataclasses.replace(default.optimizer, total_steps=steps))
    return train_tool.Args(train=train, **fields)


def write_token_ids(path, *, rows: int, max_len: int, vocab: int = 97, seed: int = 0) -> str:
    """A jsonl of `rows` random `input_ids` sequences of 5 to `max_len - 1` tokens."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"input_ids": rng.integers(0, vocab, size=int(rng.integers(5, max_len))).tolist()}) + "\n")
    return str(path)


class Loopback:
    """`app` served by uvicorn in a thread on a free port of 127.0.0.1 (`url`), until `stop()`."""

    def __init__(self, app):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()
