"""Tool calls on chat: the grammar that forces a call, and conversations holding earlier calls
rendered through chat templates that know nothing of tools.

OpenAI's shapes: a tool is `{"type": "function", "function": {"name", "description"?,
"parameters"?}}`; an assistant message's `tool_calls` are `[{"id", "type": "function",
"function": {"name", "arguments"}}]` with `arguments` as JSON text; a `tool` message answers one
call and names it by `tool_call_id`.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any


def template_messages(messages: list[dict[str, Any]], chat_template: str) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: fields that are None dropped, and, for a
    template that does not render `tool_calls` (SmolLM2's), each call written into the assistant's
    content as one JSON line `{"name": ..., "arguments": {...}}`, the form a forced call takes."""
    knows_tool_calls = "tool_calls" in chat_template
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        calls = message.get("tool_calls")
        if calls and not knows_tool_calls:
            lines = [message["content"]] if message.get("content") else []
            for call in calls:
                function = call.get("function", {})
                arguments: Any = function.get("arguments", "{}")
                with contextlib.suppress(TypeError, ValueError):  # else kept as the text it was
                    arguments = json.loads(arguments)
                lines.append(json.dumps({"name": function.get("name"), "arguments": arguments}))
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = "\n".join(lines)
        if "content" not in message:
            message["content"] = ""
        out.append(message)
    return out
