"""Qwen3.5 hybrid decoders (llama.cpp architectures `qwen35` and `qwen35moe`;
Hugging Face Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM): layers of Gated
DeltaNet linear attention and gated full attention (by default three linear to
one full), each followed by a SwiGLU FFN or a mixture of experts with a gated
shared expert, and an optional multi-token-prediction (MTP) block.

Sources: llama.cpp src/models/qwen35.cpp, qwen35moe.cpp, delta-net-base.cpp;
Hugging Face modeling_qwen3_5.py / modeling_qwen3_5_moe.py.

Layouts that differ between the two file formats (the loader evens them out):
- RMSNorm weights: HF stores w for x*(1+w); GGUF stores 1+w, except the gated
  norm of the linear-attention block (weight used as is in both).
- HF stores A_log; GGUF stores ssm_a = -exp(A_log).
- Value heads of the linear attention: GGUF orders them tiled over key heads
  (llama.cpp's converter, _LinearAttentionVReorderBase), HF grouped; the
  delta-rule kernel maps heads either way (Args.v_heads_tiled).
- Full attention: q_proj rows are per head [query | gate] in both; RoPE is NEOX
  on the first n_rot dims (Qwen3.5's interleaved M-RoPE, text positions).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ...errors import VkEngineError
from ...gguf_file import ModelFile
from ...graph import Graph
from ...kernels import KVTypes, Matrix, Region
from ...state import HybridState, KVCache
from ..base import Architecture
from .args import HF_NAMES, Qwen35Args
from .weights import FullAttn, Layer, LinearAttn, MoeFfn, Qwen35Weights, load_weights

if TYPE_CHECKING:
    from ...engine import Engine


def _scratch_widths(a: Qwen35Args) -> dict[str, int]:
    D, k = a.n_embd, a.n_expert_used
    w = {"x": D, "h": D}
    if a.rec_layers:   # (dr_sync: the delta rule's counters, where it takes the gated norm)
        w.update(lin=a.lin_width, conv=a.conv_dim, o=a.nv * a.dv, dr_sync=a.nv)
    w.update(aqkv=2 * a.n_head * a.head_dim + 2 * a.n_head_kv * a.head_dim, q=a.n_head * a.head_dim,
             att=a.n_head * a.head_dim)
    if a.moe:
        w.update(rl=a.n_expert, route=2 * k, gu_e=k * 2 * a.n_ff_exp, ff_e=k * a.n_ff_exp, dn_e=k * D,
                 elist=a.n_expert, ecnt=a.n_expert, eblk=2 * k + 1, gu_s=2 * a.n_ff_shexp, ff_s=a.n_ff_shexp, sg=1,
                 rt_sync=1)
        if a.fixed_experts:
            w["rec"] = (len(a.moe_layers) + a.n_nextn) * k
    else:
        w.update(gu=2 * a.n_ff, ff=a.n_ff)
    if a.n_nextn:
        w.update(hn=D, mtp_e=D, mtp_cat=2 * D, mtp_hn=D, mtp_zero=D)
    w.update(out_h=D, out_logits=a.n_vocab)
    return w


# -- the graph ---------------------------------------------------------------------------

def _linear_attn(g: Graph, a: Qwen35Args, L: LinearAttn, layer: int) -> tuple[Matrix, str]:
    """The mixer up to its output projection, which it returns with its input
    (_block adds it to the residual with the post-attention norm fused)."""
    conv_done = False                                         # (the conv1d in qkv's matvec where it can)
    for m, col in L.lin_in:                                   # [qkv | z | beta | alpha]
        if col == 0 and g.matmul_conv(m, "h", "lin", layer, "conv", L.conv, a.conv_dim, a.conv_kernel):
            conv_done = True
            continue
        g.matmul(m, "h", "lin", col=col)
    if not conv_done:
        g.conv1d(layer, "lin", "conv", L.conv, a.conv_dim, a.conv_kernel)
    z_col = a.conv_dim
    b_col = z_col + a.nv * a.dv
    # q and k heads L2-normalized by the delta rule (in its decode kernel, no dispatch of their own), and the
    # gated norm after it there too
    if not g.delta_rule(layer, "conv", "lin", b_col + a.nv, b_col, "o", L.a, L.dt, a.nk, a.nv, a.dk, a.dv,
                        a.v_heads_tiled, qk_norm_eps=1e-6, gnorm=(L.norm, "lin", z_col)):
        g.gated_rms_norm("o", "lin", z_col, L.norm, a.dv, a.nv)
    return L.out, "o"


def _full_attn(g: Graph, a: Qwen35Args, L: FullAttn, layer: int, w: Qwen35Weights) -> tuple[Matrix, str]:
    """As _linear_attn: up to the output projection."""
    for m, col in L.qkv:                                      # [q0 g0 q1 g1 ... | k | v]
        g.matmul(m, "h", "aqkv", col=col)
    g.norm_rope_kv(layer, "aqkv", "q", w.rope, L.q_norm, L.k_norm, a.n_head, a.n_head_kv, a.head_dim, a.n_rot)
    # (the heads' gates in the split decode attention where it runs, else a sigmoid_mul after it)
    if not g.attention(layer, "q", "att", a.n_head, a.n_head_kv, a.head_dim, 1.0 / math.sqrt(a.head_dim),
                       gate=("aqkv", a.head_dim, 2 * a.head_dim)):
        g.head_gate("att", "aqkv", a.head_dim)
    return L.wo, "att"


def _moe(g: Graph, a: Qwen35Args, F: MoeFfn, record_col: int | None, next_norm: Region | None) -> bool:
    """Router logits, the shared expert's gate|up and its gate logit all read h
    (no barrier between them); then the router's top-k beside the shared
    expert's gating, its down projection beside the routed experts' gate|up,
    then their down projection: a GPU decode step's MoE in four groups of
    dispatches (with the fused expert matvecs) where op after op took eight.
    next_norm: the next layer's attention norm, which the routed experts' down
    projection may take (returns whether it did)."""
    k = a.n_expert_used
    record = ("rec", record_col) if record_col is not None else None
    if F.router_f32 is not None:                              # parity mode: fixed-order fp32 logits
        g.moe_route("rl", "route", a.n_expert, k, a.expert_weights_scale, fixed=(F.router_f32, "h"), record=record)
    elif record is None:                                      # (the choice by the logits' matvec where it can)
        assert F.router is not None
        g.router(F.router, "h", "rl", "route", a.n_expert, k, a.expert_weights_scale)
    else:
        assert F.router is not None
        g.matmul(F.router, "h", "rl")
    g.gate_up_swiglu(F.sh_gate_up, "h", "gu_s", "ff_s")      # shared expert, gated by sigmoid(h . w)
    g.matmul(F.sh_gate, "h", "sg")
    if F.router_f32 is None and record is not None:
        g.moe_route("rl", "route", a.n_expert, k, a.expert_weights_scale, record=record)
    g.matmul_gated(F.sh_down, "ff_s", "x", "sg")     # (the gate in its matvec on GPUs' decode steps)
    return g.routed_experts(F.gate_up, F.down, a.n_expert, k, a.n_ff_exp,
                            norm=(next_norm, "h") if next_norm is not None else None)


def _block(g: Graph, a: Qwen35Args, L: Layer, layer: int, w: Qwen35Weights, moe_index: int, h_ready: bool,
           next_norm: Region | None) -> bool:
    """One layer. h_ready: the layer before left h = its attention norm's output
    already. The residual adds that a norm follows take it where the matvec can
    (Graph.matmul_norm: decode steps on GPUs, one dispatch and barrier less;
    elsewhere a matmul and rms_norm as before): the mixer's output projection
    with the post-attention norm and, where next_norm (the next layer's
    attention norm, in this part) is given, a dense FFN's down projection with
    it, or the routed experts' (mul_mv_id's COMBINE, decode rows). Returns
    whether h holds the next layer's normed input."""
    if not h_ready:
        g.rms_norm("x", L.attn_norm, "h")
    if isinstance(L.mixer, LinearAttn):
        w_out, mixed = _linear_attn(g, a, L.mixer, layer)
    else:
        w_out, mixed = _full_attn(g, a, L.mixer, layer, w)
    g.matmul_norm(w_out, mixed, "x", L.post_norm, "h")
    if isinstance(L.ffn, MoeFfn):
        return _moe(g, a, L.ffn, moe_index * a.n_expert_used if a.fixed_experts else None, next_norm)
    g.gate_up_swiglu(L.ffn.gate_up, "h", "gu", "ff")
    if next_norm is None:
        g.matmul(L.ffn.down, "ff", "x", accumulate=True)
        return False
    g.matmul_norm(L.ffn.down, "ff", "x", next_norm, "h")
    return True


