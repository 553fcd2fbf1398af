"""Request validation, field by field: every error is a 400 whose message names
the field. Only the fields we act on are read. A field that OpenAI or
llama-server defines, that changes what a request means, and that we do not
support yet is a 400 naming it unless it holds its no-op value (REFUSED: tools,
response_format, grammar, n > 1, ...); purely cosmetic fields (user, metadata,
id_slot, ...) and unknown ones are ignored, as llama-server and OpenAI clients
expect. docs/api.md has the table, field by field.

Defaults follow llama-server (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05)
on every route, OpenAI's routes included."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from vkengine.errors import VkEngineError
from vkengine.serving.sampling import SamplingParams


class HTTPError(VkEngineError):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def body(self) -> dict:
        err = {"code": self.status, "message": self.message, "type": self.kind}
        if self.param:
            err["param"] = self.param
        return {"error": err}


def bad(field_name: str, message: str) -> HTTPError:
    return HTTPError(400, f"'{field_name}' {message}", field_name)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON (numbers must be finite)")


def parse_json(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8-sig")            # RFC 8259: JSON exchanged between systems is UTF-8
        body = json.loads(text, parse_constant=_not_json)
        # JSON lets "\ud800" through; a lone surrogate is no Unicode text (the tokenizer and the
        # response encoder would fail on it), so strings must survive UTF-8 encoding
        if _SURROGATE_ESCAPE.search(text):
            json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise HTTPError(400, "the request body holds an unpaired surrogate (\\ud800-\\udfff escape); "
                             "strings must be valid Unicode") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise HTTPError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise HTTPError(400, "the request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise HTTPError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


class Fields:
    """Typed reads of a JSON object; absent or null fields take the default."""

    def __init__(self, body: dict, prefix: str = ""):
        self.body, self.prefix = body, prefix

    def _get(self, name: str):
        return self.body.get(name)

    def name(self, name: str) -> str:
        return self.prefix + name

    def integer(self, name: str, default, lo=None, hi=None, hint: str = ""):
        v = self._get(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad(self.name(name), f"must be an integer, got {json.dumps(v)}")
        if lo is not None and v < lo or hi is not None and v > hi:
            rng = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"between {lo} and {hi}"
            raise bad(self.name(name), f"must be {rng}{hint}, got {v}")
        return v

    def num(self, name: str, default, lo=None, hi=None, lo_open=False):
        v = self._get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise bad(self.name(name), f"must be a number, got {json.dumps(v)}")
        if lo is not None and (v < lo or lo_open and v == lo) or hi is not None and v > hi:
            lo_s = f"> {lo}" if lo_open else f">= {lo}"
            rng = lo_s if hi is None else f"<= {hi}" if lo is None else f"{lo_s} and <= {hi}"
            raise bad(self.name(name), f"must be {rng}, got {v}")
        return float(v)

    def flag(self, name: str, default: bool) -> bool:
        v = self._get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise bad(self.name(name), f"must be true or false, got {json.dumps(v)}")
        return v

    def text(self, name: str, default: str | None = None) -> str | None:
        v = self._get(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise bad(self.name(name), f"must be a string, got {type(v).__name__}")
        return v

    def required_text(self, name: str) -> str:
        v = self.text(name)
        if v is None:
            raise bad(self.name(name), "is required")
        return v

    def stop(self, name: str = "stop", max_n: int = 16) -> tuple[str, ...]:
        v = self._get(name)
        if v is None:
            return ()
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise bad(self.name(name), "must be a string or a list of strings")
        if len(v) > max_n:
            raise bad(self.name(name), f"takes at most {max_n} strings, got {len(v)}")
        return tuple(s for s in v if s)

    def token_ids(self, name: str, n_vocab: int) -> list[int]:
        v = self._get(name)
        if v is None:
            raise bad(self.name(name), "is required")
        if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            raise bad(self.name(name), "must be a list of token ids (integers)")
        for t in v:
            if not 0 <= t < n_vocab:
                raise bad(self.name(name), f"holds token id {t}, outside the vocabulary 0..{n_vocab - 1}")
        return v


@dataclass
class Generation:
    """A validated generation request, whatever its route."""
    prompt: str | list[int] | None = None          # text or token ids (None for chat)
    messages: list[dict] | None = None
    max_tokens: int | None = None                  # None: until EOS, a stop string or the limits
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stream: bool = False
    n_probs: int = 0
    ignore_eos: bool = False
    cache_prompt: bool = True
    truncate: bool = False
    n_keep: int = 0
    return_tokens: bool = False
    include_usage: bool = False
    n: int = 1                                     # choices (OpenAI's n), each its own sampler stream
    grammar: tuple[str, object, str] | None = None  # (kind, spec, field): constrained output (constrain.py)
    tools: object = None                           # server/tools.py Tools: the functions offered (chat)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias; -inf: never)
    template_vars: dict = field(default_factory=dict)  # (chat) variable -> (value, the field that set it)
    reasoning_format: str | None = None            # (chat) llama-server's: auto / deepseek / none (None: the server's)
    draft_max: int | None = None                   # llama-server's speculative.n_max: drafts a step at most
                                                   # (--mtp; 0: none; None: the server's --draft)


def _sampling(f: Fields) -> SamplingParams:
    seed = f.integer("seed", None)
    return SamplingParams(
        temperature=f.num("temperature", 0.8, lo=0.0),
        top_k=f.integer("top_k", 40, lo=0),
        top_p=f.num("top_p", 0.95, lo=0.0, hi=1.0, lo_open=True),
        min_p=f.num("min_p", 0.05, lo=0.0, hi=1.0),
        repeat_penalty=f.num("repeat_penalty", 1.0, lo=0.0, lo_open=True),
        repeat_last_n=f.integer("repeat_last_n", 64, lo=0),
        seed=None if seed is None or seed < 0 else seed)         # -1: random, as llama-server


def _limit(f: Fields, name: str, max_tokens: int, allow_minus_one: bool) -> int | None:
    v = f.integer(name, None, lo=-1 if allow_minus_one else 0, hi=max_tokens, hint=" (the server's --max-tokens)")
    return None if v is None or v < 0 else v


def _empty(v) -> bool:
    return v in (None, "", [], {})


def _one_of(*noop):
    return lambda v: v is None or v in noop


# Fields whose meaning we do not implement yet, with the test of their no-op value and what to say.
# llama-server's sampler extras are refused on every route, as llama-server reads them on all of them.
_LLAMA_REFUSED = {
    "mirostat": (_one_of(0), "(mirostat sampling) is not supported; send 0 or leave it out"),
    "typical_p": (_one_of(1, 1.0), "(locally typical sampling) is not supported; send 1 or leave it out"),
    "tfs_z": (_one_of(1, 1.0), "(tail-free sampling) is not supported; send 1 or leave it out"),
    "dry_multiplier": (_one_of(0, 0.0), "(DRY repetition penalty) is not supported; send 0 or leave it out"),
    "xtc_probability": (_one_of(0, 0.0), "(XTC sampling) is not supported; send 0 or leave it out"),
    "top_n_sigma": (lambda v: v is None or (isinstance(v, (int, float)) and v <= 0),
                    "(top-n-sigma sampling) is not supported; send -1 or leave it out"),
    "dynatemp_range": (_one_of(0, 0.0), "(dynamic temperature) is not supported; send 0 or leave it out"),
    "samplers": (_empty, "(a custom sampler order) is not supported; the order is top_k, top_p, min_p, "
                         "temperature"),
    "n_indent": (_one_of(0), "is not supported; send 0 or leave it out"),
    "penalize_nl": (_one_of(False), "is not supported: newlines are penalized as other tokens"),
    "min_keep": (_one_of(0), "is not supported; send 0 or leave it out"),
    "n_cmpl": (_one_of(1), "must be 1: one completion per request is supported"),
    "t_max_predict_ms": (_one_of(0), "(a time limit on generation) is not supported; send 0 or leave it out"),
    "image_data": (_empty, "(images) is not supported: the models served here read text only"),
    "multimodal_data": (_empty, "(images, audio) is not supported: the models served here read text only"),
    "lora": (_empty, "(LoRA adapters) is not supported"),
    "post_sampling_probs": (_one_of(False), "is not supported: probabilities are the model's, before sampling"),
    "response_fields": (_empty, "is not supported: the full response is returned"),
    "presence_penalty": (_one_of(0, 0.0), "is not supported (use repeat_penalty); send 0 or leave it out"),
    "frequency_penalty": (_one_of(0, 0.0), "is not supported (use repeat_penalty); send 0 or leave it out"),
}
_OPENAI_REFUSED: dict = {}
MAX_CHOICES = 16     # n: choices of one request
_CHAT_REFUSED = {
    "functions": (_empty, "(legacy function calling) is not supported; use 'tools'"),
    "function_call": (_one_of("none", "auto"), "(legacy function calling) is not supported; use 'tool_choice'"),
    "modalities": (lambda v: v is None or v == ["text"], "must be [\"text\"]: only text output is supported"),
    "audio": (_empty, "(audio output) is not supported"),
    "web_search_options": (_empty, "(web search) is not supported"),
}
_COMPLETIONS_REFUSED = {
    "best_of": (_one_of(1), "must be 1: one completion per request is supported"),
    "echo": (_one_of(False), "(the prompt echoed back) is not supported; send false or leave it out"),
    "suffix": (_empty, "(insertion) is not supported"),
}
REFUSED = {"llama": _LLAMA_REFUSED, "completions": {**_LLAMA_REFUSED, **_OPENAI_REFUSED, **_COMPLETIONS_REFUSED},
           "chat": {**_LLAMA_REFUSED, **_OPENAI_REFUSED, **_CHAT_REFUSED}}


def _refuse(f: Fields, route: str) -> None:
    for name, (noop, why) in REFUSED[route].items():
        v = f.body.get(name)
        if not noop(v):
            raise bad(name, why)


def _logit_bias(f: Fields) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias in [-100, 100]} or llama-server's [[id, bias or false], ...]
    (false: never generated); ids as integers or their decimal strings."""
    v = f.body.get("logit_bias")
    if _empty(v):
        return ()
    pairs = list(v.items()) if isinstance(v, dict) else v
    if not isinstance(pairs, list):
        raise bad("logit_bias", "must be an object {token id: bias} or a list of [token id, bias] pairs")
    out: dict[int, float] = {}
    for p in pairs:
        if not (isinstance(p, (list, tuple)) and len(p) == 2):
            raise bad("logit_bias", "must be an object {token id: bias} or a list of [token id, bias] pairs")
        k, b = p
        if isinstance(k, str) and k.strip().lstrip("-").isdigit():
            k = int(k)
        if isinstance(k, bool) or not isinstance(k, int):
            raise bad("logit_bias", f"keys must be token ids (integers), got {json.dumps(k)}")
        if b is False:
            out[k] = -math.inf
        elif isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or abs(b) > 100:
            raise bad("logit_bias", f"values must be numbers from -100 to 100 (or false), got {json.dumps(b)}")
        else:
            out[k] = float(b)
    if len(out) > 1024:
        raise bad("logit_bias", f"takes at most 1024 tokens, got {len(out)}")
    return tuple(out.items())


