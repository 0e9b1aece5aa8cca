"""Multi-host: 2 processes x 4 CPU devices (gloo) against 1 process x 8 devices.

The real tools run as subprocesses: `tools/launch_local.py` starts the processes of a
multi-host run; a single-process run of the same global batch is the reference.
"""

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from eqx_tx.train.checkpoint import IncompleteCheckpointError, latest_checkpoint, read_metadata
from tests.tools_util import TEST_XLA_FLAGS, write_token_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")


def _env(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or k == "JAX_PLATFORMS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}")
    return env


def _single(tool, *args, env_extra=None):
    env = dict(_env(8), **(env_extra or {}))
    r = subprocess.run([sys.executable, os.path.join(TOOLS, tool), *args], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def _multi(tool, *args, env_extra=None, check=True):
    """`tool` (a script in tools/, or a path) over 2 processes x 4 devices."""
    env = dict(_env(4), **(env_extra or {}))
    cmd = [sys.executable, os.path.join(TOOLS, "launch_local.py"), "--num-processes", "2", "--devices-per-process", "4",
           "--", os.path.join(TOOLS, tool), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if check:
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    return r


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_token_ids(tmp_path_factory.mktemp("mh") / "ids.jsonl", rows=64, max_len=40)


def _train_args(ckpt, data, out, *extra):
    return ["--model", ckpt, "--data", data, "--seq-len", "16", "--batch-size", "8", "--learning-rate", "1e-2",
            "--total-steps", "6", "--save-every", "100", "--no-progress", "--output-dir", str(out), *extra]


def _state(out, step):
    directory = os.path.join(out, "checkpoint", f"step_{step:08d}")
    merged = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("shards-"):
            merged.update(load_file(os.path.join(directory, name)))
    return merged


def _assemble(pieces: dict) -> dict:
    """Stored shards (`name|box`) reassembled into whole arrays, whatever the layout."""
    from eqx_tx.train.checkpoint import _parse_box_key

    boxes = {}
    for key, value in pieces.items():
        name, box = _parse_box_key(key)
        boxes.setdefault(name, []).append((box, value))
    out = {}
    for name, parts in boxes.items():
        shape = [max(b[1] for b in [bx[d] for bx, _ in parts]) for d in range(len(parts[0][0]))]
        arr = np.zeros(shape, parts[0][1].dtype)
        for box, value in parts:
            arr[tuple(slice(a, b) for a, b in box)] = value
        out[name] = arr
    return out


def _assert_states_equal(a, b, atol=1e-5, rtol=1e-3):
    """Equal up to the order of the gradient sums: two processes all-reduce over gloo,
    one sums in its own order, and Adam's normalised steps can carry that last-bit
    difference to ~1e-5 (once 1.1e-5, 2.4e-4 relative, in one of 576 LoRA weights after
    3 steps); a wrong reduction would be off by O(1) relative."""
    a, b = _assemble(a), _assemble(b)
    assert a.keys() == b.keys() and len(a) > 10
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=atol, rtol=rtol, err_msg=k)


@pytest.fixture(scope="module")
def straight(checkpoints, data, tmp_path_factory):
    """The reference: one process, 8 devices (tp=2 x dp=4), 6 steps, full fine-tuning."""
    out = tmp_path_factory.mktemp("single") / "run"
    _single("train.py", *_train_args(checkpoints["mha_tied"], data, out, "--tp", "2", "--save-every", "3"))
    return out


def test_lora_dp8_two_processes_like_one(checkpoints, data, tmp_path):
    args = ["--lora-rank", "4", "--total-steps", "3"]
    _single("train.py", *_train_args(checkpoints["gqa_untied"], data, tmp_path / "one", *args))
    _multi("train.py", *_train_args(checkpoints["gqa_untied"], data, tmp_path / "two", *args))
    _assert_states_equal(_state(tmp_path / "two", 3), _state(tmp_path / "one", 3))
    a = load_file(str(tmp_path / "two" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "one" / "adapter" / "adapter_model.safetensors"))
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=1e-5, rtol=1e-3, err_msg=k)  # as `_assert_states_equal`


