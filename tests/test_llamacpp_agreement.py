"""Issue 3 against the real llama-server (release 11434, CPU) on the embedded
SmolLM2-135M Q4_1: our tokenizer gives llama.cpp's ids, and our greedy tokens
are llama.cpp's. The server is the session fixture from conftest.py."""
from __future__ import annotations

import pytest

from parity.engine_side import eog_ids
from parity.figures import NEAR_TIE_NATS, first_divergence, pick_margin, top2_margin
from parity.reference import piece_bytes
from vkengine.serving.generate import generate

pytestmark = pytest.mark.slow

# (id, text) or (id, chat messages rendered with the model's template)
TEXTS = [
    ("ascii", "Hello, world! The capital of France is"),
    ("french", "naïve café, déjà vu — résumé à l'œuvre"),
    ("german", "Größenwahn und Übermut auf der Straße"),
    ("russian", "Привет, мир! Как дела?"),
    ("japanese", "日本語のテキストを分割します。東京は日本の首都です。"),
    ("chinese", "中文分词测试：北京是中国的首都。"),
    ("korean", "한국어 문장도 확인합니다."),
    ("arabic-hebrew", "مرحبا بالعالم and שלום עולם"),
    ("emoji", "Emoji: 😀🎉👍🏽 and the family 👨‍👩‍👧‍👦!"),
    ("digits", "Digits 1234567890, 3.14159, -42 and 1e-9"),
    ("long-digits", "A long run: 12345678901234567890123456789012345678901234567890"),
    ("whitespace-runs", "Whitespace   runs      and  spaces     at the end   "),
    ("tabs", "col1\tcol2\t\tcol3\n\t\tindented with tabs"),
    ("crlf", "CRLF line\r\nendings\r\n\r\nhere\r\n"),
    ("newlines", "\n\n\nleading newlines and trailing\n\n"),
    ("only-spaces", "      "),
    ("python", 'def f(x):\n    return {"a": [x ** 2 for x in range(10)]}\n'),
    ("c", 'if (a != b && c <= d) { printf("%d\\n", x); }'),
    ("url", "See https://example.com/path?q=1&r=two#frag or mail me@example.org"),
    ("contractions", "Don't, I'll, we're, they've, she'd, it's; DON'T SHOUT"),
    ("math", "∑_{i=1}^{n} i² = n(n+1)/2 ≈ ∞, x ≤ y ≠ z"),
    ("unicode-spaces", "zero\u200bwidth and non\u00a0breaking space"),
    ("specials-raw", "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"),
    ("chat-single", [{"role": "user", "content": "What is 2+2? Answer briefly."}]),
    ("chat-multi", [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Name a colour."},
                    {"role": "assistant", "content": "Blue."},
                    {"role": "user", "content": "Another, in French: « vert » ?"}]),
]


@pytest.mark.parametrize("text", [t for _, t in TEXTS], ids=[i for i, _ in TEXTS])
def test_tokenizer_matches_llama_server(text, smollm2, reference_client):
    tok = smollm2.tokenizer
    if isinstance(text, list):
        text = tok.apply_chat_template(text, add_generation_prompt=True)
    for add_special in (True, False):
        ours = tok.encode(text, add_special=add_special)
        theirs = reference_client.tokenize(text, add_special=add_special)
        assert ours == theirs, (f"add_special={add_special}: first difference at {first_divergence(ours, theirs)}"
                                f"\nours   {ours}\ntheirs {theirs}")
    # and both sides read the ids back as the same text
    assert tok.decode(theirs) == reference_client.detokenize(theirs)


def test_special_tokens_are_single_ids(smollm2, reference_client):
    ids = reference_client.tokenize("<|im_start|>", add_special=False)
    assert len(ids) == 1 and smollm2.tokenizer.encode("<|im_start|>", add_special=False) == ids


def test_greedy_tokens_match_llama_server(smollm2, smollm2_engine, reference_client):
    """16 greedy tokens for "The capital of France is" from the same ids, through
    `generate`. They must equal llama.cpp's, except at near ties: where they
    differ, llama.cpp must put our token within NEAR_TIE_NATS of its own, and
    after re-anchoring (feed llama.cpp's token, generate again) the rest must
    follow the same rule.

    Measured (llama.cpp 11434 CPU, lavapipe): two flips. Token 5: ours
    " answer" (2988), llama.cpp " United" (1797), which llama.cpp puts 0.36
    nats apart in its default mode and 0.27 in `-fa off -b 64 -ub 64`; a
    float64 numpy forward pass over the same GGUF weights gives " answer" by
    0.22 nats (logprobs -3.209 vs -3.429), as our engine does (-3.209 vs
    -3.428), so this flip is llama.cpp's 8-bit activation quantization. After
    re-anchoring, token 14: ours "1", llama.cpp "2", 0.06 nats apart in
    llama.cpp."""
    text = "The capital of France is"
    tok = smollm2.tokenizer
    ids = reference_client.tokenize(text, add_special=True)
    assert ids == tok.encode(text, add_special=True)
    anchor = reference_client.tokenize(".", add_special=False)[0]
    ref = reference_client.complete(ids, 16, 8, piece_bytes(tok), anchor)
    eog = eog_ids(tok)
    flips, start = [], 0
    while start < 16:
        ours = [s.token for s in generate(smollm2_engine, ids + ref.tokens[:start], 16 - start, ignore_eos=True)]
        assert not eog & set(ours), "an end-of-generation token: llama.cpp bans those under ignore_eos"
        d = first_divergence(ours, ref.tokens[start:])
        if d is None:
            break
        d += start
        ours_tok = ours[d - start]
        flips.append((d, ours_tok, ref.tokens[d], pick_margin(ref.top[d], ours_tok), top2_margin(ref.top[d])))
        start = d + 1                                   # re-anchor on llama.cpp's token
    report = "; ".join(f"token {d}: ours {o} {tok.decode([o])!r}, llama.cpp {r} {tok.decode([r])!r}, "
                       f"our token {m} nats below llama.cpp's top-1 (top-2 margin {m2})"
                       for d, o, r, m, m2 in flips)
    print(f"greedy 16 vs llama.cpp: {len(flips)} flip(s) {report}")
    assert all(m is not None and m < NEAR_TIE_NATS for _, _, _, m, _ in flips), report
