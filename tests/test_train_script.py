"""tools/train.py: resume across processes, the default preset run, bad inputs."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from eqx_tx.train.checkpoint import read_metadata
from tests.tools_util import TEST_XLA_FLAGS, load_tool, tool_args, write_token_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "tools", "train.py")


def _train_module():
    return load_tool("train")


@pytest.fixture(scope="module")
def token_data(tmp_path_factory):
    return write_token_ids(tmp_path_factory.mktemp("data") / "ids.jsonl", rows=40, max_len=30)


def _run(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS=TEST_XLA_FLAGS)  # one CPU device
    result = subprocess.run([sys.executable, TRAIN, "--no-progress", *args], capture_output=True, text=True, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_resume_in_a_new_process_continues_exactly(checkpoints, token_data, tmp_path):
    common = ["--model", checkpoints["mha_tied"], "--data", token_data, "--seq-len", "16", "--batch-size", "4",
              "--total-steps", "10", "--learning-rate", "1e-2", "--save-every", "100"]
    _run(*common, "--output-dir", str(tmp_path / "straight"))
    out = _run(*common, "--output-dir", str(tmp_path / "split"), "--stop-after", "5")
    assert "stopped after step 5" in out
    assert read_metadata(tmp_path / "split" / "checkpoint")["data_position"] == 5
    out = _run(*common, "--output-dir", str(tmp_path / "split"), "--resume")
    assert "resumed from" in out and "at step 5" in out
    a = load_file(str(tmp_path / "straight" / "checkpoint" / "step_00000010" / "shards-00000.safetensors"))
    b = load_file(str(tmp_path / "split" / "checkpoint" / "step_00000010" / "shards-00000.safetensors"))
    assert a.keys() == b.keys() and len(a) > 10
    for key in a:
        np.testing.assert_allclose(a[key], b[key], atol=1e-6, err_msg=key)
    fa = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    fb = load_file(str(tmp_path / "split" / "final" / "model.safetensors"))
    for key in fa:
        np.testing.assert_allclose(fa[key], fb[key], atol=1e-6, err_msg=key)


def test_lora_run_exports_adapter_and_merged_model(checkpoints, token_data, tmp_path):
    out = _run("--model", checkpoints["gqa_untied"], "--data", token_data, "--seq-len", "16", "--batch-size", "4",
               "--total-steps", "4", "--lora-rank", "4", "--output-dir", str(tmp_path / "lora"))
    assert "adapter" in out
    assert os.path.isfile(tmp_path / "lora" / "adapter" / "adapter_model.safetensors")
    assert os.path.isfile(tmp_path / "lora" / "final" / "model.safetensors")


def test_default_preset_run_learns_and_saves_an_hf_checkpoint(trained_tiny):
    import torch

    import eqx_tx
    from tests.hf_utils import hf_logits

    final = trained_tiny
    assert os.path.isfile(os.path.join(final, "tokenizer.json"))
    model = eqx_tx.load(final, progress=False)
    ids = np.asarray([[5, 17, 33, 2, 90, 11]])
    np.testing.assert_allclose(np.asarray(eqx_tx.logits(model, ids)), hf_logits(final, ids), atol=1e-4)
    # It learned: the story opening is now far more likely than at random (ln 512 = 6.2 nats).
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(final, "tokenizer.json"))
    text = "Once upon a time, there was a little cat named Tom."
    ids = np.asarray([tok.encode(text).ids])
    logp = torch.log_softmax(torch.as_tensor(hf_logits(final, ids)), -1)[0, :-1]
    nll = -logp.gather(-1, torch.as_tensor(ids[0, 1:])[:, None]).mean().item()
    assert nll < 2.5, nll
    # It ships a chat format (plain text turns), so `tools/sample.py --chat` works on it,
    # and its files are readable by others (0644, not safetensors' 0600).
    chat = eqx_tx.load_tokenizer(final).encode_prompt([{"role": "user", "content": "Hi"}], chat=True)
    assert eqx_tx.load_tokenizer(final).decode(chat) == "User: Hi\n\nAssistant:"
    assert os.stat(os.path.join(final, "model.safetensors")).st_mode & 0o044 == 0o044
    # Its run wrote the per-step metrics and the loss curve.
    rows = [json.loads(line) for line in open(os.path.join(os.path.dirname(final), "metrics.jsonl"))]
    assert [r["step"] for r in rows] == list(range(len(rows))) and rows[-1]["loss"] < rows[0]["loss"]
    assert os.path.isfile(os.path.join(os.path.dirname(final), "loss.svg"))


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (dict(model="nonexistent-preset"), ValueError, "is not a preset"),
        (dict(seq_len=4096), ValueError, "--seq-len 4096 exceeds the model's max_position_embeddings 2048"),
        (dict(data="/no/such/file.jsonl"), FileNotFoundError, "dataset /no/such/file.jsonl does not exist"),
        (dict(data="EMPTY"), ValueError, "is empty"),
        (dict(data="LONG", packing="pad", long_sequences="error", seq_len=8), ValueError,
         "longer than seq_len\\+1 = 9 tokens"),
        (dict(batch_size=6, micro_batches=4), ValueError, "batch size 6 is not divisible by micro_batches=4"),
        (dict(lora_rank=-1), ValueError, "--lora-rank must be >= 0"),
        (dict(lora_rank=4, lora_alpha=0.0), ValueError, "--lora-alpha must be > 0"),
        (dict(output_dir="USED"), ValueError, "is not empty \\(final\\); pass --resume to continue the run there or "
         "--overwrite to replace it"),
        (dict(output_dir="USED", resume=True, overwrite=True), ValueError, "give one"),
        (dict(model="/no/such/dir/x"), ValueError, "is not a preset"),
    ],
)
def test_bad_inputs_have_clear_errors(tmp_path, overrides, error, message):
    train = _train_module()
    if overrides.get("data") == "EMPTY":
        (tmp_path / "empty.jsonl").write_text("\n")
        overrides["data"] = str(tmp_path / "empty.jsonl")
    if overrides.get("data") == "LONG":
        (tmp_path / "long.jsonl").write_text(json.dumps({"input_ids": list(range(20))}) + "\n")
        overrides["data"] = str(tmp_path / "long.jsonl")
    if overrides.get("output_dir") == "USED":
        (tmp_path / "used" / "final").mkdir(parents=True)
        overrides["output_dir"] = str(tmp_path / "used")
    overrides.setdefault("output_dir", str(tmp_path / "out"))
    args = tool_args(train, steps=1, progress=False, **overrides)
    with pytest.raises(error, match=message):
        train.main(args)


def test_long_sequences_are_truncated_in_pad_mode_by_default(tmp_path, capsys):
    train = _train_module()
    (tmp_path / "long.jsonl").write_text(json.dumps({"input_ids": list(range(20))}) + "\n")
    (tmp_path / "out" / "final").mkdir(parents=True)  # a previous run's, replaced with --overwrite
    (tmp_path / "out" / "final" / "stale.txt").write_text("old")
    train.main(tool_args(train, output_dir=str(tmp_path / "out"), data=str(tmp_path / "long.jsonl"), steps=1,
                         packing="pad", seq_len=8, batch_size=8, progress=False, overwrite=True))
    assert "truncated 1 document(s) longer than 9 tokens" in capsys.readouterr().out
    assert os.path.isfile(tmp_path / "out" / "final" / "model.safetensors")
    assert not os.path.exists(tmp_path / "out" / "final" / "stale.txt")


def _interrupt(args: list[str], sig: int, after_line: str) -> subprocess.CompletedProcess:
    """Start tools/train.py, send `sig` once it printed `after_line`, wait for it."""
    import signal as _signal  # noqa: F401  (the numbers come from the caller)
    import threading

    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS=TEST_XLA_FLAGS)
    process = subprocess.Popen([sys.executable, TRAIN, "--no-progress", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    out, err = [], []
    reader = threading.Thread(target=lambda: err.extend(process.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    assert process.stdout is not None
    for line in process.stdout:
        out.append(line)
        if line.startswith(after_line):
            process.send_signal(sig)
            break
    out.extend(process.stdout)
    process.wait(timeout=300)
    reader.join(timeout=10)
    return subprocess.CompletedProcess(process.args, process.returncode, "".join(out), "".join(err))


def test_sigint_and_sigterm_save_a_checkpoint_and_resume_to_the_same_loss(checkpoints, token_data, tmp_path):
    """One command for every launch of a preemptible job: `--resume` starts fresh when
    there is no checkpoint yet; a real SIGINT, then a real SIGTERM, each finish the step,
    save and exit non-zero with how to go on; the run ends with the losses of an
    uninterrupted one."""
    import signal

    common = ["--model", checkpoints["mha_tied"], "--data", token_data, "--seq-len", "16", "--batch-size", "4",
              "--total-steps", "40", "--learning-rate", "1e-2", "--save-every", "100"]
    _run(*common, "--output-dir", str(tmp_path / "straight"))
    split = ["--output-dir", str(tmp_path / "split"), "--resume"]
    first = _interrupt(common + split, signal.SIGINT, "step 10:")
    assert "no checkpoint" in first.stdout and first.returncode == 128 + signal.SIGINT, first.stderr[-3000:]
    assert "SIGINT: stopped after step" in first.stderr and "--resume" in first.stderr.splitlines()[-1]
    stopped = read_metadata(tmp_path / "split" / "checkpoint")["data_position"]
    assert 10 <= stopped < 40
    second = _interrupt(common + split, signal.SIGTERM, "step 20:")
    assert f"at step {stopped}" in second.stdout and second.returncode == 128 + signal.SIGTERM, second.stderr[-3000:]
    assert read_metadata(tmp_path / "split" / "checkpoint")["data_position"] > stopped
    _run(*common, *split)

    def losses(name):
        rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        return [r["step"] for r in rows], [r["loss"] for r in rows]

    steps, straight = losses("straight")
    assert steps == list(range(40))  # (0-based, as tools/grpo.py's)
    assert losses("split")[0] == steps
    np.testing.assert_allclose(losses("split")[1], straight, rtol=1e-5)
    assert straight[-1] < straight[0]
    assert os.path.getsize(tmp_path / "split" / "loss.svg") > 0
