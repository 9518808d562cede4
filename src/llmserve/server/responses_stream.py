"""A Responses API stream: one output's text deltas -> OpenAI's typed events, in their order.

A reasoning item (with --reasoning-parser) opens on the first thought (output_item.added), grows by
reasoning_text.delta and closes with reasoning_text.done and output_item.done. A message item opens on the
first content (output_item.added, content_part.added), grows by
output_text.delta and closes with output_text.done, content_part.done and output_item.done; a function
call opens with output_item.added (arguments ""), grows by function_call_arguments.delta and closes with
function_call_arguments.done and output_item.done. An item closes when the next one opens or the output
ends; every event carries the stream's next sequence_number.
"""

from __future__ import annotations

import uuid

from llmserve.http.sse import data_event
from llmserve.server.protocol import DeltaMessage, encode_json
from llmserve.server.protocol_responses import (FunctionCallItem, OutputItem, OutputMessage, OutputText,
                                                ReasoningItem, ReasoningText, StreamEvent)
from llmserve.server.reasoning import reasoning_stream
from llmserve.server.tool_calls import ChoiceStream, ToolPlan


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def sse_typed_event(event: StreamEvent) -> bytes:
    """OpenAI's Responses streams name each event's type on its own `event:` line too."""
    return b"event: " + event.type.encode() + b"\n" + data_event(encode_json(event))


class EventCounter:
    """Numbers a stream's events."""

    def __init__(self) -> None:
        self.num_events = 0

    def event(self, kind: str, **fields) -> bytes:
        event = StreamEvent(type=f"response.{kind}", sequence_number=self.num_events, **fields)
        self.num_events += 1
        return sse_typed_event(event)


class OutputEvents:
    """The events of one output's items, fed its text deltas as the engine produces them."""

    def __init__(self, plan: ToolPlan, counter: EventCounter, reasoning_parser: str | None) -> None:
        self.choice = ChoiceStream(plan)
        self.thoughts = None if reasoning_parser is None else reasoning_stream(reasoning_parser)
        self.counter = counter
        self.items: list[OutputItem] = []  # closed, in output order
        self.open: OutputItem | None = None

    def feed(self, text: str, is_final: bool) -> list[bytes]:
        events = []
        if self.thoughts is not None:
            reasoning, text = self.thoughts.feed(text, is_final)
            events += self._reasoning(reasoning) if reasoning else []
        for delta in self.choice.feed(text, is_final):
            events += self._delta(delta)
        if is_final:
            events += self._close()
        return events

    def _delta(self, delta: DeltaMessage) -> list[bytes]:
        if delta.content:
            events = [] if isinstance(self.open, OutputMessage) else self._close() + self._open_message()
            self.open.content[0].text += delta.content
            return events + [self._event("output_text.delta", item_id=self.open.id, content_index=0,
                                         delta=delta.content, logprobs=[])]
        events = []
        for call in delta.tool_calls or ():
            if call.id is not None:  # a new call: its name now, its arguments after
                events += self._close() + self._open_call(call.id, call.function.name or "")
            arguments = call.function.arguments if call.function is not None else None
            if arguments and isinstance(self.open, FunctionCallItem):
                self.open.arguments += arguments
                events.append(self._event("function_call_arguments.delta", item_id=self.open.id, delta=arguments))
        return events

    def _reasoning(self, delta: str) -> list[bytes]:
        events = [] if isinstance(self.open, ReasoningItem) else self._close() + self._open_reasoning()
        self.open.content[0].text += delta
        return events + [self._event("reasoning_text.delta", item_id=self.open.id, content_index=0, delta=delta)]

    def _open_reasoning(self) -> list[bytes]:
        self.open = ReasoningItem(new_item_id("rs"), [ReasoningText("")], status="in_progress")
        return [self._event("output_item.added", item=ReasoningItem(self.open.id, [], status="in_progress"))]

    def _open_message(self) -> list[bytes]:
        self.open = OutputMessage(new_item_id("msg"), [OutputText("")], status="in_progress")
        added = OutputMessage(self.open.id, [], status="in_progress")  # its part comes with content_part.added
        return [self._event("output_item.added", item=added),
                self._event("content_part.added", item_id=self.open.id, content_index=0, part=OutputText(""))]

    def _open_call(self, call_id: str, name: str) -> list[bytes]:
        self.open = FunctionCallItem(new_item_id("fc"), call_id, name, "", status="in_progress")
        return [self._event("output_item.added", item=self.open)]  # encoded now: later growth is not in it

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = "completed"
        index = len(self.items)
        if isinstance(item, ReasoningItem):
            events = [self._event("reasoning_text.done", output_index=index, item_id=item.id, content_index=0,
                                  text=item.content[0].text)]
        elif isinstance(item, OutputMessage):
            text = item.content[0].text
            events = [self._event("output_text.done", output_index=index, item_id=item.id, content_index=0,
                                  text=text, logprobs=[]),
                      self._event("content_part.done", output_index=index, item_id=item.id, content_index=0,
                                  part=OutputText(text))]
        else:
            events = [self._event("function_call_arguments.done", output_index=index, item_id=item.id,
                                  arguments=item.arguments, name=item.name)]
        self.items.append(item)
        return events + [self._event("output_item.done", output_index=index, item=item)]

    def _event(self, kind: str, **fields) -> bytes:
        if "output_index" not in fields:
            fields["output_index"] = len(self.items)  # the open item's place
        return self.counter.event(kind, **fields)
