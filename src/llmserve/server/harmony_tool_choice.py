"""tool_choice "required" and named for gpt-oss (harmony): the output is held to a call in the commentary channel,
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`, the form the `openai`
tool-call parser reads, instead of the JSON array other models are held to.

The model may think first, in one analysis message (`<|channel|>analysis<|message|>...<|end|>`, then the
next message's `<|start|>assistant`), as gpt-oss does before a call; the grammar covers those thoughts, so it
does not wait for the end of them (reasoning_grammar.py). A call ends the output: <|call|> is gpt-oss's EOS,
so one call a turn, whatever parallel_tool_calls says.
"""

from __future__ import annotations

import json

from llmserve.sampling_params import StructuredOutputsParams
from llmserve.server.protocol_tools import ChatTool
from llmserve.server.reasoning import CHANNEL, MESSAGE, START

END, CALL, CONSTRAIN = "<|end|>", "<|call|>", "<|constrain|>"
# Markers a thought may not hold: any of them would open or end a message inside it.
_NOT_IN_THOUGHTS = (START, CHANNEL, MESSAGE, CONSTRAIN, "<|return|>", CALL, "<|endoftext|>")


def harmony_call_constraint(tools: tuple[ChatTool, ...], named: str | None) -> StructuredOutputsParams:
    """An optional analysis message, then a call to one of `tools` (to `named` alone when given)."""
    calls = [_call(tool) for tool in tools if named is None or tool.function.name == named]
    thought = {"type": "tag", "begin": f"{CHANNEL}analysis{MESSAGE}",
               "content": {"type": "any_text", "excludes": list(_NOT_IN_THOUGHTS)}, "end": END}
    think_first = {"type": "sequence", "elements": [thought, {"type": "const_string", "value": f"{START}assistant"}]}
    call = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    tag = {"type": "structural_tag",
           "format": {"type": "sequence", "elements": [{"type": "optional", "content": think_first}, call]}}
    return StructuredOutputsParams(structural_tag=json.dumps(tag, separators=(",", ":")),
                                   disable_any_whitespace=True)


def _call(tool: ChatTool) -> dict:
    parameters = tool.function.parameters if tool.function.parameters is not None else {"type": "object"}
    return {"type": "tag", "begin": f"{CHANNEL}commentary to=functions.{tool.function.name} {CONSTRAIN}json{MESSAGE}",
            "content": {"type": "json_schema", "json_schema": parameters}, "end": CALL}
