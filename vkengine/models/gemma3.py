"""Gemma 3 (text; gemma2.py names Gemma 2, which is this graph with soft-caps
and no q/k norms): llama.cpp's src/models/gemma3.cpp and gemma2.cpp,
transformers' Gemma3ForCausalLM / Gemma2ForCausalLM.

Per layer: RMSNorm, q/k/v (Gemma 3: a per-head RMSNorm of q and k), NEOX RoPE
with the layer kind's base (sliding-window layers: rope.freq_base_swa, 10000
unless the file says; global layers: rope.freq_base, with the file's linear
scaling), attention scaled by query_pre_attn_scalar^-0.5 (llama.cpp: 1/sqrt(head
size), 1/sqrt(n_embd / n_head) for the 27B models) over the last `window`
positions on sliding-window layers (a query at p sees p - window + 1 .. p, as
llama.cpp's LLAMA_SWA_TYPE_STANDARD and transformers' masks), Gemma 2's score
soft-cap; the attention output RMSNormed before its residual add; RMSNorm, a
GELU(tanh)-gated FFN, its output RMSNormed before its residual add. Embeddings
times sqrt(n_embd), the final norm, the tied (or separate) output, Gemma 2's
logit soft-cap.

Sliding-window layers: every layer i with i % pattern < pattern - 1 (Gemma 3:
pattern 6, global layers 5, 11, ...; Gemma 2: 2, global layers odd), or the
file's per-layer list. Their KV rows are kept for the whole context as the
global layers' are (attention reads only the window).

Hugging Face folders: Gemma3ForCausalLM (270M, 1B) and the text model of a
Gemma3ForConditionalGeneration folder (4B and up; its vision tower is not
read: images are not supported).

Norm weights: GGUF files hold 1 + w (llama.cpp's converter adds the 1 that
Gemma's RMSNorm adds at run time); a Hugging Face folder's get it added here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..arena import Arena
from ..errors import VkEngineError
from ..gguf_file import ModelFile, SafetensorsFolder
from ..graph import Graph
from ..kernels import Matrix, Region
from ..rope import rope_table
from .base import Architecture, PartLayers, SlidingWindowArgs
from .loader import WeightPlanner, built, plan_ends

HF_NAMES = {
    r"model\.embed_tokens\.weight": "token_embd.weight",
    r"model\.norm\.weight": "output_norm.weight",
    r"lm_head\.weight": "output.weight",
    r"model\.layers\.(\d+)\.input_layernorm\.weight": r"blk.\1.attn_norm.weight",
    r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight": r"blk.\1.attn_q.weight",
    r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight": r"blk.\1.attn_k.weight",
    r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight": r"blk.\1.attn_v.weight",
    r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight": r"blk.\1.attn_output.weight",
    r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight": r"blk.\1.attn_q_norm.weight",
    r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight": r"blk.\1.attn_k_norm.weight",
    # Gemma's post_attention_layernorm is the attention output's norm, not the FFN's input norm
    r"model\.layers\.(\d+)\.post_attention_layernorm\.weight": r"blk.\1.post_attention_norm.weight",
    r"model\.layers\.(\d+)\.pre_feedforward_layernorm\.weight": r"blk.\1.ffn_norm.weight",
    r"model\.layers\.(\d+)\.post_feedforward_layernorm\.weight": r"blk.\1.post_ffw_norm.weight",
    r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight": r"blk.\1.ffn_gate.weight",
    r"model\.layers\.(\d+)\.mlp\.up_proj\.weight": r"blk.\1.ffn_up.weight",
    r"model\.layers\.(\d+)\.mlp\.down_proj\.weight": r"blk.\1.ffn_down.weight",
    # mapped so that a checkpoint with them is refused rather than loaded without them
    r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.bias": r"blk.\1.attn_\2.bias",
}
# Gemma3ForConditionalGeneration folders (4B and up): the text model's tensors under model.language_model.
# (transformers 5) or language_model.model. (4.x), the vision tower's left out
_MM_PREFIX = r"(?:model\.language_model\.|language_model\.model\.|model\.)"
HF_NAMES_MM = {(_MM_PREFIX + k[len(r"model\."):] if k.startswith(r"model\.") else r"(?:language_model\.)?" + k): v
               for k, v in HF_NAMES.items()}
UNREAD_TENSORS = ("blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias", "blk.0.attn_o.bias",
                  "blk.0.attn_output.bias")

# llama.cpp's model sizes by layer count whose attention scale is 1/sqrt(n_embd / n_head) (the 27B models)
_SCALE_BY_WIDTH = {"gemma2": 46, "gemma3": 62}


@dataclass(frozen=True, kw_only=True)
class GemmaArgs(SlidingWindowArgs):
    n_ff: int
    rope_freq_scale: float           # global layers' linear scaling (1 / factor)
    rope_base_swa: float             # sliding-window layers' RoPE (base, scale)
    rope_freq_scale_swa: float
    attn_scale: float
    attn_softcap: float = 0.0        # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float = 0.0       # Gemma 2: logits likewise
    qk_norm: bool = False            # Gemma 3

    @property
    def embd_scale(self) -> float:
        return math.sqrt(self.n_embd)


def swa_pattern(n_layer: int, period: int) -> tuple[bool, ...]:
    """llama.cpp's llama_hparams::set_swa_pattern (dense_first false)."""
    return tuple(period == 0 or i % period < period - 1 for i in range(n_layer))