def test_two_processes_train_like_one_and_resume_across_process_counts(checkpoints, data, straight, tmp_path):
    """tp=2 x dp=4 over 2 processes: 3 steps by 2 processes then 3 by 1, and the
    reverse, both equal 6 steps of one process (so every multi-process step does)."""
    ckpt = checkpoints["mha_tied"]
    r = _multi("train.py", *_train_args(ckpt, data, tmp_path / "a", "--tp", "2", "--stop-after", "3"))
    assert "[0] stopped after step 3" in r.stdout and "[1] stopped" not in r.stdout  # process 0 reports
    assert sorted(os.listdir(tmp_path / "a" / "checkpoint" / "step_00000003")) == [
        "COMMITTED", "metadata.json", "shards-00000.safetensors", "shards-00001.safetensors"]
    assert read_metadata(tmp_path / "a" / "checkpoint")["processes"] == 2
    _single("train.py", *_train_args(ckpt, data, tmp_path / "a", "--tp", "2", "--resume"))
    _assert_states_equal(_state(tmp_path / "a", 6), _state(straight, 6))
    _single("train.py", *_train_args(ckpt, data, tmp_path / "b", "--tp", "2", "--stop-after", "3"))
    _multi("train.py", *_train_args(ckpt, data, tmp_path / "b", "--tp", "2", "--resume"))
    _assert_states_equal(_state(tmp_path / "b", 6), _state(straight, 6))
    # The HF export written by the two processes equals the single-process one.
    a, b = load_file(str(tmp_path / "b" / "final" / "model.safetensors")), load_file(str(straight / "final" / "model.safetensors"))
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=1e-5, err_msg=k)


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint(checkpoints, data, tmp_path):
    out = tmp_path / "killed"
    args = _train_args(checkpoints["mha_tied"], data, out, "--tp", "2", "--save-every", "2")
    # Process 1 dies after writing its shards of step 4, before the commit.
    r = _multi(os.path.join(ROOT, "tests", "kill_during_save.py"), *args, "--heartbeat-timeout", "5", check=False)
    assert r.returncode != 0
    root = out / "checkpoint"
    assert latest_checkpoint(root).endswith("step_00000002")  # the last complete save
    assert os.path.isfile(root / "step_00000004" / "shards-00001.safetensors")
    assert not os.path.exists(root / "step_00000004" / "COMMITTED")
    with pytest.raises(IncompleteCheckpointError, match="no COMMITTED marker"):
        latest_checkpoint(root / "step_00000004")
    # The previous checkpoint loads (here, into a one-process state).
    import eqx_tx
    from eqx_tx.train.checkpoint import restore_checkpoint
    from eqx_tx.train.training import OptimizerConfig, TrainConfig, init_train_state

    template = init_train_state(eqx_tx.load(checkpoints["mha_tied"], progress=False),
                                TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-2, total_steps=6)))
    state, meta = restore_checkpoint(root, template)
    assert int(state.step) == 2 and meta["data_position"] == 2


def test_generation_across_processes_equals_one(trained_tiny):
    args = ["--model", trained_tiny, "--prompt", "Once upon a time", "--prompt", "One day, Tom", "--prompt", "Mia",
            "--prompt", "The", "--max-new-tokens", "12", "--temperature", "0.9", "--seed", "3"]
    one = _single("sample.py", *args)
    two = _multi("sample.py", *args).stdout
    results = [line for line in one.splitlines() if line.startswith("--- [")]
    assert len(results) == 4
    for line in results:
        assert f"[0] {line}" in two  # process 0 prints every result, in the original order
    assert "[1] ---" not in two


def test_unreachable_coordinator_fails_fast_naming_the_address(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(_env(4), JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1")
    start = time.time()
    r = subprocess.run([sys.executable, os.path.join(TOOLS, "train.py"), "--initialization-timeout", "5",
                        "--output-dir", str(tmp_path / "x")], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 2
    assert f"could not join the run at coordinator 127.0.0.1:{port}" in r.stderr
    assert time.time() - start < 60
