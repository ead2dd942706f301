"""What the OpenAI reference accepts in a completions or chat completions request, and
what inferd's models can do with it.

Checked before anything runs, each refusal a 400 in OpenAI's error shape naming the
``param`` (``messages.[2].content``, as OpenAI writes it):

- fields: OpenAI's own request fields, plus vLLM's extensions as its OpenAI server
  takes them (through the client's ``extra_body``), so vLLM's clients work unchanged:
  the sampling ones both engines honour (``top_k``, ``min_p``, ``repetition_penalty``,
  ``min_tokens``, ``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``,
  ``skip_special_tokens``, ...; :func:`inferd.routing.generation.sampling_params`), and
  the others at their neutral value (``use_beam_search: false``, ``length_penalty:
  1``, ``add_generation_prompt: true``, ...: :data:`NEUTRAL`); plus inferd's
  ``priority`` and ``adapter``. Any other field is "Unrecognized request argument
  supplied". Fields that would change the answer in ways the engines cannot honour
  (``logit_bias``, ``top_logprobs``, ``n`` > 1, audio, the deprecated ``functions``,
  a non-neutral value of a :data:`NEUTRAL` field) are refused by name instead of
  ignored. ``tools``, ``tool_choice`` and ``response_format`` are
  :mod:`inferd.api.structured`'s.
- chat messages: roles ``system``, ``developer``, ``user``, ``assistant``, ``tool``;
  each role's fields and nothing else; ``content`` a string or a list of content parts
  of the kinds the role takes (text everywhere, refusal for the assistant; image, audio
  and file parts are valid shapes that a text model refuses); ``tool`` messages name
  their ``tool_call_id``; an assistant message without ``content`` carries
  ``tool_calls``.
"""

from __future__ import annotations

from typing import Any

from inferd.errors import InvalidInput

_SHARED = frozenset(
    {
        "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n",
        "stop", "seed", "logprobs", "user", "presence_penalty", "frequency_penalty",
        "logit_bias", "metadata", "store", "service_tier",
    }
)  # fmt: skip
_CHAT = _SHARED | {
    "messages", "max_completion_tokens", "top_logprobs", "parallel_tool_calls", "tools",
    "tool_choice", "functions", "function_call", "response_format", "modalities", "audio",
    "prediction", "reasoning_effort", "web_search_options", "verbosity", "prompt_cache_key",
    "safety_identifier",
}  # fmt: skip
_COMPLETIONS = _SHARED | {"prompt", "suffix", "echo", "best_of"}
EXTENSIONS = frozenset(
    {
        "top_k", "ignore_eos", "priority", "adapter", "min_p", "repetition_penalty",
        "min_tokens", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
        "spaces_between_special_tokens", "request_id", "cache_salt", "guided_decoding_backend",
    }
)  # fmt: skip
"""Sampling fields (vLLM's names) the engines honour, sent with the client's
``extra_body``; ``request_id``, ``cache_salt`` and ``guided_decoding_backend`` are
accepted and change nothing here (inferd's request id is ``X-Request-ID``; no KV cache
is shared between requests' prefixes; there is one guide backend)."""
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "truncate_prompt_tokens": (None,),
    "prompt_logprobs": (None, 0),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "documents": (None,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "mm_processor_kwargs": (None, {}),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_whitespace_pattern": (None,),
    "structural_tag": (None,),
    "structured_outputs": (None,),
    "logits_processors": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
}
"""vLLM's other extension fields: accepted at these (their defaults) and refused by
name at any other value (``response_format`` and ``tools`` give structured outputs)."""
_NEUTRAL_FOR = {
    True: {**NEUTRAL, "add_special_tokens": (False,), "echo": (False,)},
    False: {**NEUTRAL, "add_special_tokens": (True,)},
}
"""Per route (chat or not): ``add_special_tokens`` at vLLM's default for it; chat's
``echo`` too (completions have OpenAI's own ``echo``, refused when set)."""
_KNOWN = {
    chat: (_CHAT if chat else _COMPLETIONS) | EXTENSIONS | frozenset(_NEUTRAL_FOR[chat])
    for chat in (True, False)
}

_ROLE_FIELDS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "refusal", "tool_calls", "function_call", "audio"},
    "tool": {"role", "content", "tool_call_id"},
}
_PART_FIELDS = {
    "text": {"type", "text"},
    "refusal": {"type", "refusal"},
    "image_url": {"type", "image_url"},
    "input_audio": {"type", "input_audio"},
    "file": {"type", "file"},
}
_ROLE_PARTS = {
    "system": {"text"},
    "developer": {"text"},
    "tool": {"text"},
    "user": {"text", "image_url", "input_audio", "file"},
    "assistant": {"text", "refusal"},
}


def _bad(message: str, param: str) -> InvalidInput:
    return InvalidInput(message, param=param)


EMBEDDINGS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


def check_known(body: dict[str, Any], known: frozenset[str]) -> None:
    """A field the reference does not have is refused, as OpenAI words it."""
    for name in body:
        if name not in known:
            raise _bad(f"Unrecognized request argument supplied: {name}", name)


