"""A random gpt-oss checkpoint that speaks OpenAI's harmony format as the published one does: its markers
(<|start|>, <|channel|>, <|message|>, ...) are special tokens of the tokenizer, its chat template renders
tools, tool calls and tool results as harmony messages, and <|return|> and <|call|> end an output.

The markers take the ids of the toy tokenizer's last tokens that no merge builds on (their own merges go), so
the vocab keeps its size.
"""

from __future__ import annotations

import json
import os

from llmserve.testing.maker import make_model

HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
HARMONY_EOS = ("<|return|>", "<|call|>", "<|endoftext|>")  # the published generation_config's EOS ids

# The published template's shape, without its prose: a system message (reasoning_effort), the tools as a
# TypeScript namespace in a developer message, earlier calls as messages to functions.NAME, results from them.
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final.<|end|>"
    "{% if tools %}<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n"
    "{% for tool in tools %}{% set function = tool.function if tool.function is defined else tool %}"
    "type {{ function.name }} = (_: {{ function.parameters | tojson }}) => any;\n"
    "{% endfor %}} // namespace functions<|end|>{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}"
    "{% for call in message.tool_calls %}"
    "<|start|>assistant to=functions.{{ call.function.name }}<|channel|>commentary json<|message|>"
    "{{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}"
    "<|call|>{% endfor %}"
    "{% elif message.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>"
    "{% elif message.role == 'tool' %}"
    "<|start|>functions.{{ message.name | default('tool') }} to=assistant<|channel|>commentary<|message|>"
    "{{ message.content }}<|end|>"
    "{% else %}<|start|>{{ 'developer' if message.role == 'system' else message.role }}<|message|>"
    "{{ message.content }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def make_harmony_model(out_dir: str, seed: int = 0) -> str:
    """A tiny random gpt-oss checkpoint (shape tiny-gpt-oss) with harmony's special tokens and template."""
    make_model("gpt_oss", "tiny-gpt-oss", out_dir, seed=seed)
    ids = _add_special_tokens(os.path.join(out_dir, "tokenizer.json"), HARMONY_TOKENS)
    _update_json(os.path.join(out_dir, "tokenizer_config.json"), chat_template=HARMONY_TEMPLATE,
                 eos_token="<|return|>")
    eos_ids = [ids[token] for token in HARMONY_EOS]
    _update_json(os.path.join(out_dir, "generation_config.json"), eos_token_id=eos_ids)
    _update_json(os.path.join(out_dir, "config.json"), eos_token_id=eos_ids[0])
    return out_dir


def _add_special_tokens(path: str, tokens: tuple[str, ...]) -> dict[str, int]:
    """Give `tokens` the ids of the vocab's last tokens that no merge builds on, as special added tokens (the
    merges that made those tokens removed); returns every special token's id."""
    with open(path) as f:
        spec = json.load(f)
    vocab: dict[str, int] = spec["model"]["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]
    parts = {part for merge in merges for part in merge}
    free = sorted((i for text, i in vocab.items() if text not in parts and len(text) > 1), reverse=True)
    by_id = {i: text for text, i in vocab.items()}
    for token, token_id in zip(tokens, sorted(free[:len(tokens)])):
        replaced = by_id[token_id]
        del vocab[replaced]
        merges = [merge for merge in merges if "".join(merge) != replaced]
        spec["added_tokens"].append({"id": token_id, "content": token, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    spec["model"]["merges"] = [list(merge) for merge in merges]
    with open(path, "w") as f:
        json.dump(spec, f)
    return {entry["content"]: entry["id"] for entry in spec["added_tokens"]}


def _update_json(path: str, **fields) -> None:
    with open(path) as f:
        data = json.load(f)
    data.update(fields)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