def hf_layer_kinds(c: dict, n_layer: int, period: int) -> tuple[bool, ...]:
    """Which layers slide, from a transformers config: its layer_types
    ("sliding_attention" / "full_attention"), else llama.cpp's pattern of `period`."""
    if not c.get("layer_types"):
        return swa_pattern(n_layer, period)
    swa = tuple(t == "sliding_attention" for t in c["layer_types"])
    if len(swa) != n_layer:
        raise VkEngineError(f"layer_types lists {len(swa)} layers for {n_layer}")
    return swa


def _hf_args(mf: SafetensorsFolder, arch: str) -> GemmaArgs:
    c = mf.config.get("text_config") or mf.config    # (a multimodal folder: its text model's config)
    n_head = int(c["num_attention_heads"])
    n_layer = int(c["num_hidden_layers"])
    hd = int(c.get("head_dim") or 256)
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise VkEngineError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    window = int(c.get("sliding_window") or 0)
    swa = hf_layer_kinds(c, n_layer, 2 if arch == "gemma2" else int(c.get("sliding_window_pattern") or 6))
    base = float(c.get("rope_theta", 10000.0 if arch == "gemma2" else 1e6))
    base_swa = float(c.get("rope_local_base_freq", 10000.0)) if arch == "gemma3" else base
    scaling = c.get("rope_scaling")
    rp = c.get("rope_parameters")
    if isinstance(rp, dict) and "full_attention" in rp:   # (newer transformers: per layer kind)
        full, slide = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
        base = float(full.get("rope_theta", base))
        base_swa = float(slide.get("rope_theta", base_swa))
        scaling = full if full.get("rope_type", "default") != "default" else None
        if slide.get("rope_type", "default") != "default":
            raise VkEngineError(f"RoPE scaling of the sliding-window layers ({slide}) is not supported")
    scale = 1.0
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "linear":
            raise VkEngineError(f"rope_scaling {scaling} is not supported (linear)")
        scale = 1.0 / float(scaling["factor"])
    qpas = float(c.get("query_pre_attn_scalar") or hd)
    return GemmaArgs(
        n_vocab=int(c["vocab_size"]), n_embd=int(c["hidden_size"]), n_layer=n_layer, n_ff=int(c["intermediate_size"]),
        n_head=n_head, n_head_kv=int(c.get("num_key_value_heads") or n_head), head_dim=hd, n_rot=hd,
        rope_base=base, rope_freq_scale=scale, rope_base_swa=base_swa,
        rope_freq_scale_swa=1.0 if arch == "gemma3" else scale, rms_eps=float(c.get("rms_norm_eps", 1e-6)),
        n_ctx_train=int(c.get("max_position_embeddings", 131072 if arch == "gemma3" else 8192)), window=window,
        swa=swa if window else
        (False,) * n_layer, attn_scale=qpas ** -0.5,
        attn_softcap=float(c.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(c.get("final_logit_softcapping") or 0.0), qk_norm=mf.has("blk.0.attn_q_norm.weight"))


def _gguf_args(mf: ModelFile, arch: str) -> GemmaArgs:
    a, m = mf.arch, mf.meta
    n_embd = int(m(f"{a}.embedding_length"))
    n_head = int(m(f"{a}.attention.head_count"))
    n_layer = int(m(f"{a}.block_count"))
    hd = int(m(f"{a}.attention.key_length", n_embd // n_head))
    st = m(f"{a}.rope.scaling.type", None)
    if st not in (None, "none", "linear"):
        raise VkEngineError(f"RoPE scaling type {st!r} is not supported (linear only)")
    factor = float(m(f"{a}.rope.scaling.factor", 0.0) or 0.0) if st == "linear" else 0.0
    scale = 1.0 / factor if factor else 1.0
    base = float(m(f"{a}.rope.freq_base", 10000.0))
    if arch == "gemma2":
        window = int(m(f"{a}.attention.sliding_window", 4096))
        default_period, attn_cap, final_cap = 2, float(m(f"{a}.attn_logit_softcapping", 50.0)), \
            float(m(f"{a}.final_logit_softcapping", 30.0))
        base_swa, scale_swa = float(m(f"{a}.rope.freq_base_swa", base)), scale
    else:
        window = int(m(f"{a}.attention.sliding_window", 0) or 0)
        default_period, attn_cap, final_cap = 6, 0.0, float(m(f"{a}.final_logit_softcapping", 0.0))
        base_swa, scale_swa = float(m(f"{a}.rope.freq_base_swa", 10000.0)), 1.0
    pat = m(f"{a}.attention.sliding_window_pattern", None)
    if isinstance(pat, (list, tuple)) or (hasattr(pat, "__len__") and not isinstance(pat, str)):
        swa = tuple(bool(x) for x in pat)
        if len(swa) != n_layer:
            raise VkEngineError(f"{mf.path.name}: sliding_window_pattern lists {len(swa)} layers for {n_layer}")
    else:
        swa = swa_pattern(n_layer, int(pat) if pat is not None else default_period)
    if window <= 0:
        swa = (False,) * n_layer
    attn_scale = 1.0 / math.sqrt(n_embd / n_head if n_layer == _SCALE_BY_WIDTH[arch] else hd)
    n_vocab = m(f"{a}.vocab_size", None) or mf.tensor_info("token_embd.weight")[1][0]
    return GemmaArgs(
        n_vocab=int(n_vocab), n_embd=n_embd, n_layer=n_layer, n_ff=int(m(f"{a}.feed_forward_length")),
        n_head=n_head, n_head_kv=int(m(f"{a}.attention.head_count_kv", n_head)), head_dim=hd,
        n_rot=int(m(f"{a}.rope.dimension_count", hd)), rope_base=base, rope_freq_scale=scale, rope_base_swa=base_swa,
        rope_freq_scale_swa=scale_swa, rms_eps=float(m(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        n_ctx_train=int(m(f"{a}.context_length", 8192)), window=max(window, 0), swa=swa, attn_scale=attn_scale,
        attn_softcap=attn_cap, final_softcap=final_cap, qk_norm=mf.has("blk.0.attn_q_norm.weight"))


@dataclass
class Layer:
    attn_norm: Region
    qkv: list[tuple[Matrix, int]]
    wo: Matrix
    post_attn_norm: Region
    ffn_norm: Region
    gate_up: list[tuple[Matrix, int]]
    down: Matrix
    post_ffw_norm: Region
    rope: Region                         # the layer kind's RoPE table
    q_norm: Region | None = None         # (Gemma 3) in the RoPE tables' buffer (norm_rope_kv binds them)
    k_norm: Region | None = None


@dataclass
class GemmaWeights(PartLayers[Layer]):
    tok_embd: Matrix | None              # (None where a part of a split model does not use it: see
    out_norm: Region | None              # vkengine/models/llama.py LlamaWeights)
    output: Matrix | None
    layers: list[Layer | None]           # (None: a layer another part holds)
    rope: Region                         # the global layers' table
    arena: Arena


def _forward(g: Graph, a: GemmaArgs, w: GemmaWeights) -> None:
    """One step (a part of a split model: its own layers, as llama.py's _forward)."""
    if a.first_part:
        assert w.tok_embd is not None
        g.embed(w.tok_embd, "x", scale=a.embd_scale)
    for i in a.part_layers:
        L = w.layer(i)
        g.rms_norm("x", L.attn_norm, "h")
        if L.q_norm is not None and L.k_norm is not None:
            for m, col in L.qkv:
                g.matmul(m, "h", "qkv", col=col)
            g.norm_rope_kv(i, "qkv", "q", L.rope, L.q_norm, L.k_norm, a.n_head, a.n_head_kv, a.head_dim, a.n_rot,
                           gated=False)
        else:
            g.qkv_rope(i, L.qkv, "h", "qkv", "q", a.n_head, a.n_head_kv, a.head_dim, a.n_rot, True, table=L.rope)
        g.attention(i, "q", "att", a.n_head, a.n_head_kv, a.head_dim, a.attn_scale,
                    window=a.window if a.swa[i] else 0, softcap=a.attn_softcap)
        # x += rms_norm(wo @ att), then h = rms_norm(x) for the FFN
        g.matmul(L.wo, "att", "t")
        g.rms_norm("t", L.post_attn_norm, "h")
        g.add("x", "h", "x")
        g.rms_norm("x", L.ffn_norm, "h")
        for m, col in L.gate_up:
            g.matmul(m, "h", "gu", col=col)
        g.swiglu("gu", "ff", gelu=True)
        g.matmul(L.down, "ff", "t")
        g.rms_norm("t", L.post_ffw_norm, "h")
        g.add("x", "h", "x")
    if g.n_out:
        assert w.out_norm is not None and w.output is not None
        g.rms_norm("x", w.out_norm, "out_h", gather=True)
        g.matmul(w.output, "out_h", "out_logits", no_epilogues=True)
        if a.final_softcap:
            g.softcap("out_logits", a.final_softcap)


def _hf_norm(name: str, v: np.ndarray) -> np.ndarray:
    """Gemma's RMSNorm multiplies by 1 + w: GGUF files hold the sum."""
    return v + np.float32(1.0) if name.endswith("norm.weight") else v


def _load_weights(mf: ModelFile, a: GemmaArgs, device, n_ctx: int) -> GemmaWeights:
    D, F, hd = a.n_embd, a.n_ff, a.head_dim
    p = WeightPlanner(mf, device, hf_value=_hf_norm)
    i_embd, i_onorm, i_out = plan_ends(p, mf, a)
    glob = rope_table(n_ctx, a.n_rot, a.rope_base, a.rope_freq_scale)
    local = rope_table(n_ctx, a.n_rot, a.rope_base_swa, a.rope_freq_scale_swa)
    # both tables and every q/k norm weight in one buffer (norm_rope_kv binds a table and the norms together)
    entries = [("rope table", lambda: glob, glob.size), ("rope table (sliding-window layers)", lambda: local,
                                                          local.size)]
    if a.qk_norm:
        for i in range(a.n_layer):
            for t in ("attn_q_norm", "attn_k_norm"):
                name = f"blk.{i}.{t}.weight"
                entries.append((name, p.value(name, hd), hd))
    i_table = p.vectors(entries)
    layers: list[dict[str, Any] | None] = []
    for i in range(a.n_layer):
        pre = f"blk.{i}."
        if not a.owns(i):
            layers.append(None)
            continue
        layers.append(dict(
            attn_norm=p.vector(pre + "attn_norm.weight", D),
            qkv=p.fused([pre + "attn_q.weight", pre + "attn_k.weight", pre + "attn_v.weight"],
                        [a.n_head * hd, a.n_head_kv * hd, a.n_head_kv * hd], D),
            wo=p.matrix([pre + "attn_output.weight"], [D], a.n_head * hd),
            post_attn_norm=p.vector(pre + "post_attention_norm.weight", D),
            ffn_norm=p.vector(pre + "ffn_norm.weight", D),
            gate_up=p.fused([pre + "ffn_gate.weight", pre + "ffn_up.weight"], [F, F], D),
            down=p.matrix([pre + "ffn_down.weight"], [D], F),
            post_ffw_norm=p.vector(pre + "post_ffw_norm.weight", D)))
    b, arena = p.build(device)
    return GemmaWeights(
        tok_embd=built(b, i_embd), out_norm=built(b, i_onorm), output=built(b, i_out), rope=b[i_table[0]], arena=arena,
        layers=[Layer(attn_norm=b[L["attn_norm"]], qkv=[(b[h], c) for h, c in L["qkv"]], wo=b[L["wo"]],
                      post_attn_norm=b[L["post_attn_norm"]], ffn_norm=b[L["ffn_norm"]],
                      gate_up=[(b[h], c) for h, c in L["gate_up"]], down=b[L["down"]],
                      post_ffw_norm=b[L["post_ffw_norm"]], rope=b[i_table[1 if a.swa[i] else 0]],
                      q_norm=b[i_table[2 + 2 * i]] if a.qk_norm else None,
                      k_norm=b[i_table[3 + 2 * i]] if a.qk_norm else None)
                if L is not None else None for i, L in enumerate(layers)])


class Gemma3(Architecture):
    names: ClassVar[tuple[str, ...]] = ("gemma3",)
    hf_architectures: ClassVar[tuple[str, ...]] = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
    hf_names = HF_NAMES_MM
    kind = "gemma3"
    splittable = True

    def args(self, mf: ModelFile) -> GemmaArgs:
        a = _hf_args(mf, self.kind) if isinstance(mf, SafetensorsFolder) else _gguf_args(mf, self.kind)
        unread = [n for n in UNREAD_TENSORS if mf.has(n)]
        if unread:
            raise VkEngineError(f"{mf.path.name}: {', '.join(unread)} (biases this architecture's graph does not "
                                "apply) are not supported")
        if a.qk_norm != (self.kind == "gemma3"):
            raise VkEngineError(f"{mf.path.name}: {self.kind} {'with' if a.qk_norm else 'without'} "
                                "per-head q/k norms is not supported")
        return a

    def scratch_widths(self, a: GemmaArgs) -> dict[str, Any]:
        if a.fixed_experts:
            raise VkEngineError("--fixed-experts and --experts-log are for the qwen35moe models")
        q = a.n_head * a.head_dim
        return {"x": a.n_embd, "h": a.n_embd, "t": a.n_embd, "qkv": q + 2 * a.n_head_kv * a.head_dim, "q": q,
                "att": q, "gu": 2 * a.n_ff, "ff": a.n_ff, "out_h": a.n_embd, "out_logits": a.n_vocab}

    def load_weights(self, mf: ModelFile, a: GemmaArgs, device, n_ctx: int) -> GemmaWeights:
        return _load_weights(mf, a, device, n_ctx)

    def forward(self, g: Graph, a: GemmaArgs, w: GemmaWeights, hidden_rows: bool = False) -> None:
        if hidden_rows:
            raise VkEngineError("gemma models have no MTP block to feed hidden states to")
        _forward(g, a, w)


ARCHITECTURE = Gemma3()