def _forward(g: Graph, a: Qwen35Args, w: Qwen35Weights, hidden_rows: bool = False) -> None:
    """One step: g.n token rows through every layer; logits of the g.n_out
    requested rows into out_logits. hidden_rows: also the final-normed hidden
    state of every row into `hn` (the MTP block's input). A part of a split
    model runs its own layers (as llama.py's _forward)."""
    if a.first_part:
        assert w.tok_embd is not None
        g.embed(w.tok_embd, "x")
    h_ready = False
    for i in a.part_layers:
        nxt = w.layer(i + 1).attn_norm if i + 1 in a.part_layers else None
        h_ready = _block(g, a, w.layer(i), i, w, i, h_ready, nxt)
    if not a.last_part:
        return
    assert w.out_norm is not None and w.output is not None
    if hidden_rows:
        g.rms_norm_into("x", w.out_norm, "hn")
    if g.n_out:
        g.rms_norm("x", w.out_norm, "out_h", gather=True)
        g.matmul(w.output, "out_h", "out_logits", no_epilogues=True)


def _forward_mtp(g: Graph, a: Qwen35Args, w: Qwen35Weights, hidden: str, map_off: int,
                 zero_first: bool) -> None:
    """Record one step of the MTP block: row r takes token r and the hidden state
    hidden[params[map_off + r]] (zeros for row 0 when zero_first: position 0 has
    no previous hidden state), and predicts the token after the next
    (llama.cpp qwen35.cpp graph_mtp). Writes its own final-normed hidden state of
    every row to `mtp_hn` (input of the next chained draft)."""
    m = w.mtp
    assert m is not None
    D = a.n_embd
    g.embed(m.embed, "mtp_e")
    g.rms_norm_into("mtp_e", m.enorm, "mtp_cat", col=0)
    g.rms_norm_into(hidden, m.hnorm, "mtp_cat", col=D, rows=g.n, map_off=map_off)
    if zero_first:
        g.rms_norm_into("mtp_zero", m.hnorm, "mtp_cat", col=D, rows=1)
    g.matmul(m.eh_proj, "mtp_cat", "x")
    _block(g, a, m.layer, a.n_layer, w, len(a.moe_layers), False, None)
    g.rms_norm_into("x", m.head_norm, "mtp_hn")
    if g.n_out:
        g.rms_norm("x", m.head_norm, "out_h", gather=True)
        g.matmul(m.head, "out_h", "out_logits", no_epilogues=True)


