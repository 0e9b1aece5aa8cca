"""A checkpoint's text side: its tokenizer, chat template and generation defaults.

`load_tokenizer(directory)` reads `tokenizer.json`, the special tokens and chat
template of `tokenizer_config.json` (or `chat_template.jinja`), and the sampling
defaults of `generation_config.json`, as Hugging Face does.
"""

import json
import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tokenizers
import tokenizers.decoders

from .chat import Message, render_chat
from .sampling import SamplingParams

__all__ = ["Message", "Tokenizer", "apply_chat_template", "load_tokenizer", "sampling_defaults"]

GENERATION_CONFIG = "generation_config.json"
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def sampling_defaults(generation_config: Mapping, *, max_new_tokens: int = 128) -> SamplingParams:
    """`SamplingParams` from a parsed `generation_config.json`, with transformers'
    defaults for what it leaves out: greedy unless `do_sample`; when sampling,
    temperature 1.0, top_k 50, top_p 1.0; stop at its `eos_token_id` (else the
    model's); `max_new_tokens` from the file, else the argument."""
    g = generation_config
    sample = bool(g.get("do_sample", False))
    eos = g.get("eos_token_id")
    stop = None if eos is None else tuple(int(t) for t in ([eos] if isinstance(eos, int) else eos))
    return SamplingParams(
        max_new_tokens=int(g.get("max_new_tokens") or max_new_tokens),
        temperature=float(g.get("temperature", 1.0)) if sample else 0.0,
        top_k=int(g.get("top_k", 50) or 0) if sample else 0,
        top_p=float(g.get("top_p", 1.0) or 1.0) if sample else 1.0,
        stop_token_ids=stop,
    )


class Tokenizer:
    """A `tokenizers.Tokenizer` with the checkpoint's chat template, special tokens and
    sampling defaults.

    **Arguments:**

    - `tokenizer`: the fast tokenizer (`tokenizer.json`).
    - `chat_template`: the Jinja chat template, if the checkpoint has one.
    - `special_tokens`: `bos_token`, `eos_token`, ... strings (the template reads them).
    - `generation_config`: the parsed `generation_config.json` (`None`: none).
    - `source`: where it was read from (for messages).
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        generation_config: Mapping | None = None,
        source: str = "<memory>",
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.generation_config = None if generation_config is None else dict(generation_config)
        self.source = source

    @classmethod
    def from_directory(cls, directory: str | os.PathLike) -> "Tokenizer":
        """Read a checkpoint directory's `tokenizer.json`, `tokenizer_config.json`,
        `chat_template.jinja` and `generation_config.json` (all but the first optional)."""
        directory = os.fspath(directory)
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{directory} has no tokenizer.json")
        config_path = os.path.join(directory, "tokenizer_config.json")
        config = _read_json(config_path) if os.path.isfile(config_path) else {}
        special = {}
        for name in _SPECIAL:
            value = config.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                special[name] = value
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if os.path.isfile(jinja_path):  # transformers prefers the separate file
            with open(jinja_path) as f:
                template = f.read()
        generation_path = os.path.join(directory, GENERATION_CONFIG)
        generation = _read_json(generation_path) if os.path.isfile(generation_path) else None
        return cls(tokenizers.Tokenizer.from_file(path), chat_template=template if isinstance(template, str) else None,
                   special_tokens=special, generation_config=generation, source=directory)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Tokenizer":
        """A bare `tokenizer.json` (no chat template, no generation defaults)."""
        return cls(tokenizers.Tokenizer.from_file(os.fspath(path)), source=os.fspath(path))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, *, skip_special_tokens: bool = True) -> Callable[[int], str]:
        """An incremental decoder: call it with each new token id; it returns the text
        that token completes (`""` while a character's bytes are still arriving), so the
        pieces join into `decode` of all the ids, at a constant cost per token."""
        stream = tokenizers.decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
        return lambda token: stream.step(self.tokenizer, token) or ""

    def sampling_defaults(self, *, max_new_tokens: int = 128) -> SamplingParams | None:
        """The checkpoint's sampling defaults (`None` without `generation_config.json`)."""
        if self.generation_config is None:
            return None
        return sampling_defaults(self.generation_config, max_new_tokens=max_new_tokens)

    def _template(self) -> str:
        if self.chat_template is None:
            raise ValueError(f"{self.source} has no chat template (tokenizer_config.json 'chat_template' or "
                             "chat_template.jinja)")
        return self.chat_template

    def render_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = False,
                    tools: Sequence[Mapping] | None = None, **template_kwargs) -> str:
        """The chat as text (see `eqx_tx.infer.chat.render_chat`)."""
        return render_chat(self._template(), messages, add_generation_prompt=add_generation_prompt, tools=tools,
                           special_tokens=self.special_tokens, **template_kwargs)[0]

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = False,
                            tools: Sequence[Mapping] | None = None, **template_kwargs) -> list[int]:
        """Token ids of the rendered chat, as transformers' `apply_chat_template`
        (the text is encoded without adding special tokens: the template writes them)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def encode_prompt(self, prompt: str | Sequence[Message], *, chat: bool = False, **template_kwargs) -> list[int]:
        """Token ids of a prompt to generate from: a chat (a list of messages, or with
        `chat=True` a text as one user message) rendered with an assistant turn opened,
        else the text encoded."""
        if isinstance(prompt, str) and not chat:
            return self.encode(prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return self.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)

    def chat_for_training(self, messages: Sequence[Message], **template_kwargs) -> tuple[list[int], np.ndarray]:
        """Token ids of a whole chat and a 0/1 mask of the tokens written by the assistant.

        The assistant's text is what the template marks with `{% generation %}`; for
        templates without it, each assistant message's content as rendered (found in
        order), through the end-of-turn token that follows it (`eos_token`), so the
        model learns to stop. Raises if an assistant message's content cannot be found.
        """
        text, spans = render_chat(self._template(), messages, special_tokens=self.special_tokens,
                                  track_generation=True, **template_kwargs)
        if spans is None:
            spans = self._assistant_spans(text, messages)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        mask = np.zeros(len(encoding.ids), np.float32)
        for i, (start, end) in enumerate(encoding.offsets):
            if end > start and any(start < b and a < end for a, b in spans):
                mask[i] = 1.0
        return list(encoding.ids), mask

    def _assistant_spans(self, text: str, messages: Sequence[Message]) -> list[tuple[int, int]]:
        spans, at = [], 0
        end_of_turn = self.special_tokens.get("eos_token", "")
        for i, m in enumerate(messages):
            if m.get("role") != "assistant" or not isinstance(m.get("content"), str):
                continue
            content = str(m["content"]).strip()
            start = text.find(content, at)
            if not content or start < 0:
                raise ValueError(f"message {i}: the chat template does not render the assistant content verbatim; "
                                 "cannot tell which tokens to train on")
            end = start + len(content)
            if end_of_turn and text.startswith(end_of_turn, end):
                end += len(end_of_turn)
            spans.append((start, end))
            at = end
        return spans


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """The tokenizer, chat template and generation defaults of a checkpoint directory."""
    return Tokenizer.from_directory(directory)


def apply_chat_template(tokenizer: Tokenizer, messages: Sequence[Message], *, add_generation_prompt: bool = False,
                        tools: Sequence[Mapping] | None = None, **template_kwargs) -> list[int]:
    """Token ids of `messages` rendered with `tokenizer`'s chat template, as
    transformers' `tokenizer.apply_chat_template(messages, tokenize=True, ...)`."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                         **template_kwargs)
