"""Push-constant layouts, declared once per shader: the fields of its GLSL
`P` block, by name and in order (uint -> "I", float -> "f"), plus the fields
some variants append (by the define that adds them). Kernel wrappers pack by
field name (`push_for(variant).pack(x_off=..., ...)`; fields left out are 0),
and tests/test_push.py checks every variant's layout against its shader's
preprocessed source, so the two cannot drift apart."""
from __future__ import annotations

import re
import struct
from functools import cache

from shaders.variants import VARIANTS

_TYPES = {"uint": "I", "float": "f"}


class Push:
    """An ordered list of (name, struct code) of 32-bit push-constant fields."""

    def __init__(self, decl: str):
        """decl: GLSL-like declarations, e.g. "uint x_off, x_stride; float eps"."""
        self.fields: tuple[tuple[str, str], ...] = tuple(
            (name.strip(), _TYPES[kind])
            for part in decl.split(";") if part.strip()
            for kind, names in [part.strip().split(None, 1)]
            for name in names.split(","))
        self.names = tuple(n for n, _ in self.fields)
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"duplicate push-constant field in {decl!r}")
        self._fmt = struct.Struct("<" + "".join(c for _, c in self.fields))
        self._index = {n: i for i, n in enumerate(self.names)}

    def __add__(self, other: Push) -> Push:
        return Push("; ".join(f"{'uint' if c == 'I' else 'float'} {n}" for n, c in self.fields + other.fields))

    @property
    def size(self) -> int:
        return self._fmt.size

    def pack(self, **values) -> bytes:
        unknown = set(values) - set(self._index)
        if unknown:
            raise ValueError(f"push constants {sorted(unknown)} are not fields of this layout ({self.names})")
        vals: list[int | float] = [0] * len(self.fields)
        for n, v in values.items():
            vals[self._index[n]] = v
        return self._fmt.pack(*vals)


# mul_mv.comp / mul_mvk.comp: the matvecs and their fused epilogues. The RoPE words
# carry other offsets in the variants that take no RoPE (see mul_mvk.comp):
#   "pq" (PARTS_Q8): PQ_OFF = rope_row0, PD_OFF = n_q, PC_OFF = n_k, PS_OFF = head_dim, PQ2_OFF = n_rot
#   "nx" (XQ2): XQ2_OFF = rope_row0
_MUL_MV = Push("""uint w_off, w_off2, K, M, N, x_off, x_stride, y_off, y_stride, flags, h_off, h_stride, nw_off,
                  sync_off; float eps; uint rope_row0, n_q, n_k, head_dim, n_rot, table_off, q_off, q_stride,
                  k_off, v_off, slot_stride, kv_row_words, pos_off, slot_off""")
_TILED = Push("uint w_off, w_off2, K, M, N, x_off, x_stride, y_off, y_stride, accumulate")
_ATTN = Push("""uint q_off, q_stride, o_off, o_stride, n_rows, n_head, n_kv, head_dim, k_off, v_off, slot_stride,
                pos_off, slot_off; float scale""")
# sliding-window layers' window (0: none), Gemma 2's score soft-cap (0: none) and the cache's ring (positions a
# slot holds when they wrap: sliding-window layers' bounded caches; 0: none) and where attention sinks are
# (gpt-oss; 0xffffffff: none), after each variant's own
_ATTN_TAIL = Push("uint window; float softcap; uint ring, sink_off")
_MUL_ID = "uint w_off, w_off2, K, M, k"
# the tiled matmuls' expert variant (MUL_ID: mul_tiled_cols.glsl)
_TILED_ID = Push("uint k, list_off, list_stride, cnt_off, blocks_off, x_slot_stride, y_slot_stride")

