"""Chat prompts: a model's own chat template, or a plain transcript when it has none.

Hugging Face checkpoints carry their chat template as Jinja, in ``chat_template.jinja``
(transformers 5) or as ``chat_template`` in ``tokenizer_config.json`` (a string, or a
list of named templates of which ``default`` and ``tool_use`` are the ones used). It
is rendered the way transformers renders it: a sandboxed environment with
``trim_blocks``/``lstrip_blocks``, the ``tojson`` filter, ``raise_exception`` and
``strftime_now``, the tokenizer's special tokens (``bos_token``, ``eos_token``, …) as
variables, and ``messages``, ``tools`` and ``add_generation_prompt``.

Both engines render here, in the replica, so one request renders the same prompt on
either. GPT-2-style checkpoints without a template keep the transcript inferd always
sent them: ``role: text`` lines ending with ``assistant:``.
"""

from __future__ import annotations

import contextlib
import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from inferd.errors import InvalidInput

TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


class ChatTemplate:
    """The chat template of one model folder (or the plain transcript)."""

    def __init__(
        self,
        source: str | None,
        tool_source: str | None = None,
        tokens: dict[str, str] | None = None,
    ) -> None:
        self.source = source
        self.tool_source = tool_source
        self.tokens = tokens or {}

    @classmethod
    def load(cls, folder: Path) -> ChatTemplate:
        folder = Path(folder)
        config: dict[str, Any] = {}
        path = folder / "tokenizer_config.json"
        if path.is_file():
            loaded = json.loads(path.read_text())
            config = loaded if isinstance(loaded, dict) else {}
        texts = {key: _token_text(config.get(key)) for key in _SPECIAL_KEYS}
        tokens = {key: text for key, text in texts.items() if text is not None}
        source, tool_source = _sources(config.get("chat_template"))
        if (folder / TEMPLATE_FILE).is_file():
            source = (folder / TEMPLATE_FILE).read_text()
        return cls(source, tool_source, tokens)

    @property
    def templated(self) -> bool:
        return self.source is not None

    @cached_property
    def _compiled(self) -> tuple[Any, Any]:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            main = env.from_string(self.source) if self.source is not None else None
            tools = env.from_string(self.tool_source) if self.tool_source is not None else main
        except TemplateError as exc:
            raise ValueError(f"the model's chat template does not compile: {exc}") from exc
        return main, tools

    def check(self) -> None:
        """Compile the template and render a one-message chat (at push: a broken
        template is refused then, not at the first request)."""
        self.render([{"role": "user", "content": "Hello"}])

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt for ``messages`` (OpenAI's shape, content as text); ``tools`` are
        given to templates that list them. A template refusing the conversation (its
        ``raise_exception``: roles that do not alternate, a system message it does not
        take) is a 400 naming its reason."""
        if self.source is None:
            lines = [f"{m['role']}: {_flat(m)}" for m in messages]
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        from jinja2 import TemplateError

        main, with_tools = self._compiled
        template = with_tools if tools else main
        try:
            return str(
                template.render(
                    messages=[_for_template(m) for m in messages],
                    tools=tools or None,
                    add_generation_prompt=add_generation_prompt,
                    **self.tokens,
                )
            )
        except _TemplateRefusal as exc:
            raise InvalidInput(f"the model's chat template refused the messages: {exc}",
                               param="messages") from None  # fmt: skip
        except TemplateError as exc:
            raise InvalidInput(f"the model's chat template failed on the messages: {exc}",
                               param="messages") from None  # fmt: skip


class _TemplateRefusal(Exception):
    pass


def _raise(message: str) -> None:
    raise _TemplateRefusal(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            sort_keys: bool = False, separators: Any = None) -> str:  # fmt: skip
    return json.dumps(
        value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=separators
    )


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _sources(value: Any) -> tuple[str | None, str | None]:
    """``chat_template`` of tokenizer_config.json: the default and the tool-use one."""
    if isinstance(value, str):
        return value, None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default"), named.get("tool_use")
    return None, None


def _flat(message: dict[str, Any]) -> str:
    """A message as transcript text: its content, then any tool calls it made."""
    text = message.get("content") or ""
    calls = [
        f"{c['function']['name']}({c['function']['arguments']})"
        for c in message.get("tool_calls") or ()
    ]
    return "\n".join([text, *calls]) if calls and text else text or "\n".join(calls)


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """A message as templates expect it: tool call arguments as objects (templates
    write them with ``tojson``) where they are JSON."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        function = dict(call["function"])
        with contextlib.suppress(TypeError, ValueError):
            function["arguments"] = json.loads(function["arguments"])
        out.append({**call, "function": function})
    return {**message, "tool_calls": out}
