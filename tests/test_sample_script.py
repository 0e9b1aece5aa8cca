"""tools/sample.py: default-model message, prompts, streaming output."""

import jax
import pytest

import eqx_tx
from eqx_tx.models.presets import preset
from eqx_tx.train.data import TINY_TOKENIZER
from tests.tools_util import load_tool


def _sample_module():
    return load_tool("sample")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny") / "final"
    model = eqx_tx.init_model(preset("tiny"), key=jax.random.key(0))
    eqx_tx.save(model, directory, extra_files={"tokenizer.json": TINY_TOKENIZER})
    return str(directory)


def test_default_model_missing_says_how_to_create_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sample = _sample_module()
    with pytest.raises(FileNotFoundError, match="create it with `python tools/train.py`"):
        sample.main(sample.Args())


def test_samples_several_prompts_and_reports_speed(tiny_dir, tmp_path, capsys):
    sample = _sample_module()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n\nOne day\n")
    sample.main(sample.Args(model=tiny_dir, prompts_file=str(prompts), max_new_tokens=12, stream_every=4))
    out, err = capsys.readouterr()
    assert "--- [0] (length) Once upon a time" in out and "--- [1] (length) One day" in out
    assert "[1] " in out  # streamed deltas, tagged by sequence
    assert "24 tokens in" in err and "tokens/s" in err
    assert "compilation" in err  # reported apart from the decode speed


def test_n_samples_with_an_int8_cache(tiny_dir, capsys):
    sample = _sample_module()
    sample.main(sample.Args(model=tiny_dir, prompt=["Once upon a time"], n=3, kv_cache_dtype="int8",
                            max_new_tokens=6, temperature=1.0))
    out, err = capsys.readouterr()
    assert all(f"--- [0.{j}] (length) Once upon a time" in out for j in range(3))
    assert "18 tokens in" in err


def test_bad_prompt_inputs(tiny_dir, tmp_path):
    sample = _sample_module()
    with pytest.raises(FileNotFoundError, match="prompts file /nope does not exist"):
        sample.main(sample.Args(model=tiny_dir, prompts_file="/nope"))
    (tmp_path / "p.jsonl").write_text('{"foo": 1}\n')
    with pytest.raises(ValueError, match="expected an object with 'prompt', 'text' or 'messages'"):
        sample.main(sample.Args(model=tiny_dir, prompts_file=str(tmp_path / "p.jsonl")))
    with pytest.raises(ValueError, match="exceeds max_position_embeddings 2048"):
        sample.main(sample.Args(model=tiny_dir, max_new_tokens=5000))


def test_a_prompt_too_long_is_refused_before_it_is_echoed(tiny_dir, capsys):
    sample = _sample_module()
    with pytest.raises(ValueError, match="more than max_position_embeddings 2048"):
        sample.main(sample.Args(model=tiny_dir, prompt=["word " * 3000]))
    assert "word word" not in capsys.readouterr().out
