"""Helpers for the tests of `tools/`: import a script as a module, write a dataset."""

import importlib.util
import json
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_tool", os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_token_ids(path, *, rows: int, max_len: int, vocab: int = 97, seed: int = 0) -> str:
    """A jsonl of `rows` random `input_ids` sequences of 5 to `max_len - 1` tokens."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"input_ids": rng.integers(0, vocab, size=int(rng.integers(5, max_len))).tolist()}) + "\n")
    return str(path)
