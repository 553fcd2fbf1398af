"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral-style): RMSNorm, RoPE,
grouped-query attention over the KV cache, SwiGLU, tied or separate output head.

GGUF weights rotate adjacent pairs (llama.cpp's converter permutes Q and K rows:
convert_hf_to_gguf.py LlamaModel.permute); Hugging Face checkpoints rotate split
halves (NEOX). Both load as they are and pick the matching RoPE mode.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from ..arena import Arena, ArenaPlan, packed_words, row_parts, split_limit_words
from ..errors import VkEngineError
from ..gguf_file import ModelFile, SafetensorsFolder
from ..graph import Graph
from ..kernels import Matrix, Region
from ..quant import check_shape, repack, row_slice
from ..rope import rope_table

ARCH = "llama"
HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")

# Hugging Face tensor names -> GGUF names (data; applied when a folder is opened)
HF_NAMES = {
    r"model\.embed_tokens\.weight": "token_embd.weight",
    r"model\.norm\.weight": "output_norm.weight",
    r"lm_head\.weight": "output.weight",
    r"model\.layers\.(\d+)\.input_layernorm\.weight": r"blk.\1.attn_norm.weight",
    r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight": r"blk.\1.attn_q.weight",
    r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight": r"blk.\1.attn_k.weight",
    r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight": r"blk.\1.attn_v.weight",
    r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight": r"blk.\1.attn_output.weight",
    r"model\.layers\.(\d+)\.post_attention_layernorm\.weight": r"blk.\1.ffn_norm.weight",
    r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight": r"blk.\1.ffn_gate.weight",
    r"model\.layers\.(\d+)\.mlp\.up_proj\.weight": r"blk.\1.ffn_up.weight",
    r"model\.layers\.(\d+)\.mlp\.down_proj\.weight": r"blk.\1.ffn_down.weight",
}
_HF_RE = [(re.compile(k + "$"), v) for k, v in HF_NAMES.items()]


def hf_to_gguf_name(name: str) -> str | None:
    for pat, repl in _HF_RE:
        if pat.match(name):
            return pat.sub(repl, name)
    return None