def check_fields(body: dict[str, Any], chat: bool) -> None:
    """Unknown fields, and known ones the engine cannot honour, refused by name."""
    check_known(body, _KNOWN[chat])
    neutral = _NEUTRAL_FOR[chat]
    for name, value in body.items():
        values = neutral.get(name)
        if values is not None and not any(_same(value, v) for v in values):
            raise _bad(f"'{name}' is not supported by inferd's engines: {_why(name)}", name)
    unsupported = {
        "functions": bool(body.get("functions")),
        "function_call": body.get("function_call") not in (None, "none", "auto"),
        "logit_bias": bool(body.get("logit_bias")),
        "top_logprobs": body.get("top_logprobs") not in (None, 0),
        "audio": body.get("audio") is not None,
        "modalities": body.get("modalities") not in (None, ["text"]),
        "prediction": body.get("prediction") is not None,
        "web_search_options": body.get("web_search_options") is not None,
        "suffix": body.get("suffix") not in (None, ""),
        "echo": bool(body.get("echo")),
        "best_of": body.get("best_of") not in (None, 1),
        "n": body.get("n") not in (None, 1),
    }
    for name, refused in unsupported.items():
        if refused:
            raise _bad(f"'{name}' is not supported by inferd's engine: {_why(name)}", name)
    both = chat and "max_completion_tokens" in body and "max_tokens" in body
    if both and body["max_tokens"] != body["max_completion_tokens"]:
        raise _bad("give max_tokens or max_completion_tokens, not both", "max_tokens")


def _same(value: Any, neutral: Any) -> bool:
    """Equal, and a boolean only to a boolean (``1`` is not ``true``)."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def _why(name: str) -> str:
    if name in ("functions", "function_call"):
        return "use 'tools' and 'tool_choice' (the deprecated function fields are not taken)"
    if name in ("n", "best_of"):
        return "one choice per request (send n requests)"
    return "drop it, or use its default"


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages, checked against the reference, as the replica renders them:
    ``role``, ``content`` as text, and ``name``, ``tool_calls`` or ``tool_call_id``
    where given. Raises InvalidInput (a 400 on OpenAI's routes) naming the message and
    field."""
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of messages", "messages")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(message: Any, i: int) -> dict[str, Any]:
    where = f"messages.[{i}]"
    if not isinstance(message, dict):
        raise _bad(f"{where} must be an object with 'role' and 'content'", where)
    role = message.get("role")
    if role not in _ROLE_FIELDS:
        raise _bad(
            f"{where}.role must be one of {', '.join(map(repr, _ROLE_FIELDS))}, not {role!r}",
            f"{where}.role",
        )
    unknown = sorted(set(message) - _ROLE_FIELDS[role])
    if unknown:
        allowed = ", ".join(sorted(_ROLE_FIELDS[role]))
        raise _bad(
            f"{where}: unknown field {unknown[0]!r} (a {role} message takes {allowed})",
            f"{where}.{unknown[0]}",
        )
    out: dict[str, Any] = {"role": role}
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str) or not name:
            raise _bad(f"{where}.name must be a non-empty string", f"{where}.name")
        out["name"] = name
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise _bad(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
        out["tool_call_id"] = message["tool_call_id"]
    calls = _tool_calls(message.get("tool_calls"), where) if role == "assistant" else []
    if calls:
        out["tool_calls"] = calls
    content = message.get("content")
    if content is None and role == "assistant" and (calls or message.get("function_call")):
        out["content"] = ""
    elif content is None and role == "assistant" and isinstance(message.get("refusal"), str):
        out["content"] = message["refusal"]
    else:
        out["content"] = _content(content, role, f"{where}.content")
    return out


def _content(content: Any, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise _bad(f"{where} must be a string or a non-empty list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _PART_FIELDS:
            raise _bad(f"{at} must be a content part with a 'type' (e.g. text)", f"{at}.type")
        if kind not in _ROLE_PARTS[role]:
            raise _bad(f"{at}: a {role} message takes no {kind!r} parts", f"{at}.type")
        unknown = sorted(set(part) - _PART_FIELDS[kind])
        if unknown:
            raise _bad(f"{at}: unknown field {unknown[0]!r} in a {kind} part", f"{at}.{unknown[0]}")
        value = part.get(kind)
        if kind in ("text", "refusal"):
            if not isinstance(value, str):
                raise _bad(f"{at}.{kind} must be a string", f"{at}.{kind}")
            texts.append(value)
        else:
            raise _bad(f"{at}: {kind} parts are not supported: this model takes text", at)
    return "".join(texts)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's earlier tool calls, checked."""
    if calls is None:
        return []
    at = f"{where}.tool_calls"
    if not isinstance(calls, list):
        raise _bad(f"{at} must be a list", at)
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or set(call) - {"id", "type", "function"}
            or not isinstance(call.get("id"), str)
            or call.get("type") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise _bad(
                f"{at}.[{k}] must be {{'id': str, 'type': 'function', 'function': "
                "{'name': str, 'arguments': str}}",
                f"{at}.[{k}]",
            )
    return [
        {"id": c["id"], "type": "function",
         "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
        for c in calls
    ]  # fmt: skip