def _grammar(f: Fields, openai: bool) -> tuple[str, object, str] | None:
    """The request's output constraint: llama-server's `grammar` (GBNF) or
    `json_schema`, or OpenAI's `response_format` (json_object, json_schema)."""
    found: list[tuple[str, object, str]] = []
    g = f.body.get("grammar")
    if not _empty(g):
        if not isinstance(g, str):
            raise bad("grammar", "must be a GBNF grammar (a string)")
        found.append(("gbnf", g, "grammar"))
    js = f.body.get("json_schema")
    if not _empty(js):
        if not isinstance(js, dict):
            raise bad("json_schema", "must be a JSON schema (an object)")
        found.append(("json_schema", js, "json_schema"))
    rf = f.body.get("response_format")
    if openai and rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise bad("response_format", "must be an object with a 'type' (text, json_object, json_schema)")
        kind = rf["type"]
        if kind == "json_object":
            found.append(("json", None, "response_format"))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict):
                raise bad("response_format.json_schema", "must be an object with a 'schema'")
            schema = spec.get("schema", {"type": "object"} if spec.get("strict") is not True else None)
            if not isinstance(schema, dict):
                raise bad("response_format.json_schema.schema", "must be a JSON schema (an object)")
            found.append(("json_schema", schema, "response_format.json_schema.schema"))
        elif kind != "text":
            raise bad("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
    if len(found) > 1:
        raise bad(found[1][2], f"cannot be combined with '{found[0][2]}': one output constraint a request")
    return found[0] if found else None


def _prompt(f: Fields, n_vocab: int) -> str | list[int]:
    v = f.body.get("prompt")
    if v is None:
        raise bad("prompt", "is required")
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]                                   # OpenAI: a batch of one prompt
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and all(isinstance(t, str) for t in v):
        raise bad("prompt", "holds several prompts; send one per request")
    return Fields({"prompt": v}).token_ids("prompt", n_vocab)    # (a batch of one: the inner list)


