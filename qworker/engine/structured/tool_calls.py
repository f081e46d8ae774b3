"""Tool calls on chat: the grammar that forces a call, and conversations holding earlier calls
rendered through chat templates that know nothing of tools.

OpenAI's shapes: a tool is `{"type": "function", "function": {"name", "description"?,
"parameters"?}}`; an assistant message's `tool_calls` are `[{"id", "type": "function",
"function": {"name", "arguments"}}]` with `arguments` as JSON text; a `tool` message answers one
call and names it by `tool_call_id`.

Tools reach the model one of two ways. A chat template that renders `tools` (Qwen 2.5/3's,
Llama 3.1's, Mistral's: its text names the variable) gets them as `tools=` in
apply_chat_template, and writes them in its own words and format. One that does not (SmolLM2's)
gets them in a system message placed first (`tools_system_message`), which asks for calls in the
Hermes format `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`: the format the
gateway's `hermes` parser reads, its default for such templates.
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


def renders_tools(chat_template: str) -> bool:
    """Whether a chat template takes a `tools` variable (it names it)."""
    return "tools" in chat_template


def tools_system_message(tools: list[dict[str, Any]]) -> dict[str, str]:
    """A system message that shows the model the functions it may call, for chat templates that
    do not render `tools` themselves."""
    listed = json.dumps([t["function"] for t in tools], separators=(",", ":"))
    return {
        "role": "system",
        "content": "You may call these functions. To call one, reply with "
        '<tool_call>{"name": <function name>, "arguments": <arguments as a JSON object>}</tool_call>. '
        f"Functions: {listed}",
    }


def template_inputs(
    messages: list[dict[str, Any]], chat_template: str, tools: list[dict[str, Any]] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for apply_chat_template: the tools as `tools=` where the template
    renders them, else in a system message first (and None for `tools=`)."""
    messages = template_messages(messages, chat_template)
    if not tools:
        return messages, None
    if renders_tools(chat_template):
        return messages, tools
    return [tools_system_message(tools), *messages], None