# by source file: the base layout and the (define, fields) that variants append, in order
LAYOUTS: dict[str, tuple[Push, tuple[tuple[str, Push], ...]]] = {
    "mul_mv.comp": (_MUL_MV, ()),
    "mul_mvk.comp": (_MUL_MV, (("XQ8", Push("uint xq_off, xd_off")), ("NORM_PARTS", Push("uint sq_stride"))),),
    "mul_mt.comp": (_TILED + Push("uint klen, z_stride"), (("MUL_ID", _TILED_ID),)),
    "mul_mc.comp": (_TILED + Push("uint klen, z_stride"), (("MUL_ID", _TILED_ID),)),
    "mul_mc2.comp": (_TILED, ()),
    "reduce_k.comp": (Push("uint parts, z_stride, M, N, y_off, y_stride, accumulate"), ()),
    "quantize_q8.comp": (Push("uint x_off, x_stride, K, rows, q_off, d_off"), ()),
    "to_f16.comp": (Push("uint x_off, x_stride, cols, rows, rows_pad, h_off8, h_stride8"), ()),
    "get_rows.comp": (Push("uint w_off, w_off2, K, n_rows, ids_off, y_off, y_stride; float scale"),
                      (("ROW_PART", Push("uint row_lo, row_hi")),)),
    "rms_norm.comp": (Push("uint x_off, x_stride, y_off, y_stride, w_off, n, rows, map_off; float eps"), ()),
    "rope_kv.comp": (Push("""uint qkv_off, qkv_stride, q_off, q_stride, n_rows, n_head, n_kv, head_dim, n_rot, mode,
                             table_off, k_off, v_off, slot_stride, pos_off, slot_off, ring"""), ()),
    "attention.comp": (_ATTN + Push("uint chunk, n_parts, part_off, sync_off") + _ATTN_TAIL, ()),
    "attention_mc.comp": (_ATTN + _ATTN_TAIL, (("SPLIT", Push("uint n_parts, part_off")),)),
    "attention_mc2.comp": (_ATTN + _ATTN_TAIL, (("SPLIT", Push("uint n_parts, part_off")),)),
    "attention_merge.comp": (Push("uint o_off, o_stride, n_rows, n_head, head_dim, n_parts, part_off, sink_off"), ()),
    "attention_dec.comp": (_ATTN + Push("uint n_parts, min_chunk, part_off, sync_off") + _ATTN_TAIL
                           + Push("uint gate_off, gate_stride, gate_blk"), ()),
    "swiglu.comp": (Push("uint gu_off, gu_stride, y_off, y_stride, F, rows"), (("OAI", Push("float alpha, limit")),)),
    "moe_bias.comp": (Push("uint b_off, M, route_off, route_stride, k, y_off, y_stride, y_slot_stride, rows"), ()),
    "softcap.comp": (Push("uint x_off, x_stride, n, rows; float cap"), ()),
    "mask_logits.comp": (Push("uint x_off, x_stride, n, rows, mask_off, words"), ()),
    "add.comp": (Push("uint a_off, a_stride, b_off, b_stride, y_off, y_stride, n, rows"), ()),
    "add_bias.comp": (Push("uint b_off, y_off, y_stride, n, rows"), ()),
    "softmax.comp": (Push("uint x_off, x_stride, y_off, y_stride, n, rows; float scale"), ()),
    "argmax_part.comp": (Push("uint x_off, x_stride, n, rows, tmp_off, chunk"), ()),
    "argmax.comp": (Push("uint tmp_off, n_chunks, rows, out_off"), ()),
    "topk_part.comp": (Push("uint x_off, x_stride, n, rows, tmp_off, k, samp_off"), ()),
    "sample.comp": (Push("uint tmp_off, n_cand, rows, samp_off, out_off"), ()),
    "copy.comp": (Push("uint src_off, dst_off, n"), ()),
    "conv1d.comp": (Push("""uint x_off, x_stride, y_off, y_stride, w_off, C, K, n_rows, state_off, slot_stride,
                            snap_off, snap_rows, pos_off, slot_off"""), ()),
    "conv1d_rows.comp": (Push("""uint x_off, x_stride, y_off, y_stride, w_off, C, K, n_rows, state_off, slot_stride,
                                 pos_off, slot_off"""), ()),
    "l2_norm.comp": (Push("uint x_off, x_stride, y_off, y_stride, head_dim, n_heads, rows; float eps"), ()),
    "gated_rms_norm.comp": (Push("""uint x_off, x_stride, z_off, z_stride, y_off, y_stride, w_off, head_dim, n_heads,
                                    rows; float eps"""), ()),
    "delta_rule.comp": (Push("""uint q_off, k_off, v_off, qkv_stride, a_off, b_off, ab_stride, o_off, o_stride, nk,
                                nv, dk, dv, n_rows, n_groups, wa_off, wdt_off, state_off, slot_stride, snap_off,
                                snap_rows, pos_off, slot_off, tiled; float scale; uint qk_norm;
                                float qk_eps"""),
                        (("GNORM", Push("uint z_off, z_stride, gw_off, sync_off; float g_eps")),)),
    "delta_chunk.comp": (Push("""uint q_off, k_off, v_off, qkv_stride, a_off, b_off, ab_stride, nk, nv, dk, dv, n_rows,
                                 wa_off, wdt_off, slot_off, tiled, g_off, w_off, u_off, aq_off"""), ()),
    "delta_scan.comp": (Push("""uint q_off, k_off, qkv_stride, o_off, o_stride, nk, nv, dk, dv, n_rows, n_groups,
                                state_off, slot_stride, pos_off, slot_off, tiled, g_off, w_off, u_off, aq_off;
                                float scale"""), ()),
    "norm_rope_kv.comp": (Push("""uint qkv_off, qkv_stride, q_head_stride, k_col, v_col, q_off, q_stride, n_rows,
                                  n_head, n_kv, head_dim, n_rot, table_off, wq_off, wk_off, k_off, v_off,
                                  slot_stride, pos_off, slot_off; float eps; uint ring"""), ()),
    "sigmoid_mul.comp": (Push("uint x_off, x_stride, y_off, y_stride, g_off, g_stride, blk, g_blk_stride, g_step, n, "
                              "rows"), ()),
    "moe_router.comp": (Push("""uint h_off, h_stride, l_off, l_stride, y_off, y_stride, E, D, k, rows, w_off, rec_off,
                                rec_stride; float w_scale"""), ()),
    "moe_sort.comp": (Push("uint ids_off, ids_stride, k, n_rows, E, list_off, list_stride, cnt_off"),
                      (("BLOCKS", Push("uint bn, blocks_off")),)),
    "mul_mv_id.comp": (Push(_MUL_ID + ", n_rows, ids_off, ids_stride, x_off, x_stride, x_slot_stride, y_off, "
                            "y_stride, y_slot_stride"), (("EXPERT_PART", Push("uint e_lo, e_hi")),
                                                         ("COMBINE", Push("uint norm, sync_off, nw_off, h_off, "
                                                                          "h_stride; float eps; uint b_off")),
                                                         ("GLU", Push("uint b_off, oai; float alpha, limit")))),
    "mul_mm_id.comp": (Push(_MUL_ID + ", list_off, list_stride, cnt_off, x_off, x_stride, x_slot_stride, y_off, "
                            "y_stride, y_slot_stride"), (("EXPERT_PART", Push("uint e_lo, e_hi")),
                                                         ("BLOCKS", Push("uint blocks_off")))),
    "moe_combine.comp": (Push("uint e_off, e_stride, e_slot_stride, route_off, route_stride, k, y_off, y_stride, D, "
                              "rows"), ()),
}
# the expert matvecs in mul_mvk's split-K form take mul_mv_id's constants
LAYOUTS["mul_mvk_id.comp"] = LAYOUTS["mul_mv_id.comp"]


@cache
def push_for(variant: str) -> Push:
    """The push-constant layout of a shader variant (VARIANTS: source file and defines)."""
    src, defines = VARIANTS[variant]
    base, tails = LAYOUTS[src]
    for define, tail in tails:
        if define in defines:
            base = base + tail
    return base


def glsl_fields(source: str) -> list[tuple[str, str]]:
    """(name, struct code) of the fields of the `P` push-constant block of
    preprocessed GLSL source (tests)."""
    m = re.search(r"layout\s*\(\s*push_constant\s*\)\s*uniform\s+P\s*\{(.*?)\}\s*p\s*;", source, re.S)
    if m is None:
        return []
    body = re.sub(r"//[^\n]*", "", m.group(1))
    return list(Push(body).fields) if body.strip() else []