def completion(body: dict, n_vocab: int, max_tokens: int) -> Generation:
    """llama-server's /completion."""
    f = Fields(body)
    _refuse(f, "llama")
    return Generation(
        prompt=_prompt(f, n_vocab), max_tokens=_limit(f, "n_predict", max_tokens, True),
        sampling=_sampling(f), stop=f.stop(), stream=f.flag("stream", False),
        n_probs=f.integer("n_probs", 0, lo=0, hi=20), ignore_eos=f.flag("ignore_eos", False),
        cache_prompt=f.flag("cache_prompt", True), truncate=f.flag("truncate", False),
        n_keep=f.integer("n_keep", 0, lo=-1), return_tokens=f.flag("return_tokens", False),
        grammar=_grammar(f, openai=False), logit_bias=_logit_bias(f), draft_max=_draft_max(f))


def _stream_options(f: Fields) -> bool:
    so = f.body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise bad("stream_options", "must be an object")
    return Fields(so, "stream_options.").flag("include_usage", False)


def _openai_common(f: Fields, max_tokens: int) -> dict:
    mt = _limit(f, "max_tokens", max_tokens, False)
    if f.body.get("max_completion_tokens") is not None:
        mt = _limit(f, "max_completion_tokens", max_tokens, False)
    return dict(max_tokens=mt, sampling=_sampling(f), stop=f.stop(), stream=f.flag("stream", False),
                n=f.integer("n", 1, lo=1, hi=MAX_CHOICES), grammar=_grammar(f, openai=True),
                logit_bias=_logit_bias(f),
                include_usage=_stream_options(f), ignore_eos=f.flag("ignore_eos", False),
                cache_prompt=f.flag("cache_prompt", True), truncate=f.flag("truncate", False),
                n_keep=f.integer("n_keep", 0, lo=-1), draft_max=_draft_max(f))


