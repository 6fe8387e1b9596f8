"""The token ids onnxruntime-genai stops at, beyond what config.json says.

A chat model ends its turn with a token of its own (``<|im_end|>``, ``<|eot_id|>``,
``<end_of_turn>``): generation_config.json lists it among the eos ids, config.json often names
only the end of text. Without a generation_config.json the tokenizer files tell it:
tokenizer_config.json's ``eos_token``, and the token the chat template writes right after a
message's content. Their ids come from the tokenizer's added tokens.

An eos id outside the vocabulary is one onnxruntime-genai 0.18 rejects when it runs (it indexes
the logits with it): such ids are dropped with a report line (:func:`in_vocabulary`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_JSON = "tokenizer.json"
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
# The literal a chat template appends right after a message's content: `content + '<|im_end|>'`,
# `content | trim + '<|eot_id|>'`, `content }}{{ '<end_of_turn>'`.
_AFTER_CONTENT = re.compile(
    r"""content['"]?\]?(?:\s*\|\s*trim)?\s*\)?\s*(?:\+|-?\}\}\s*\{\{-?)\s*(['"])(.+?)\1"""
)


def _json(copies: Mapping[str, bytes], name: str) -> dict[str, Any]:
    try:
        value = json.loads(copies[name])
    except (KeyError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def added_tokens(copies: Mapping[str, bytes]) -> dict[str, int]:
    """The tokenizer's added (special) tokens: content -> id, from tokenizer_config.json's
    added_tokens_decoder and tokenizer.json's added_tokens."""
    out: dict[str, int] = {}
    decoder = _json(copies, TOKENIZER_CONFIG).get("added_tokens_decoder")
    if isinstance(decoder, dict):
        for key, token in decoder.items():
            content = token.get("content") if isinstance(token, dict) else None
            if isinstance(content, str) and str(key).isdigit():
                out.setdefault(content, int(key))
    tokens = _json(copies, TOKENIZER_JSON).get("added_tokens")
    for token in tokens if isinstance(tokens, list) else []:
        content = token.get("content") if isinstance(token, dict) else None
        if isinstance(content, str) and isinstance(token.get("id"), int):
            out.setdefault(content, token["id"])
    return out


def chat_template(copies: Mapping[str, bytes]) -> str:
    """The chat template's text (tokenizer_config.json's, else the template files'), or ""."""
    value: Any = _json(copies, TOKENIZER_CONFIG).get("chat_template")
    if value is None and "chat_template.jinja" in copies:
        value = copies["chat_template.jinja"].decode("utf-8", "replace")
    if value is None:
        value = _json(copies, "chat_template.json").get("chat_template")
    if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
        value = "\n".join(t.get("template", "") for t in value if isinstance(t, dict))
    return value if isinstance(value, str) else ""


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", "lstrip": ...}
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def end_of_text_tokens(copies: Mapping[str, bytes]) -> list[tuple[int, str, str]]:
    """(id, token, where it was found) of the tokenizer's eos_token and the chat template's end
    of turn, each once, where the tokenizer has an id for them."""
    ids = added_tokens(copies)
    found: list[tuple[int, str, str]] = []

    def add(text: str | None, where: str) -> None:
        if text is not None and text in ids and all(t != text for _, t, _ in found):
            found.append((ids[text], text, where))

    add(_token_text(_json(copies, TOKENIZER_CONFIG).get("eos_token")), "the tokenizer's eos_token")
    template = chat_template(copies)
    for m in _AFTER_CONTENT.finditer(template):
        literal = m.group(2)
        # the longest added token the literal begins with ('<end_of_turn>\n' -> <end_of_turn>)
        match = max((t for t in ids if literal.startswith(t)), key=len, default=None)
        add(match, "the chat template's end of turn")
    return found


def in_vocabulary(eos: int | list[int], vocab: int, notes: list[str]) -> int | list[int] | None:
    """`eos` without the ids onnxruntime-genai would reject at run time (outside [0, vocab)),
    each dropped one named in `notes`; None when none is left."""
    ids = eos if isinstance(eos, list) else [eos]
    kept = [i for i in ids if 0 <= i < vocab]
    dropped = [i for i in ids if i not in kept]
    if dropped:
        notes.append(
            f"eos_token_id: dropped {', '.join(map(str, dropped))}, outside the vocabulary "
            f"({vocab} tokens): onnxruntime-genai 0.18 rejects such an id when it runs"
        )
    if not kept:
        return None
    return kept if isinstance(eos, list) and len(kept) > 1 else kept[0]
