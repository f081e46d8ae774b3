"""The gateway's tokenizer: `tokenizer.json` through the `tokenizers` library (no transformers, no
torch), for /tokenize, /detokenize, /tokenizer_info, token counting and echoed token-id prompts.

Where it comes from: `--tokenizer DIR`; else the model's own directory (`--model DIR`); else, for
`smollm2`, the Hugging Face directory a worker converted once from the GGUF file
(`$QWORKER_CACHE_DIR/models/SmolLM2-135M-Instruct.Q4_1-*`, see qworker/model/loader.py). The
gateway never converts: that needs torch. The context length comes from the directory's
config.json (`max_position_embeddings`) unless --max-model-len says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qworker import envs
from qworker.errors import QworkerError

# Mirrors qworker.model.loader (which imports torch, so it cannot be imported here).
SMOLLM2_ALIASES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")
SMOLLM2_CACHE_GLOB = "SmolLM2-135M-Instruct.Q4_1-*"
# Keys of tokenizer_config.json that /tokenizer_info passes on (vLLM's shape).
INFO_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "model_max_length", "tokenizer_class")


class TokenizerNotFoundError(QworkerError, ValueError):
    """No tokenizer.json where the settings point."""


class ChatTemplateError(QworkerError, ValueError):
    """Messages the chat template cannot render (none, or the template refused them)."""


def _tojson(value: Any, indent: int | None = None) -> str:
    """transformers' `tojson` filter for chat templates (keys kept in order, non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def _strftime_now(format: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(format)


def cache_root() -> Path:
    return envs.cache_dir()


def find_tokenizer_dir(model: str, tokenizer: str | None) -> Path:
    if tokenizer is not None:
        path = Path(tokenizer).expanduser()
        if not (path / "tokenizer.json").is_file():
            raise TokenizerNotFoundError(f"--tokenizer {path}: no tokenizer.json there")
        return path
    if model.lower() in SMOLLM2_ALIASES:
        found = sorted(
            (
                p
                for p in (cache_root() / "models").glob(SMOLLM2_CACHE_GLOB)
                if (p / "tokenizer.json").is_file()
            ),
            key=lambda p: p.stat().st_mtime,
        )
        if not found:
            raise TokenizerNotFoundError(
                f"no converted SmolLM2 directory under {cache_root() / 'models'} yet: start a worker "
                "once on this machine (it converts the model), or give --tokenizer DIR"
            )
        return found[-1]
    path = Path(model).expanduser()
    if (path / "tokenizer.json").is_file():
        return path
    raise TokenizerNotFoundError(
        f"model {model!r} is not a directory with tokenizer.json; give --tokenizer DIR"
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass
class GatewayTokenizer:
    path: Path
    tokenizer: Any  # a tokenizers.Tokenizer
    max_model_len: int | None
    config: dict[str, Any]
    chat_template: str | None

    @classmethod
    def load(cls, model: str, tokenizer: str | None, max_model_len: int | None) -> GatewayTokenizer:
        from tokenizers import Tokenizer

        path = find_tokenizer_dir(model, tokenizer)
        config = _read_json(path / "tokenizer_config.json")
        template_file = path / "chat_template.jinja"
        chat_template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if max_model_len is None:
            context = _read_json(path / "config.json").get("max_position_embeddings")
            max_model_len = context if isinstance(context, int) and context > 1 else None
        return cls(
            path, Tokenizer.from_file(str(path / "tokenizer.json")), max_model_len, config, chat_template
        )

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def token_strs(self, token_ids: list[int]) -> list[str | None]:
        return [self.tokenizer.id_to_token(t) for t in token_ids]

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat template applied as transformers' apply_chat_template does (jinja2, sandboxed),
        with the tools as the worker gives them (qworker/engine/structured/tool_calls.py)."""
        if not self.chat_template:
            raise ChatTemplateError(f"the tokenizer in {self.path} has no chat template")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        from qworker.engine.structured.tool_calls import template_inputs

        messages, template_tools = template_inputs(messages, self.chat_template, tools)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        # What transformers adds to a chat template's environment.
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        special = {k: v for k, v in self.config.items() if k.endswith("_token") and isinstance(v, str)}
        variables = {**special, **(chat_template_kwargs or {})}
        if template_tools is not None:
            variables["tools"] = template_tools
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused these messages: {exc}") from None

    def info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the tokenizer config's special tokens and the chat template."""
        out: dict[str, Any] = {k: self.config[k] for k in INFO_KEYS if k in self.config}
        out["chat_template"] = self.chat_template
        out["vocab_size"] = self.vocab_size
        out["max_model_len"] = self.max_model_len
        return out