def _draft_max(f: Fields) -> int | None:
    """llama-server's `speculative.n_max` (a flat key with a dot): the drafts a
    step at most for this request under --mtp (0: none); it changes the speed,
    never the tokens."""
    return f.integer("speculative.n_max", None, lo=0)


def openai_completion(body: dict, n_vocab: int, max_tokens: int) -> Generation:
    f = Fields(body)
    _refuse(f, "completions")
    # llama-server's default max_tokens (none: up to the limits), not OpenAI's legacy 16
    return Generation(prompt=_prompt(f, n_vocab), n_probs=f.integer("logprobs", 0, lo=0, hi=20),
                      **_openai_common(f, max_tokens))


def chat_completion(body: dict, max_tokens: int) -> Generation:
    f = Fields(body)
    _refuse(f, "chat")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(name, "must be an object with 'role' and 'content'")
        mf = Fields(m, name + ".")
        role = mf.required_text("role")
        content = m.get("content")
        if isinstance(content, list):              # [{"type": "text", "text": ...}, ...]
            parts = []
            for j, part in enumerate(content):
                pf = Fields(part if isinstance(part, dict) else {}, f"{name}.content[{j}].")
                if not isinstance(part, dict) or pf.required_text("type") != "text":
                    raise bad(f"{name}.content[{j}]", "must be a text part: only text is supported")
                parts.append(pf.required_text("text"))
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise bad(name + ".content", "must be a string or a list of text parts")
        if not _empty(m.get("function_call")):
            raise bad(f"{name}.function_call", "(legacy function calling) is not supported; use 'tool_calls'")
        msg = {"role": role, "content": content}
        for key in ("name", "tool_call_id"):          # (for the chat template, which may render them)
            extra = mf.text(key)
            if extra is not None:
                msg[key] = extra
        out.append(msg)
    n_probs = 0
    if f.flag("logprobs", False):
        n_probs = max(1, f.integer("top_logprobs", 1, lo=0, hi=20))
    from . import tools as tool_calls
    offered = tool_calls.parse(body)
    common = _openai_common(f, max_tokens)
    if offered is not None and offered.choice != "auto":
        if common["grammar"] is not None:
            raise bad("tool_choice", f"cannot be combined with '{common['grammar'][2]}': one output constraint a "
                                     "request")
        common["grammar"] = ("lark", tool_calls.lark_grammar(offered), "tool_choice")
    from .reasoning import MODES
    rf = f.body.get("reasoning_format")
    if rf is not None and rf not in MODES:
        raise bad("reasoning_format", f"must be {', '.join(MODES[:-1])} or {MODES[-1]}")
    return Generation(messages=tool_calls.history(out, msgs), n_probs=n_probs, tools=offered,
                      template_vars=_template_vars(f), reasoning_format=rf, **common)


