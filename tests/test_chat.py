"""Chat templates and generation defaults against Hugging Face transformers."""

import json
import os

import jax
import numpy as np
import pytest
import tokenizers
from transformers import AutoTokenizer

import eqx_tx
from eqx_tx.infer.generation import generate
from eqx_tx.infer.text import sampling_defaults
from eqx_tx.io.saving import tokenizer_files
from eqx_tx.train.data import TINY_TOKENIZER, Examples, tokenize
from tests.tools_util import load_tool

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "chat_templates")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>"]
# Qwen3's template: bos/eos as in Qwen3's tokenizer_config.json; Llama 3's as in Llama 3's.
TOKENS = {"qwen3": dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
          "llama3": dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
          "tracked": dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")}
QWEN3_GENERATION = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                    "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95}

CHATS = [
    [{"role": "user", "content": "Once upon a time there was a cat."}],
    [{"role": "system", "content": "You tell short stories."},
     {"role": "user", "content": "A story about a dog?"},
     {"role": "assistant", "content": "The dog ran home. It was happy."},
     {"role": "user", "content": "And then?"},
     {"role": "assistant", "content": "He slept by the fire.", "reasoning_content": "Keep it short."}],
    [{"role": "system", "content": "Be kind."},
     {"role": "user", "content": "  Hello there  "},
     {"role": "assistant", "content": "<think>\nThinking about it.\n</think>\n\nHi! Nice to meet you."}],
]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather in a city (°C)",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def _directory(tmp_path, name: str, generation: dict | None = None) -> str:
    directory = tmp_path / name
    directory.mkdir()
    tok = tokenizers.Tokenizer.from_file(TINY_TOKENIZER)
    tok.add_special_tokens(SPECIAL)
    tok.add_tokens(["<think>", "</think>"])
    tok.save(str(directory / "tokenizer.json"))
    with open(os.path.join(FIXTURES, f"{name}.jinja")) as f:
        template = f.read()
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **TOKENS[name]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    return str(directory)


@pytest.mark.parametrize("name", ["qwen3", "llama3", "tracked"])
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_chat_template_token_ids_equal_transformers(tmp_path, name, generation_prompt):
    directory = _directory(tmp_path, name)
    ours, hf = eqx_tx.load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    chats = CHATS[1:] if name == "tracked" else CHATS
    variants = [{}] + ([{"enable_thinking": False}, {"tools": TOOLS}] if name == "qwen3" else [])
    if name == "tracked":
        variants.append({"tools": TOOLS})
    for chat in chats:
        for kwargs in variants:
            expected = hf.apply_chat_template(chat, add_generation_prompt=generation_prompt, tokenize=True,
                                              return_dict=False, **kwargs)
            got = eqx_tx.apply_chat_template(ours, chat, add_generation_prompt=generation_prompt, **kwargs)
            assert got == list(expected), (chat, kwargs)


def test_template_errors_are_clear(tmp_path):
    ours = eqx_tx.load_tokenizer(_directory(tmp_path, "tracked"))
    with pytest.raises(ValueError, match="chat template: the first message must be the system prompt"):
        ours.apply_chat_template(CHATS[0])
    bare = eqx_tx.infer.text.Tokenizer.from_file(TINY_TOKENIZER)
    with pytest.raises(ValueError, match="has no chat template"):
        bare.apply_chat_template(CHATS[0])


def test_assistant_mask_of_a_generation_block_equals_transformers(tmp_path):
    directory = _directory(tmp_path, "tracked")
    ours, hf = eqx_tx.load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    for chat in CHATS[1:]:
        ids, mask = ours.chat_for_training(chat)
        expected = hf.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == list(expected["input_ids"])
        np.testing.assert_array_equal(mask, expected["assistant_masks"])


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_assistant_mask_without_a_generation_block_covers_each_reply_and_its_end(tmp_path, name):
    ours = eqx_tx.load_tokenizer(_directory(tmp_path, name))
    hf = AutoTokenizer.from_pretrained(os.path.join(tmp_path, name))
    chat = CHATS[1]
    ids, mask = ours.chat_for_training(chat)
    assert ids == list(hf.apply_chat_template(chat, tokenize=True, return_dict=False))
    replies = [m["content"] for m in chat if m["role"] == "assistant"]
    eos = TOKENS[name]["eos_token"]
    spans = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    trained = [ours.decode(ids[a:b], skip_special_tokens=False) for a, b in zip(spans[::2], spans[1::2])]
    assert trained == [r + eos for r in replies]


def test_chat_records_train_on_the_assistant_tokens_only(tmp_path):
    ours = eqx_tx.load_tokenizer(_directory(tmp_path, "qwen3"))
    docs = tokenize([{"messages": CHATS[1]}, {"text": "plain text"}], ours, eos_id=5)
    ex = Examples(docs, 160, packing="segments")
    ids, mask = ours.chat_for_training(CHATS[1])
    assert ex.segment_ids is not None and len(ex) == 1
    at = ex.segment_ids[0] == 1  # the chat, record 0
    row = 0
    np.testing.assert_array_equal(ex.targets[row, at], ids[1:])
    np.testing.assert_array_equal(ex.weights[row, at], mask[1:])
    assert 0 < ex.weights[row, at].sum() < at.sum()


def test_sampling_defaults_follow_transformers_generation_config():
    qwen = sampling_defaults(QWEN3_GENERATION)
    assert (qwen.temperature, qwen.top_k, qwen.top_p, qwen.stop_token_ids) == (0.6, 20, 0.95, (151645, 151643))
    unset = sampling_defaults({"do_sample": True, "max_new_tokens": 7})
    assert (unset.temperature, unset.top_k, unset.top_p, unset.max_new_tokens) == (1.0, 50, 1.0, 7)
    greedy = sampling_defaults({"temperature": 0.6, "eos_token_id": 3})
    assert (greedy.temperature, greedy.stop_token_ids) == (0.0, (3,))


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    text_files = _directory(root, "qwen3", {"do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9,
                                            "eos_token_id": 2, "max_new_tokens": 9})
    config = eqx_tx.Qwen3Config(vocab_size=528, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                                eos_token_id=2)  # with room for the added special tokens
    model = eqx_tx.init_model(config, key=jax.random.key(0))
    eqx_tx.save(model, root / "model", extra_files=tokenizer_files(text_files))
    return str(root / "model")


def test_generate_text_uses_the_checkpoint_defaults_and_the_chat_template(tiny_chat_model):
    model = eqx_tx.load(tiny_chat_model, progress=False)
    tok = eqx_tx.load_tokenizer(tiny_chat_model)
    chat = [{"role": "user", "content": "Once upon a time"}]
    text = eqx_tx.generate_text(model, tok, [chat], chat=True)[0]
    defaults = tok.sampling_defaults()
    assert defaults is not None and defaults.max_new_tokens == 9
    ids = tok.apply_chat_template(chat, add_generation_prompt=True)
    ref = generate(model, [ids], defaults)[0]
    assert text == tok.decode(ref.tokens[:-1] if ref.stop_reason == "stop" else ref.tokens)


def test_sample_tool_prints_and_overrides_the_defaults(tiny_chat_model, tmp_path, capsys):
    sample = load_tool("sample")
    prompts = tmp_path / "chats.jsonl"
    prompts.write_text(json.dumps({"messages": CHATS[0]}) + "\n")
    sample.main(sample.Args(model=tiny_chat_model, prompts_file=str(prompts), top_k=3))
    out, err = capsys.readouterr()
    assert ("sampling: max_new_tokens=9 (generation_config.json), temperature=0.7 (generation_config.json), "
            "top_k=3 (flag), top_p=0.9 (generation_config.json), stop_token_ids=(2,) (generation_config.json)") in err
    assert "<|im_start|>user\nOnce upon a time there was a cat.<|im_end|>\n<|im_start|>assistant\n" in out


def test_decode_stream_pieces_join_to_the_whole_decode(tmp_path):
    """`Tokenizer.decode_stream` (the server's per-token text) equals `decode` of every
    id so far after each token, across multi-byte characters split over tokens and
    special tokens (skipped)."""
    tokenizer = eqx_tx.load_tokenizer(_directory(tmp_path, "qwen3"))
    text = "Héllo, naïve café — 日本語のテキスト 🙂🙂! <|im_end|> Once upon a time… ÿ"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # several tokens per word: characters split over tokens
    step, joined = tokenizer.decode_stream(), ""
    pending, waited = 0, 0
    for i, token in enumerate(ids):
        piece = step(token)
        joined += piece
        pending = 0 if piece else pending + 1
        waited += pending == 1
        if not pending:
            assert joined == tokenizer.decode(ids[: i + 1]), i
    assert joined == tokenizer.decode(ids) and pending == 0
    assert waited  # some token ended inside a character: its text came with the next one
