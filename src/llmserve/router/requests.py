"""What the router reads of an OpenAI request body: model, stream, user, max_tokens and the prompt's
leading blocks (TGI's `inputs`, embeddings' `input` too). The body itself goes upstream unchanged unless the model name must be
rewritten (rewrite.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from llmserve.router.policies import RouteRequest

CHARS_PER_TOKEN = 4  # to compare token-id prompts with text prompts


@dataclass(frozen=True)
class PrefixConfig:
    prefix_chars: int = 256  # text prompts: hash this many leading characters
    prefix_tokens: int = 64  # token-id prompts: hash this many leading ids


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise ValueError(f"malformed JSON body: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError("the request body must be a JSON object")
    return obj


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return f"{message.get('role', '')}: {content if isinstance(content, str) else ''}\n"


def prompt_of(obj: dict[str, Any]) -> str | list[int]:
    """The (first) prompt as text or token ids; chat: the messages joined as `role: text` lines."""
    if "messages" in obj:
        messages = obj["messages"]
        return "".join(_message_text(m) for m in messages) if isinstance(messages, list) else ""
    prompt = obj.get("prompt", obj.get("inputs", obj.get("input", "")))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of prompts: route on the first
    if isinstance(prompt, str):
        return prompt
    return [t for t in prompt if isinstance(t, int)] if isinstance(prompt, list) else ""


def prefix_key(prompt: str | list[int], config: PrefixConfig) -> bytes:
    if isinstance(prompt, str):
        return prompt[: config.prefix_chars].encode()
    return b"ids:" + b",".join(str(t).encode() for t in prompt[: config.prefix_tokens])


def _max_tokens(obj: dict[str, Any]) -> int | None:
    value = obj.get("max_completion_tokens", obj.get("max_tokens"))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def route_request(obj: dict[str, Any], config: PrefixConfig) -> RouteRequest:
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError("`model` must be a string")
    user = obj.get("user")
    prompt = prompt_of(obj)
    is_text = isinstance(prompt, str)
    return RouteRequest(model=model or "", prefix=prefix_key(prompt, config),
                        user=user if isinstance(user, str) else None,
                        num_prompt_chars=len(prompt) * (1 if is_text else CHARS_PER_TOKEN),
                        max_tokens=_max_tokens(obj), prompt_text=prompt if is_text else "",
                        is_stream=obj.get("stream") is True)
