"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`,
`parallel_tool_calls`, assistant `tool_calls` and `tool` messages in the
history.

- Rendering: a chat template that knows tools (it reads `tools`, as Qwen2.5/3's,
  Hermes', Llama 3.1's do) gets them, and the history's tool calls with their
  arguments as objects (as llama.cpp passes them). A template that does not
  (SmolLM2's) gets the documented fallback: a system message listing the tools
  as JSON inside <tools></tools> and asking for Hermes-style calls; the
  history's calls are written as such and `tool` messages wrapped in
  <tool_response></tool_response>.
- Parsing: Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks (Qwen2.5, Qwen3, Hermes, the fallback), and Llama 3.x's JSON form (the
  whole reply `{"name": ..., "parameters": {...}}`, optionally after
  <|python_tag|>). Text outside the calls is the message's content.
- `tool_choice` `required` or a named function: the reply is held to the
  Hermes-style form with arguments valid for the function's `parameters`
  (llguidance's Lark grammar with %json schemas), so even a small model emits
  a call that validates; `none`: the tools are not offered.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .schemas import bad

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_JSON_OPTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FALLBACK = ("You may call one or more functions to assist with the user query. The functions are listed "
            "inside <tools></tools> as JSON:\n<tools>\n{tools}\n</tools>\n\nTo call a function, reply with a "
            "JSON object holding its name and arguments inside <tool_call></tool_call>:\n<tool_call>\n"
            "{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


@dataclass(frozen=True)
class Tools:
    functions: tuple[dict, ...]          # OpenAI's {"type": "function", "function": {...}}
    choice: str                          # "auto", "required", or a function's name
    parallel: bool

    @property
    def names(self) -> list[str]:
        return [f["function"]["name"] for f in self.functions]

    def call(self, name: str, arguments: str) -> dict | None:
        """A tool call of one of these functions (harmony's, already apart from the text); None for others."""
        if name not in self.names:
            return None
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": arguments}}


def parse(body: dict) -> Tools | None:
    """The request's tools and tool_choice (None: no tools offered)."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice", "names a tool choice but the request has no 'tools'")
        return None
    if not isinstance(raw, list):
        raise bad("tools", "must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    funcs: list[dict] = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise bad(f"tools[{i}]", "must be {\"type\": \"function\", \"function\": {\"name\": ..., ...}}")
        f = t["function"]
        if not isinstance(f.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", f["name"]):
            raise bad(f"tools[{i}].function.name", "must be 1 to 64 letters, digits, '_', '.' or '-'")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters", "must be a JSON schema (an object)")
        funcs.append({"type": "function", "function": {**f, "parameters": params}})
    names = [f["function"]["name"] for f in funcs]
    if len(set(names)) != len(names):
        raise bad("tools", "names a function twice")
    if choice is None or choice == "auto":
        mode = "auto"
    elif choice == "none":
        return None
    elif choice == "required":
        mode = "required"
    elif isinstance(choice, dict) and choice.get("type") == "function" and \
            isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str):
        mode = choice["function"]["name"]
        if mode not in names:
            raise bad("tool_choice", f"names function {mode!r}, which 'tools' does not have")
    else:
        raise bad("tool_choice", "must be none, auto, required or {\"type\": \"function\", \"function\": "
                                 "{\"name\": ...}}")
    par = body.get("parallel_tool_calls", True)
    if not isinstance(par, bool):
        raise bad("parallel_tool_calls", "must be true or false")
    return Tools(tuple(funcs), mode, par)


def history(messages: list[dict], raw: list) -> list[dict]:
    """Checked assistant tool calls of the history, kept on their messages
    (with their arguments as objects, for the template)."""
    out = []
    for i, (m, r) in enumerate(zip(messages, raw)):
        calls = r.get("tool_calls") if isinstance(r, dict) else None
        if calls:
            if m["role"] != "assistant" or not isinstance(calls, list):
                raise bad(f"messages[{i}].tool_calls", "belong on an assistant message, as a list")
            conv = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad(f"messages[{i}].tool_calls[{j}]", "must be {\"id\", \"type\": \"function\", "
                                                                  "\"function\": {\"name\", \"arguments\"}}")
                args = fn.get("arguments", "{}")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError as e:
                        raise bad(f"messages[{i}].tool_calls[{j}].function.arguments",
                                  f"is not valid JSON: {e}") from None
                conv.append({"id": c.get("id"), "type": "function",
                             "function": {"name": fn["name"], "arguments": args}})
            m = {**m, "tool_calls": conv}
        out.append(m)
    return out


def template_reads(template: str | None, name: str) -> bool:
    """Whether a chat template's source names a variable (a word of its text)."""
    return bool(template) and re.search(rf"\b{re.escape(name)}\b", template) is not None  # type: ignore[arg-type]


def knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template  # type: ignore[operator]


def fallback_messages(messages: list[dict], tools: Tools | None) -> list[dict]:
    """The documented fallback for templates without tools: the tools in a
    system message, calls and results as Hermes-style text."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            text = "\n".join(f"{OPEN}\n{json.dumps(_named(c))}\n{CLOSE}" for c in m["tool_calls"])
            m = {"role": "assistant", "content": ((m.get("content") or "") + ("\n" if m.get("content") else "")
                                                  + text)}
        elif m["role"] == "tool":
            m = {"role": "tool", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append({k: v for k, v in m.items() if k in ("role", "content")})
    if tools is not None:
        sys_text = FALLBACK.format(tools="\n".join(json.dumps(f) for f in tools.functions))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + sys_text}
        else:
            out.insert(0, {"role": "system", "content": sys_text})
    return out


def _named(call: dict) -> dict:
    return {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def lark_grammar(tools: Tools) -> str:
    """The Hermes-style form a `required` or named tool_choice holds the reply
    to: one call (or several, parallel_tool_calls), each's arguments valid for
    its function's parameters."""
    funcs = [f for f in tools.functions if tools.choice in ("required", f["function"]["name"])]
    alts = [{"type": "object", "properties": {"name": {"const": f["function"]["name"]},
                                              "arguments": f["function"]["parameters"]},
             "required": ["name", "arguments"], "additionalProperties": False} for f in funcs]
    schema = {**(alts[0] if len(alts) == 1 else {"anyOf": alts}), "x-guidance": _JSON_OPTS}
    many = ' ("\\n" call)*' if tools.parallel and tools.choice == "required" else ""
    return (f'start: call{many}\ncall: "{OPEN}\\n" obj "\\n{CLOSE}"\nobj: %json {json.dumps(schema)}\n')


BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


def extract(text: str, tools: Tools) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a reply: Hermes-style blocks naming one of the
    tools, or Llama 3.x's JSON form. Unparsable blocks stay in the content."""
    calls, kept, pos = [], [], 0
    for mt in BLOCK.finditer(text):
        call = _call(mt.group(1), tools)
        if call is None:
            continue
        kept.append(text[pos:mt.start()])
        calls.append(call)
        pos = mt.end()
    kept.append(text[pos:])
    if not calls:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if body.startswith("{"):
            call = _call(body, tools)
            if call is not None:
                return None, [call]
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def _call(js: str, tools: Tools) -> dict | None:
    try:
        obj = json.loads(js)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in tools.names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)}}
