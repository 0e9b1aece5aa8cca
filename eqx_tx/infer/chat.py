"""Chat templates, rendered as Hugging Face transformers renders them.

A checkpoint's template (`chat_template.jinja`, or `chat_template` in
`tokenizer_config.json`) is Jinja run in a sandbox (`ImmutableSandboxedEnvironment`,
`trim_blocks`, `lstrip_blocks`, loop controls) with the globals transformers gives it:
`raise_exception`, `strftime_now`, a `tojson` filter that keeps non-ASCII text, and
the `{% generation %}` block that marks assistant text. Messages drop `None` fields
and get `reasoning_content` from `thinking`/`reasoning` as transformers does.
Templates are data: nothing but the sandboxed template runs.
"""

import datetime
import functools
import json
from collections.abc import Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, object]

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


# Private-use characters around `{% generation %}` text in a tracked render.
_OPEN, _CLOSE = "\ue000", "\ue001"


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body; a tracked render
    brackets it with markers so its place in the output can be found."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark", [jinja2.nodes.ContextReference()]), [], [], body
                                      ).set_lineno(lineno)

    def _mark(self, context, caller):
        text = caller()
        return _OPEN + text + _CLOSE if context.get("_eqx_tx_track") else text


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """The compiled template (cached); a syntax error names the line."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template line {e.lineno}: {e.message}") from None


def _normalise(messages: Sequence[Message]) -> list[dict]:
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"message {i} is {type(message).__name__}, not a dict with 'role' and 'content'")
        if "role" not in message:
            raise ValueError(f"message {i} has no 'role'")
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat(
    template: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping] | None = None,
    special_tokens: Mapping[str, object] | None = None,
    track_generation: bool = False,
    **template_kwargs,
) -> tuple[str, list[tuple[int, int]] | None]:
    """Render `messages` with `template`.

    **Arguments:**

    - `template`: the Jinja chat template text.
    - `messages`: `{"role": ..., "content": ...}` dicts.
    - `add_generation_prompt`: end with the header of an assistant turn.
    - `tools`: JSON-schema tool descriptions, where the template takes them.
    - `special_tokens`: `bos_token`, `eos_token`, ... strings the template may use.
    - `track_generation`: also return the character spans the template marked with
      `{% generation %}` (`None` when it marks none).
    - `template_kwargs`: other variables (e.g. Qwen3's `enable_thinking`).

    **Returns:** the text and the marked `(start, end)` spans.
    """
    normalised = _normalise(messages)
    if track_generation and (_OPEN in repr(normalised) or _CLOSE in repr(normalised)):
        raise ValueError("messages contain the private-use characters U+E000/U+E001 used to track generation")
    variables = {**(special_tokens or {}), **template_kwargs, "messages": normalised,
                 "tools": list(tools) if tools is not None else None, "documents": None,
                 "add_generation_prompt": add_generation_prompt, "_eqx_tx_track": track_generation}
    try:
        text = compile_template(template).render(**variables)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template: {e}") from None
    if not track_generation:
        return text, None
    spans, plain, at = [], [], 0
    for i, part in enumerate(text.split(_OPEN)):
        if i:
            inner, _, rest = part.partition(_CLOSE)
            spans.append((at, at + len(inner)))
            plain.append(inner)
            at += len(inner)
            part = rest
        plain.append(part)
        at += len(part)
    return "".join(plain), spans or None
