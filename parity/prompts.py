"""Prompt sets: a JSON file with a name and a list of prompts, each either raw
text (`text`) or chat messages (`messages`) that the model's chat template renders.

The set's hash covers its canonical JSON, so an artifact names exactly which
prompts it measured.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from vkengine.errors import VkEngineError
from vkengine.tokenizer import Tokenizer

BUILTIN = Path(__file__).parent / "prompts"


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str | None = None
    messages: tuple[dict, ...] | None = None

    @property
    def chat(self) -> bool:
        return self.messages is not None

    def render(self, tok: Tokenizer) -> tuple[str, bool]:
        """(text to tokenize, add_special). A rendered chat template already
        holds whatever special tokens it wants, so nothing is added to it."""
        if self.messages is not None:
            return tok.apply_chat_template([dict(m) for m in self.messages], add_generation_prompt=True), False
        return self.text, True


@dataclass(frozen=True)
class PromptSet:
    name: str
    prompts: tuple[Prompt, ...]
    sha256: str
    source: str


def load_prompt_set(name_or_file: str) -> PromptSet:
    """A built-in set by name (parity/prompts/NAME.json) or a JSON file."""
    p = Path(name_or_file)
    if not p.is_file():
        p = BUILTIN / f"{name_or_file}.json"
    if not p.is_file():
        names = ", ".join(sorted(f.stem for f in BUILTIN.glob("*.json")))
        raise VkEngineError(f"no prompt set {name_or_file!r}: give a JSON file or one of: {names}")
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except ValueError as e:
        raise VkEngineError(f"{p} is not valid JSON: {e}") from None
    items = doc.get("prompts") if isinstance(doc, dict) else None
    if not items:
        raise VkEngineError(f"{p} has no `prompts` list")
    prompts, seen = [], set()
    for i, it in enumerate(items):
        pid = str(it.get("id") or f"p{i}")
        if pid in seen:
            raise VkEngineError(f"{p}: prompt id {pid!r} appears twice")
        seen.add(pid)
        if ("text" in it) == ("messages" in it):
            raise VkEngineError(f"{p}: prompt {pid!r} needs exactly one of `text` or `messages`")
        if "text" in it:
            if not isinstance(it["text"], str) or not it["text"]:
                raise VkEngineError(f"{p}: prompt {pid!r} has an empty text")
            prompts.append(Prompt(pid, text=it["text"]))
        else:
            msgs = it["messages"]
            if not msgs or not all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in msgs):
                raise VkEngineError(f"{p}: prompt {pid!r}: messages need `role` and `content`")
            prompts.append(Prompt(pid, messages=tuple(msgs)))
    canon = json.dumps([{"id": q.id, "text": q.text, "messages": q.messages} for q in prompts],
                       sort_keys=True, ensure_ascii=False).encode()
    name = str(doc.get("name") or p.stem)
    return PromptSet(name, tuple(prompts), hashlib.sha256(canon).hexdigest(), str(p))