# variables the server gives every chat template itself (chat_template_kwargs may not set them)
_TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
REASONING_EFFORTS = ("minimal", "low", "medium", "high")


def _template_vars(f: Fields) -> dict[str, tuple[object, str]]:
    """llama-server's chat_template_kwargs (variables for the chat template, e.g.
    Qwen3's enable_thinking) and OpenAI's reasoning_effort (the variable of that
    name: gpt-oss's template reads it); whether the model's template reads them
    is checked where it is rendered (app.py), a 400 when it does not."""
    kw = f.body.get("chat_template_kwargs")
    out: dict[str, tuple[object, str]] = {}
    if kw is not None:
        if not isinstance(kw, dict):
            raise bad("chat_template_kwargs", "must be an object of template variables")
        for k in kw:
            if not isinstance(k, str) or not k.isidentifier():
                raise bad("chat_template_kwargs", f"holds {k!r}, which is not a template variable name")
            if k in _TEMPLATE_OWN:
                raise bad("chat_template_kwargs", f"may not set {k!r}: the server renders it from the request")
        out.update({k: (v, "chat_template_kwargs") for k, v in kw.items()})
    effort = f.body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)}")
        out["reasoning_effort"] = (effort, "reasoning_effort")
    return out


MAX_EMBEDDING_INPUTS = 2048


@dataclass
class Embeddings:
    """A validated embeddings request (/v1/embeddings, llama-server's /embedding)."""
    inputs: list[str | list[int | str]]     # each: text, token ids, or ids and text mixed (llama-server)
    oai: bool                               # OpenAI's response shape (not when llama-server's "content" came)
    base64: bool = False
    normalize: int = 2                      # llama-server's embd_normalize


def _embedding_input(v, name: str, n_vocab: int) -> str | list[int | str]:
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and all((isinstance(t, int) and not isinstance(t, bool)) or isinstance(t, str)
                                         for t in v):
        for t in v:
            if isinstance(t, int) and not 0 <= t < n_vocab:
                raise bad(name, f"holds token id {t}, outside the vocabulary 0..{n_vocab - 1}")
        return v
    raise bad(name, "must be a string, a list of token ids, or a list of those")


def embeddings(body: dict, n_vocab: int, n_embd: int, oai_route: bool) -> Embeddings:
    """OpenAI's /v1/embeddings (input, encoding_format, dimensions) and llama-server's
    /embedding (content; embd_normalize): its inputs as llama-server reads them, a
    string, token ids (ids and strings mixed), or a list of those."""
    f = Fields(body)
    name = "input" if "input" in body else "content"
    v = body.get(name)
    if v is None:
        raise bad("input", "or 'content' is required")
    if isinstance(v, list) and not v:
        raise bad(name, "must not be empty")
    # a list holding a token id is one prompt (ids, or ids and text mixed); else a list of prompts
    one = not isinstance(v, list) or any(isinstance(p, int) and not isinstance(p, bool) for p in v)
    parts = [v] if one else v
    if len(parts) > MAX_EMBEDDING_INPUTS:
        raise bad(name, f"holds {len(parts)} inputs; at most {MAX_EMBEDDING_INPUTS} a request")
    inputs = [_embedding_input(p, f"{name}[{i}]" if len(parts) > 1 else name, n_vocab) for i, p in enumerate(parts)]
    fmt = f.text("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad("encoding_format", f"must be float or base64, got {fmt!r}")
    dims = f.integer("dimensions", None, lo=1)
    if dims is not None and dims != n_embd:
        raise bad("dimensions", f"is not supported: this model's embeddings have {n_embd} dimensions "
                                "(leave it out, or give that)")
    norm = f.integer("embd_normalize", 2, lo=-1)
    return Embeddings(inputs, oai=oai_route and name == "input", base64=fmt == "base64", normalize=norm)