class Qwen35(Architecture):
    names = ("qwen35", "qwen35moe")
    hf_architectures = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                        "Qwen3_5MoeForConditionalGeneration")
    hf_names = HF_NAMES
    splittable = True

    def args(self, mf: ModelFile) -> Qwen35Args:
        return Qwen35Args.from_file(mf)

    def scratch_widths(self, a: Qwen35Args) -> dict[str, int]:
        return _scratch_widths(a)

    def load_weights(self, mf: ModelFile, a: Qwen35Args, device, n_ctx: int) -> Qwen35Weights:
        return load_weights(mf, a, device, n_ctx)

    def forward(self, g: Graph, a: Qwen35Args, w: Qwen35Weights, hidden_rows: bool = False) -> None:
        _forward(g, a, w, hidden_rows)

    def make_state(self, device, a: Qwen35Args, n_slots: int, n_ctx: int,
                   kv_types: KVTypes = KVTypes(), max_step: int = 0) -> KVCache:
        """KV rows of the attention layers (and the MTP block), conv and recurrent
        states of the linear layers, with snapshot rows for speculative steps."""
        return HybridState(device, n_slots, n_ctx, a.n_head_kv, a.head_dim, a.attn_layers, a.rec_layers,
                           (a.conv_kernel - 1) * a.conv_dim, a.nv * a.dv * a.dk,
                           a.mtp_snap_rows if a.n_nextn else 0, types=kv_types)

    def state_bytes(self, a: Qwen35Args, n_slots: int, n_ctx: int,
                    kv_types: KVTypes = KVTypes(), max_step: int = 0) -> tuple[int, int]:
        per_pos, kv_slot = super().state_bytes(a, n_slots, n_ctx, kv_types)
        rec = 4 * len(a.rec_layers) * ((a.conv_kernel - 1) * a.conv_dim + a.nv * a.dv * a.dk)
        # speculative steps' snapshot rows (a recurrent state each, shared by the slots: spread over them)
        snaps = -(-(a.mtp_snap_rows if a.n_nextn else 0) * rec // max(1, n_slots))
        return per_pos, kv_slot + rec + snaps

    def has_mtp(self, a: Qwen35Args, w: Qwen35Weights) -> bool:
        return a.n_nextn > 0 and w.mtp is not None

    def forward_mtp(self, g: Graph, a: Qwen35Args, w: Qwen35Weights, hidden: str, map_off: int,
                    zero_first: bool) -> None:
        _forward_mtp(g, a, w, hidden, map_off, zero_first)

    def read_expert_choices(self, engine: Engine, n_rows: int, mtp: bool = False) -> np.ndarray:
        return read_expert_choices(engine, n_rows, mtp)


ARCHITECTURE = Qwen35()


def read_expert_choices(engine, n_rows: int, mtp: bool = False) -> np.ndarray:
    """Experts chosen for the first n_rows rows of the engine's last step in the
    fixed-expert mode: uint32 (rows, MoE layers, k) (the MTP block's with mtp=True)."""
    a = engine.args
    if not (isinstance(a, Qwen35Args) and a.moe and a.fixed_experts):
        raise VkEngineError("expert choices are recorded only in the fixed-expert mode of a MoE model")
    s = engine.scratch
    r = s.region("rec")
    stride = s.stride("rec")
    raw = engine.device.download(r.buf, r.off * 4, n_rows * stride * 4, np.uint32).reshape(n_rows, stride)
    k, n_moe = a.n_expert_used, len(a.moe_layers)
    cols = raw[:, : (n_moe + a.n_nextn) * k].reshape(n_rows, n_moe + a.n_nextn, k)
    return cols[:, n_moe:] if mtp else cols[:, :n_moe]
