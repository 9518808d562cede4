"""Structured outputs under a reasoning parser, as vLLM applies them: the grammar (response_format,
structured_outputs, tool_choice required or named) constrains the answer, not the thoughts. It starts after
the output's end-of-thought marker (</think>; gpt-oss: the final channel's header), matched on token ids, so
the marker must come out as the tokens the tokenizer makes of it (one added token in Qwen3 and DeepSeek-R1,
special tokens in gpt-oss). A prompt that closed the thoughts itself (Qwen3's enable_thinking false writes an
empty <think></think>) has the grammar from the first token. `--structured-outputs-config
'{"enable_in_reasoning": true}'` applies it to the whole output instead.
"""

from __future__ import annotations

import msgspec

from llmserve.json_flags import parse_json_object_flag
from llmserve.sampling_params import SamplingParams
from llmserve.server.reasoning import CHANNEL, MESSAGE, THINK_END

END_OF_THOUGHT = {"deepseek_r1": THINK_END, "qwen3": THINK_END, "gpt_oss": f"{CHANNEL}final{MESSAGE}"}
STRUCTURED_OUTPUTS_KEYS = ("enable_in_reasoning",)


def parse_structured_outputs_config(text: str | None) -> dict:
    """--structured-outputs-config (vLLM's flag) as a dict; ValueError naming the flag."""
    if text is None:
        return {}
    settings = parse_json_object_flag("structured-outputs-config", text, STRUCTURED_OUTPUTS_KEYS)
    if not isinstance(settings.get("enable_in_reasoning", False), bool):
        raise ValueError("--structured-outputs-config: enable_in_reasoning must be true or false")
    return settings


def is_thinking_over(parser: str, prompt_text: str) -> bool:
    """The prompt ends with the thoughts closed (nothing of them left for the model to write)."""
    return parser != "gpt_oss" and prompt_text.rstrip().endswith(THINK_END)


def grammar_after_thinking(params: SamplingParams, parser: str | None, tokenizer, prompt_text: str) -> None:
    """Make `params`' grammar wait for the end of the thoughts (in place); nothing without a grammar, a parser,
    or thoughts still to come."""
    constraint = params.structured_outputs
    if constraint is None or parser is None or is_thinking_over(parser, prompt_text):
        return
    end = tokenizer.encode(END_OF_THOUGHT[parser], add_special_tokens=False)
    params.structured_outputs = msgspec.structs.replace(constraint, reasoning_end=list(end))
