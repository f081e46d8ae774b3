"""The one sequence a score request runs: a query and a document, in the form of the model.

- A cross-encoder (a *ForSequenceClassification checkpoint with one label) reads the pair as its
  tokenizer encodes a text pair (`tokenizer(query, document)`, special tokens included), as
  sentence-transformers' CrossEncoder and vLLM build it.
- A yes/no reranker (a causal LM with --convert classify) reads Qwen3-Reranker's prompt, as its
  model card gives it: the system line, then `<Instruct>: ...\\n<Query>: ...\\n<Document>: ...`,
  then the assistant turn with an empty think block; prefix, pair and suffix are tokenized apart
  and joined, as the card's code does. Its score is softmax([logit(no), logit(yes)])[yes] at the
  last token.
"""

from __future__ import annotations

from typing import Any

from qworker.errors import InvalidRequestError
from qworker.model.pooler import PoolingHead

QWEN3_RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
    'the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def qwen3_reranker_text(query: str, document: str, instruction: str | None = None) -> str:
    """The card's format_instruction: the middle of the prompt."""
    return (
        f"<Instruct>: {instruction or QWEN3_RERANKER_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
    )


def score_prompt_ids(tokenizer: Any, head: PoolingHead, query: str, document: str) -> list[int]:
    """The token ids of one (query, document) pair for a model whose score head is `head`."""
    for name, value in (("query", query), ("document", document)):
        if not isinstance(value, str):
            raise InvalidRequestError(f"{name} must be a string, got {type(value).__name__}")
    if head is PoolingHead.YES_NO:
        return [
            *tokenizer.encode(QWEN3_RERANKER_PREFIX, add_special_tokens=False),
            *tokenizer.encode(qwen3_reranker_text(query, document), add_special_tokens=False),
            *tokenizer.encode(QWEN3_RERANKER_SUFFIX, add_special_tokens=False),
        ]
    return list(tokenizer(query, document)["input_ids"])