@dataclass(frozen=True)
class LlamaArgs:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float
    rope_freq_scale: float
    rms_eps: float
    n_ctx_train: int
    rope_neox: bool           # True for Hugging Face layout

    @classmethod
    def from_file(cls, mf: ModelFile) -> "LlamaArgs":
        if isinstance(mf, SafetensorsFolder):
            c = mf.config
            n_head = int(c["num_attention_heads"])
            hd = int(c.get("head_dim") or c["hidden_size"] // n_head)
            rs = c.get("rope_scaling") or {}
            scale = 1.0
            if rs:
                if rs.get("rope_type", rs.get("type")) != "linear":
                    raise VkEngineError(f"rope_scaling {rs} is not supported (linear only)")
                scale = 1.0 / float(rs["factor"])
            return cls(
                n_vocab=int(c["vocab_size"]), n_embd=int(c["hidden_size"]), n_layer=int(c["num_hidden_layers"]),
                n_ff=int(c["intermediate_size"]), n_head=n_head,
                n_head_kv=int(c.get("num_key_value_heads") or n_head), head_dim=hd, n_rot=hd,
                rope_base=float(c.get("rope_theta", 10000.0)), rope_freq_scale=scale,
                rms_eps=float(c.get("rms_norm_eps", 1e-6)),
                n_ctx_train=int(c.get("max_position_embeddings", 4096)), rope_neox=True)
        a = mf.arch
        m = mf.meta
        n_embd = int(m(f"{a}.embedding_length"))
        n_head = int(m(f"{a}.attention.head_count"))
        hd = int(m(f"{a}.attention.key_length", n_embd // n_head))
        scale = 1.0
        st = m(f"{a}.rope.scaling.type", None)
        if st not in (None, "none", "linear"):
            raise VkEngineError(f"RoPE scaling type {st!r} is not supported (linear only)")
        if st == "linear":
            scale = 1.0 / float(m(f"{a}.rope.scaling.factor"))
        n_vocab = m(f"{a}.vocab_size", None)
        if n_vocab is None:
            n_vocab = mf.tensor_info("token_embd.weight")[1][0]
        return cls(
            n_vocab=int(n_vocab), n_embd=n_embd, n_layer=int(m(f"{a}.block_count")),
            n_ff=int(m(f"{a}.feed_forward_length")), n_head=n_head,
            n_head_kv=int(m(f"{a}.attention.head_count_kv", n_head)), head_dim=hd,
            n_rot=int(m(f"{a}.rope.dimension_count", hd)), rope_base=float(m(f"{a}.rope.freq_base", 10000.0)),
            rope_freq_scale=scale, rms_eps=float(m(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            n_ctx_train=int(m(f"{a}.context_length", 4096)), rope_neox=False)

    @property
    def qkv_width(self) -> int:
        return (self.n_head + 2 * self.n_head_kv) * self.head_dim

    @property
    def n_kv_heads(self) -> int:
        return self.n_head_kv


@dataclass
class Layer:
    attn_norm: Region
    qkv: list[tuple[Matrix, int]]        # (matrix, first output column): fused or q, k, v
    wo: Matrix
    ffn_norm: Region
    gate_up: list[tuple[Matrix, int]]
    down: Matrix


@dataclass
class LlamaWeights:
    tok_embd: Matrix
    out_norm: Region
    output: Matrix
    layers: list[Layer]
    rope: Region
    arena: Arena


def scratch_widths(a: LlamaArgs) -> dict[str, int]:
    return {"x": a.n_embd, "h": a.n_embd, "qkv": a.qkv_width, "q": a.n_head * a.head_dim,
            "att": a.n_head * a.head_dim, "gu": 2 * a.n_ff, "ff": a.n_ff,
            "out_h": a.n_embd, "out_logits": a.n_vocab,
            "norm_slots": -(-a.n_embd // 4),   # sums of squares per 4 values (Graph.residual_norm)
            # h' as 8-bit blocks for an XQ8 gate|up (Graph._q8_out) and its producer's zeroed counters
            "norm_q8": a.n_embd // 2 + a.n_embd // 16, "norm_q8_sync": -(-a.n_embd // 32)}


def forward(g: Graph, a: LlamaArgs, w: LlamaWeights) -> None:
    """Record one step: g.n token rows through every layer; logits for the
    g.n_out requested rows into out_logits."""
    g.embed(w.tok_embd, "x")
    scale = 1.0 / math.sqrt(a.head_dim)
    # The RMSNorms after the residual adds: split between the add's matvec and
    # the matvecs that read them where they can (Graph.residual_norm: decode
    # steps on GPUs; att_in/ffn_in the sums of squares those take), else fused
    # into the add, else dispatches of their own
    g.rms_norm("x", w.layers[0].attn_norm, "h")
    att_in = None
    for i, L in enumerate(w.layers):
        g.qkv_rope(i, L.qkv, "h", "qkv", "q", a.n_head, a.n_head_kv, a.head_dim, a.n_rot, a.rope_neox,
                   norm_in=att_in)
        g.attention(i, "q", "att", a.n_head, a.n_head_kv, a.head_dim, scale)
        ffn_in = g.residual_norm(L.wo, "att", "x", L.ffn_norm, "h", [L.gate_up], glu_reader=True)
        g.gate_up_swiglu(L.gate_up, "h", "gu", "ff", norm_in=ffn_in)
        if i + 1 < len(w.layers):
            nxt = w.layers[i + 1]
            att_in = g.residual_norm(L.down, "ff", "x", nxt.attn_norm, "h", [nxt.qkv])
        else:
            g.matmul(L.down, "ff", "x", accumulate=True)
    if g.n_out:
        g.rms_norm("x", w.out_norm, "out_h", gather=True)
        g.matmul(w.output, "out_h", "out_logits", no_epilogues=True)


# -- loading ----------------------------------------------------------------------

def _check(mf: ModelFile, name: str, shape: tuple[int, ...]) -> str:
    t, s = mf.tensor_info(name)
    if tuple(s) != tuple(shape):
        raise VkEngineError(f"{mf.path.name}: tensor {name} has shape {s}, expected {shape}")
    return t


def load_weights(mf: ModelFile, a: LlamaArgs, device, n_ctx: int) -> LlamaWeights:
    """Plan, allocate and upload every weight (kept quantized)."""
    D, F, hd = a.n_embd, a.n_ff, a.head_dim
    tied = not mf.has("output.weight")
    plan = ArenaPlan(device.max_buffer_bytes // 4)
    # group, kind (vector | matrix | part | split), names, rows (matrix, part: (first, end); split:
    # [(first row, part item)]), cols, type
    items: list[tuple] = []

    def matrix(names: list[str], rows_each: list[int], cols: int) -> int:
        types = {_check(mf, n, (r, cols)) for n, r in zip(names, rows_each)}
        if len(types) != 1:
            raise VkEngineError(f"internal: mixed types fused: {names}")
        t = types.pop()
        rows = sum(rows_each)
        check_shape(t, rows, cols, names[0])
        spans = row_parts(t, rows, cols, split_limit_words(plan), 1, names[0])
        parts = []
        for r0, r1 in spans:     # one span unless one storage buffer cannot hold the matrix
            vw, sw = packed_words(t, r1 - r0, cols)
            g = plan.add([vw, sw] if sw else [vw], names[0])
            items.append((g, "matrix" if len(spans) == 1 else "part", names, (r0, r1), cols, t))
            parts.append((r0, len(items) - 1))
        if len(parts) > 1:
            items.append((-1, "split", names, parts, cols, t))
        return len(items) - 1

    def vector(name: str, n: int) -> int:
        _, s = mf.tensor_info(name)
        if int(np.prod(s)) != n:
            raise VkEngineError(f"{mf.path.name}: tensor {name} has shape {s}, expected ({n},)")
        g = plan.add([n], name)
        items.append((g, "vector", [name], 1, n, "f32"))
        return len(items) - 1

    def fused(names: list[str], rows_each: list[int], cols: int) -> list[tuple[int, int]]:
        """One matmul when the parts share a type, else one each (with column offsets)."""
        types = [mf.tensor_info(n)[0] for n in names]
        if len(set(types)) == 1:
            return [(matrix(names, rows_each, cols), 0)]
        out, col = [], 0
        for n, r in zip(names, rows_each):
            out.append((matrix([n], [r], cols), col))
            col += r
        return out

    i_embd = matrix(["token_embd.weight"], [a.n_vocab], D)
    i_onorm = vector("output_norm.weight", D)
    i_out = i_embd if tied else matrix(["output.weight"], [a.n_vocab], D)
    freq_factors = mf.tensor("rope_freqs.weight").as_f32() if mf.has("rope_freqs.weight") else None
    table = rope_table(n_ctx, a.n_rot, a.rope_base, a.rope_freq_scale, freq_factors)
    g_rope = plan.add([table.size], "rope table")
    layer_items = []
    for i in range(a.n_layer):
        p = f"blk.{i}."
        layer_items.append(dict(
            attn_norm=vector(p + "attn_norm.weight", D),
            qkv=fused([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                      [a.n_head * hd, a.n_head_kv * hd, a.n_head_kv * hd], D),
            wo=matrix([p + "attn_output.weight"], [D], a.n_head * hd),
            ffn_norm=vector(p + "ffn_norm.weight", D),
            gate_up=fused([p + "ffn_gate.weight", p + "ffn_up.weight"], [F, F], D),
            down=matrix([p + "ffn_down.weight"], [D], F)))

    arena = Arena(device, plan, "device", "weights")
    built: list[Matrix | Region] = []
    for g, kind, names, rows, cols, t in items:
        if kind == "split":               # rows: [(first row, item of the part)], built before it
            built.append(Matrix(t, sum(built[i].rows for _, i in rows), cols, None, None,
                                tuple((r0, built[i]) for r0, i in rows)))
            continue
        regs = arena.regions(g)
        if kind == "vector":
            v = mf.tensor(names[0])
            arr = v.raw.view(np.float32) if v.type == "f32" else v.as_f32().astype(np.float32)
            arena.write(regs[0], arr)
            built.append(regs[0])
            continue
        raw = np.concatenate([mf.tensor(n).raw for n in names]) if len(names) > 1 else mf.tensor(names[0]).raw
        r0, r1 = rows
        if kind == "part":               # rows [r0, r1) of a matrix split across buffers
            raw = row_slice(raw, t, cols, r0, r1)
        values, scales = repack(t, raw, r1 - r0, cols)
        arena.write(regs[0], values)
        if scales is not None:
            arena.write(regs[1], scales)
        built.append(Matrix(t, r1 - r0, cols, regs[0], regs[1] if scales is not None else None))
    rope = arena.regions(g_rope)[0]
    arena.write(rope, table)

    layers = [Layer(attn_norm=built[L["attn_norm"]], qkv=[(built[i], c) for i, c in L["qkv"]],
                    wo=built[L["wo"]], ffn_norm=built[L["ffn_norm"]],
                    gate_up=[(built[i], c) for i, c in L["gate_up"]], down=built[L["down"]])
              for L in layer_items]
    return LlamaWeights(tok_embd=built[i_embd], out_norm=built[i_onorm], output=built[i_out],
                        layers=layers, rope=rope, arena=arena)


Args = LlamaArgs
Weights = LlamaWeights
