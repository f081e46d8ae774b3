"""OpenAI's protocol, shared by `qworker batch` and the gateway (which import this and not each other).

format.py: the batch file's lines and the `chat.completion`, `text_completion` and error bodies as
pydantic models; request_models.py: the request bodies the gateway publishes in its OpenAPI schema;
rows.py: one body as a request (endpoint, prompt, SamplingParams from OpenAI's and vLLM's names);
structured_fields.py: `response_format`, `tools` and `tool_choice` as output constraints;
tool_parsers.py, reasoning.py, chat_output.py: tool calls and reasoning read from a chat output,
whole or streamed;
bodies.py: a finished generation as a response body. batches/: the Batch API's run on the pool
(file locations, the whole-file check, output lines, progress, the submitted-rows record, the pool
runner). May import `qworker.jobs`, `qworker.backends` and the engine's torch-free
`sampling_params`/`outputs`; never the gateway, `qworker.batch` or torch.
"""
