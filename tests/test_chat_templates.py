"""The chat templates of the released models of the families we run (Qwen2.5,
Qwen3, Qwen3.5, QwQ, the DeepSeek-R1 distills, Llama 3.x, Gemma 2, Phi-3.5,
gpt-oss, Hermes 2 Pro), as llama.cpp keeps them in models/templates of the 11434
sdist that the parity harness builds, rendered by our jinja2 environment (the
one Hugging Face's apply_chat_template gives templates): a conversation, and one
with tools, a tool call and its reply where the template reads tools. gpt-oss's
dates its system message (strftime_now); Gemma 2's refuses a system role, which
then heads the first user message (as llama.cpp does)."""
from __future__ import annotations

import pytest

from vkengine.tokenizer import Tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city (café's terrace: <sunny> & warm?)",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Weather in Paris?"}]
CALLS = CHAT + [{"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
    "name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21}'}]
# template -> (text its rendering of CHAT must hold, whether it renders tools)
TEMPLATES = {
    "Qwen-Qwen2.5-7B-Instruct": ("<|im_start|>assistant\n", True),
    "Qwen-Qwen3-0.6B": ("<|im_start|>assistant\n", True),
    "Qwen3.5-4B": ("<|im_start|>assistant\n", True),
    "Qwen-QwQ-32B": ("<|im_start|>assistant\n", True),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("<｜Assistant｜>", True),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": ("<｜Assistant｜>", False),
    "meta-llama-Llama-3.1-8B-Instruct": ("<|start_header_id|>assistant<|end_header_id|>", True),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|start_header_id|>assistant<|end_header_id|>", True),
    "meta-llama-Llama-3.3-70B-Instruct": ("<|start_header_id|>assistant<|end_header_id|>", True),
    "google-gemma-2-2b-it": ("<start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>", False),
    "microsoft-Phi-3.5-mini-instruct": ("<|assistant|>", False),
    "openai-gpt-oss-120b": ("Current date: ", True),
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": ("<|im_start|>assistant\n", True),
    # its template takes tool-call ids of 9 letters and digits only: ours (call_ + 24 hex) are shortened for it
    "mistralai-Mistral-Nemo-Instruct-2407": ("[INST]", True),
}


# where a template puts a tool's reply (in its own role: not a polyfill's user turn)
REPLY = {"meta-llama-Llama-3.1-8B-Instruct": "<|start_header_id|>ipython<|end_header_id|>",
         "meta-llama-Llama-3.3-70B-Instruct": "<|start_header_id|>ipython<|end_header_id|>",
         "openai-gpt-oss-120b": "<|start|>functions.get_weather to=assistant",
         "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "<|im_start|>tool\n<tool_response>",
         "Qwen-Qwen3-0.6B": "<|im_start|>user\n<tool_response>"}


@pytest.fixture(scope="module")
def template_dir(llama_server_exe):
    from parity import llamacpp
    if llama_server_exe.parent != llamacpp.default_cache_dir() / "bin":
        pytest.fail("these tests read the templates of the llama.cpp sdist that the parity harness builds "
                    "(VKENGINE_LLAMA_SERVER points elsewhere)")
    return llamacpp.source_tree() / "models" / "templates"


def _tok(template: str) -> Tokenizer:
    return Tokenizer(hf=None, bos_id=None, eos_id=None, add_bos=False, chat_template=template)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_released_templates_render(template_dir, name):
    """(Mistral Nemo's puts the system message in the last user turn.)"""
    want, tools = TEMPLATES[name]
    tok = _tok((template_dir / f"{name}.jinja").read_text(encoding="utf-8"))
    text = tok.apply_chat_template(CHAT)
    assert want in text and "Weather in Paris?" in text and "terse" in text
    if tools:
        text = tok.apply_chat_template(CALLS, tools=TOOLS)
        assert "get_weather" in text and "21" in text
        if name in REPLY:
            assert REPLY[name] in text
        # tojson as Hugging Face's: the description's text as it is (jinja2's own escaped it: caf\\u00e9,
        # \\u0027, \\u003c); the R1 distill's template leaves descriptions out
        if name != "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B":
            assert "café's terrace: <sunny> & warm?" in text


@pytest.mark.parametrize("name", ["google-gemma-2-2b-it", "microsoft-Phi-3.5-mini-instruct",
                                  "deepseek-ai-DeepSeek-R1-Distill-Llama-8B"])
def test_templates_without_tools_take_the_fallback(template_dir, name):
    """Templates that do not read tools get the server's documented fallback (the
    tools in a system message, calls and replies as Hermes-style text); Gemma's,
    which alternates user and model only, then gets the replies as user turns."""
    from server.tools import fallback_messages, parse
    tok = _tok((template_dir / f"{name}.jinja").read_text(encoding="utf-8"))
    tools = parse({"tools": TOOLS})
    text = tok.apply_chat_template(fallback_messages(CALLS, tools))
    assert "get_weather" in text and '"temp": 21' in text and "<tool_response>" in text
