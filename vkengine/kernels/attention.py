"""Attention: RoPE and the KV-cache write (rope_kv; norm_rope_kv with per-head
q/k RMSNorms first), and causal attention of each row over its slot's cache
(attention.comp, split into position slices for decode; attention_mc.comp on
cooperative matrices for prompt-sized steps). Every one of them takes the
cache's K and V types (KVTypes: f16 or q8_0, shaders/kv.glsl) and K's slot
stride, and runs the variant of those types (suffix KVTypes.tag)."""
from __future__ import annotations

import math

from shaders.variants import ATTN_MC2

from ..device import Buffer, Program
from ..errors import VkEngineError
from .base import KernelBase
from .types import KVTypes, Region, params_range, rows_range


class AttentionKernels(KernelBase):
    ATTN_CHUNK = 64     # positions per slice of split decode attention (notes.md run 18)
    ATTN_MC_FROM = 16   # rows from which attention runs on cooperative matrices (where it can)
    # attention_mc's split form (prompt rows at depth): a step whose row blocks make fewer workgroups than
    # caps.attn_mc_split has each workgroup's positions cut into as many parts as reach it, at most
    # ATTN_MC_MAX_PARTS (a part whose piece is empty costs a workgroup that exits, and the merge's reads)
    ATTN_MC_MAX_PARTS = 16

    DEC_MIN_CHUNK = 32  # attention_dec: a part's positions are a multiple of this
    DEC_MAX_PARTS = 256   # attention_dec: parts of a (row, KV head, group) at most
    dec_variant = "attention_dec"   # (bench/attn_probe.py swaps in others)

    def dec_layout(self, n_head: int, n_kv: int, head_dim: int) -> tuple[int, int, int]:
        """attention_dec's (query heads an item takes, items per KV head and
        part, parts): from the model's heads, Caps.attn_group and
        Caps.attn_items only (twice the parts with Caps.attn_parts_down: a
        row then uses between half of them and all)."""
        group = n_head // n_kv
        gq = max(1, min(group, self.caps.attn_group // head_dim))
        n_groups = -(-group // gq)
        parts = min(self.DEC_MAX_PARTS, max(8, -(-self.caps.attn_items // (n_kv * n_groups))))
        if self.caps.attn_parts_down:   # (a row uses half the grid's parts to all of them: PD)
            parts = min(self.DEC_MAX_PARTS, 2 * parts)
        items = self.caps.items   # a workgroup takes this many consecutive parts
        return gq, n_groups, -(-parts // items) * items

    def dec_lanes(self, head_dim: int) -> int:
        """attention_dec's lanes a position (LP): 16 dims a lane for heads of
        Caps.attn_lp dims, at most the smallest subgroup the device may use;
        1 (a lane a position) otherwise."""
        if head_dim != self.caps.attn_lp:
            return 1
        lp = 1
        while lp * 2 <= min(head_dim // 16, self.min_subgroup()) and head_dim % (lp * 2 * 8) == 0:
            lp *= 2
        return lp

    def dec_kpf(self, head_dim: int, lp: int, tag: str) -> int:
        """attention_dec's K prefetch (KPF): the uvec4 of a K row a lane keeps
        while the tile before it runs (f16 K scored a lane a position, heads of
        at most 128: 256 would take 32 more registers); 0: none."""
        return head_dim // 8 if self.caps.attn_kpf and lp == 1 and "k" not in tag and head_dim <= 128 else 0

    def dec_vwide(self, head_dim: int, tag: str) -> int:
        """attention_dec's VW: V rows read in uvec4s (Caps.attn_vwide; f16 V,
        heads whose uvec4s a row are a power of two, so that lane groups tile
        a subgroup: 64, 128, 256 dims, not Phi-3's 96; V rows aligned to
        uvec4s: the cache's offsets are, KVCache), as the smallest subgroup
        the kernel may run with (its registers are sized for it); 0: an f16
        pair a lane."""
        n4 = head_dim // 8
        if not self.caps.attn_vwide or "v" in tag or head_dim % 8 or n4 & (n4 - 1):
            return 0
        return self.min_subgroup()

    def dec_combine(self, gq: int, head_dim: int) -> int:
        """attention_dec's CMB: a workgroup's subgroups combined in one round
        (Caps.attn_combine) where its slots, (head_dim + 2) floats for each of
        the workgroup's subgroups and its item's gq heads, fit the device's
        shared memory beside the rest; 0: one subgroup after another."""
        words = self.caps.items * gq * (head_dim + 2) + head_dim + 3 + (gq * head_dim if self.caps.attn_qsh else 0)
        return int(self.caps.attn_combine and words * 4 <= self.device.info.max_shared_memory)

    def _attention_mc_split(self, prog: Program, pc: dict, reads: list, out: list, n_rows: int, n_head: int,
                            n_kv: int, head_dim: int, n_parts: int, grid: tuple[int, int], act: Buffer,
                            kv: Buffer, params: Buffer, sb: Buffer, sinks: Region | None, label: str,
                            name: str) -> None:
        """The SPLIT form of attention_mc (or attention_mc2: `name`, its split
        variant): workgroup z of a row block takes the z-th of n_parts pieces of
        its rows' positions and writes O, m, l to a scratch buffer;
        attention_merge.comp combines each row's parts into o."""
        words = n_parts * n_rows * n_head * (head_dim + 2)
        pbuf = self._scratch(self._amc, words, "attn_parts")
        prange = (pbuf, 0, words * 4)
        push = self._push(name, **pc, n_parts=n_parts, part_off=0)
        alg = self._alg_spec(name, [act, act, params, kv, sb, pbuf], (), push)
        prog.dispatch(alg, push, (*grid, n_parts), reads, [prange], label)
        push = self._push("attention_merge", o_off=pc["o_off"], o_stride=pc["o_stride"], n_rows=n_rows,
                          n_head=n_head, head_dim=head_dim, n_parts=n_parts, part_off=0, sink_off=pc["sink_off"])
        alg = self._alg("attention_merge", [act, pbuf, sb], push, self.caps.wg)
        mreads = [prange] + ([sinks.range] if sinks is not None else [])
        prog.dispatch(alg, push, self._grid(math.ceil(n_rows * n_head / self.caps.items)), mreads, out,
                      label + "_merge")

    def attn_mc_parts(self, wgs: int) -> int:
        """Parts of attention_mc's split form for a step of `wgs` workgroups
        (row blocks x KV heads): enough to reach caps.attn_mc_split workgroups
        (0: never), at most ATTN_MC_MAX_PARTS; 1: no split."""
        target = self.caps.attn_mc_split
        if not target or wgs >= target:
            return 1
        return min(self.ATTN_MC_MAX_PARTS, -(-target // wgs))

    def attention_parts(self, n_ctx: int, n_head: int, n_kv: int, head_dim: int) -> int:
        """Parts of a (row, head) in split decode attention."""
        if self.caps.attention_dec:
            return self.dec_layout(n_head, n_kv, head_dim)[2]
        return -(-n_ctx // self.ATTN_CHUNK)

    def attention_tmp_words(self, n_rows: int, n_head: int, n_kv: int, head_dim: int, n_ctx: int) -> int:
        """Scratch words of split decode attention's partial results (attention_dec: one a workgroup of
        Caps.items parts; attention.comp: one a part)."""
        parts = self.attention_parts(n_ctx, n_head, n_kv, head_dim)
        if self.caps.attention_dec:
            parts //= self.caps.items
        return n_rows * n_head * parts * (head_dim + 2)

    @staticmethod
    def attention_sync_words(n_rows: int, n_head: int) -> int:
        """zeroed counters split-K attention needs: at most one per (row, head)"""
        return n_rows * n_head

    def attention_on_coopmat2(self, n_rows: int, head_dim: int, kv_types: KVTypes = KVTypes(),
                              ring: int = 0) -> bool:
        """Whether attention() runs on attention_mc2 (NVIDIA's workgroup-scope
        matrices): prompt-sized steps of an f16 cache that does not wrap, of the
        head sizes it is compiled for."""
        c = self.caps
        return (c.coopmat and c.attention_mc and c.attention_mc2 and n_rows >= self.ATTN_MC_FROM
                and head_dim in ATTN_MC2 and not kv_types.tag and ring == 0)

    def attention_on_coopmat(self, n_rows: int, head_dim: int) -> bool:
        """Whether attention() runs on cooperative matrices (attention_mc: 16
        query rows a subgroup, fp16 Q and P): prompt-sized steps of the head
        sizes it is compiled for, on devices that run mul_mc."""
        c = self.caps
        return (c.coopmat and c.attention_mc and n_rows >= self.ATTN_MC_FROM
                and head_dim in dict(c.attention_mc_layouts))

    def rope_kv(self, prog: Program, table: Region, qkv: Region, qkv_stride: int, q_out: Region, q_stride: int,
                n_rows: int, n_head: int, n_kv: int, head_dim: int, n_rot: int, neox: bool,
                k_cache: Region, v_cache: Region, slot_stride: int, params: Buffer, pos_off: int, slot_off: int,
                label: str = "rope_kv", kv_types: KVTypes = KVTypes(), ring: int = 0) -> None:
        """RoPE on q and k of each row, k and v written into the cache (of
        kv_types) at (params[slot_off + r], params[pos_off + r]) (ring > 0: a
        ring of that many positions, position t at row t % ring); rotated q to
        q_out."""
        kv_types.check_head_dim(head_dim)
        act = self._same_buffer(qkv, q_out)
        kv = self._same_buffer(k_cache, v_cache)
        name = "rope_kv" + kv_types.tag
        push = self._push(name, qkv_off=qkv.off, qkv_stride=qkv_stride, q_off=q_out.off, q_stride=q_stride,
                          n_rows=n_rows, n_head=n_head, n_kv=n_kv, head_dim=head_dim, n_rot=n_rot, mode=int(neox),
                          table_off=table.off, k_off=k_cache.off, v_off=v_cache.off, slot_stride=slot_stride,
                          pos_off=pos_off, slot_off=slot_off, ring=ring)
        alg = self._alg(name, [table.buf, act, params, kv], push, self.caps.ew_wg, 1)
        # an invocation a q word (2 dims), and per K or V head an f16 pair or a q8_0 word (4 values)
        units = {"f16": head_dim // 2, "q8_0": head_dim // 4}
        if kv_types.quantized and self.caps.ew_wg % 16:   # (a q8_0 unit's 16 words in one workgroup)
            raise VkEngineError(f"a q8_0 cache needs elementwise workgroups of a multiple of 16, not {self.caps.ew_wg}")
        per_row = n_head * head_dim // 2 + n_kv * (units[kv_types.k] + units[kv_types.v])
        width = (n_head + 2 * n_kv) * head_dim
        reads = [table.range, rows_range(qkv, n_rows, qkv_stride, width),
                 (params, min(pos_off, slot_off) * 4, (max(pos_off, slot_off) + n_rows) * 4)]
        writes = [rows_range(q_out, n_rows, q_stride, n_head * head_dim), k_cache.range, v_cache.range]
        prog.dispatch(alg, push, self._grid(math.ceil(n_rows * per_row / self.caps.ew_wg)), reads, writes, label)

    def norm_rope_kv(self, prog: Program, table: Region, wq: Region, wk: Region, qkv: Region, qkv_stride: int,
                     q_head_stride: int, k_col: int, v_col: int, q_out: Region, q_stride: int, n_rows: int,
                     n_head: int, n_kv: int, head_dim: int, n_rot: int, k_cache: Region, v_cache: Region,
                     slot_stride: int, params: Buffer, pos_off: int, slot_off: int, eps: float,
                     label: str = "norm_rope_kv", kv_types: KVTypes = KVTypes(), ring: int = 0) -> None:
        """Per-head RMSNorm (wq, wk) + NEOX RoPE of q and k; q to q_out, k and v
        into the cache (of kv_types) at each row's (slot, position) (ring: as
        rope_kv's)."""
        if not (table.buf is wq.buf is wk.buf):
            raise ValueError("the RoPE table and the q/k norm weights must share a weight buffer")
        if head_dim % 2 or n_rot % 2 or n_rot > head_dim:
            raise VkEngineError(f"head size {head_dim} with {n_rot} rotated dims is not supported")
        kv_types.check_head_dim(head_dim)
        act = self._same_buffer(qkv, q_out)
        kv = self._same_buffer(k_cache, v_cache)
        name = "norm_rope_kv" + kv_types.tag
        push = self._push(name, qkv_off=qkv.off, qkv_stride=qkv_stride, q_head_stride=q_head_stride,
                          k_col=k_col, v_col=v_col, q_off=q_out.off, q_stride=q_stride, n_rows=n_rows, n_head=n_head,
                          n_kv=n_kv, head_dim=head_dim, n_rot=n_rot, table_off=table.off, wq_off=wq.off,
                          wk_off=wk.off, k_off=k_cache.off, v_off=v_cache.off, slot_stride=slot_stride,
                          pos_off=pos_off, slot_off=slot_off, eps=eps, ring=ring)
        alg = self._alg(name, [table.buf, act, params, kv], push, self.caps.wg)
        width = v_col + n_kv * head_dim
        reads = [table.range, wq.range, wk.range, rows_range(qkv, n_rows, qkv_stride, width),
                 *params_range(params, (pos_off, n_rows), (slot_off, n_rows))]
        writes = [rows_range(q_out, n_rows, q_stride, n_head * head_dim), k_cache.range, v_cache.range]
        prog.dispatch(alg, push, self._grid(math.ceil(n_rows * (n_head + 2 * n_kv) / self.caps.items)),
                      reads, writes, label)

    def attention(self, prog: Program, q: Region, q_stride: int, o: Region, o_stride: int, n_rows: int,
                  n_head: int, n_kv: int, head_dim: int, k_cache: Region, v_cache: Region, slot_stride: int,
                  params: Buffer, pos_off: int, slot_off: int, scale: float, split: Region | None = None,
                  n_ctx: int = 0, sync: Region | None = None, label: str = "attention",
                  kv_types: KVTypes = KVTypes(), window: int = 0, softcap: float = 0.0, ring: int = 0,
                  sinks: Region | None = None, mc_parts: int | None = None,
                  gate: tuple[Region, int, int] | None = None) -> bool:
        """o[r][h] = softmax(q[r][h] . K[slot][0..pos]) V[slot][0..pos].
        With `split` (scratch of attention_tmp_words), the cache's n_ctx and
        `sync` (attention_sync_words of zeros, left zero) the positions are cut
        into slices run in parallel and merged in the same dispatch by the last
        slice of each (row, head) to finish (flash-decoding): decode has few
        rows, so one pass would leave most of a GPU idle. Without
        it, prompt-sized steps run on cooperative matrices where the device
        can (attention_on_coopmat). kv_types: the cache's K and V types
        (slot_stride is K's). window > 0: each row sees only its last `window`
        positions (sliding-window layers); softcap > 0: scores s become
        softcap * tanh(s / softcap) before the softmax (Gemma 2). ring > 0: the
        cache holds that many positions a slot, position t at row t % ring
        (sliding-window layers' bounded caches: the window and a step's rows
        must fit in it). sinks: a logit per query head (gpt-oss) that joins each
        softmax's denominator with no value. On cooperative matrices, a step
        whose rows make few workgroups has each workgroup's positions cut into
        mc_parts parts (None: as attn_mc_parts says) across workgroups, then
        merged (attention_mc's SPLIT form and attention_merge.comp).
        gate = (g, stride, blk): o[r][h][d] times sigmoid(g[r * stride + h * blk +
        d]) (Qwen3.5's gated attention), taken by the split decode attention
        (attention_dec.comp) where it runs; returns whether it did (else the
        caller gates o: sigmoid_mul)."""
        if head_dim % 8 or n_head % n_kv or q.off % 4 or q_stride % 4 or k_cache.off % 4 or v_cache.off % 4:
            raise VkEngineError(f"attention needs head_dim a multiple of 8 ({head_dim}), n_head a multiple of "
                                f"n_kv ({n_head}/{n_kv}) and 16-byte aligned q rows and caches")
        kv_types.check_head_dim(head_dim)
        tag = kv_types.tag
        c = self.caps
        act = self._same_buffer(q, o)
        kv = self._same_buffer(k_cache, v_cache)
        reads = [rows_range(q, n_rows, q_stride, n_head * head_dim), k_cache.range, v_cache.range,
                 (params, min(pos_off, slot_off) * 4, (max(pos_off, slot_off) + n_rows) * 4)]
        out = [rows_range(o, n_rows, o_stride, n_head * head_dim)]
        pc = dict(q_off=q.off, q_stride=q_stride, o_off=o.off, o_stride=o_stride, n_rows=n_rows, n_head=n_head,
                  n_kv=n_kv, head_dim=head_dim, k_off=k_cache.off, v_off=v_cache.off, slot_stride=slot_stride,
                  pos_off=pos_off, slot_off=slot_off, scale=scale, window=window, softcap=softcap,
                  ring=ring, sink_off=sinks.off if sinks is not None else 0xFFFFFFFF)
        if sinks is not None:
            if sinks.words < n_head:
                raise ValueError(f"{sinks.words} attention sinks for {n_head} heads")
            reads.append(sinks.range)
        sb = sinks.buf if sinks is not None else params   # (binding 4 unused without sinks)
        mc2 = self.attention_on_coopmat2(n_rows, head_dim, kv_types, ring) and split is None
        stand_in = False
        if mc2:
            row_blocks = math.ceil(n_rows / ATTN_MC2[head_dim][0])   # BR rows of one head a workgroup
            parts = self.attn_mc_parts(row_blocks * n_head) if mc_parts is None else mc_parts
            # the split form where parts > 1; O in halves (Options.attn_mc2_of16)
            of16 = ("_of16nr" if c.attn_mc2_narrow else "_of16") if c.attn_mc2_of16 else ""
            name = f"attention_mc2_d{head_dim}{'_split' if parts > 1 else ''}{of16}"
            if self.device.is_slow(name):
                # still compiling (Device.settle): the plain kernel meanwhile, not attention_mc, whose own
                # pipeline a fresh NVIDIA driver built in 2.2-3.9 s, longer than attention_mc2's 0.9-1.7 s,
                # while the start waited for it (notes.md run 45)
                mc2, stand_in = False, True
                self.substituted += 1
        if mc2:
            if parts > 1:
                self._attention_mc_split(prog, pc, reads, out, n_rows, n_head, n_kv, head_dim, parts,
                                         (row_blocks, n_head), act, kv, params, sb, sinks, label, name)
                return False
            push = self._push(name, **pc)
            alg = self._alg_spec(name, [act, act, params, kv, sb], (), push)
            prog.dispatch(alg, push, (row_blocks, n_head, 1), reads, out, label)
            return False
        if self.attention_on_coopmat(n_rows, head_dim) and split is None and not stand_in:
            name = c.attention_mc_variant.format(hd=head_dim) + tag
            push = self._push(name, **pc)
            alg = self._alg_spec(name, [act, act, params, kv, sb], (), push)
            # NSG / DS 16-row blocks of one KV group's heads a workgroup (the shader's comment)
            blocks = math.ceil(n_rows / 16) * (n_head // n_kv)
            per_wg = dict(c.attention_mc_layouts)[head_dim]
            wgs = math.ceil(blocks / per_wg)
            parts = self.attn_mc_parts(wgs * n_kv) if mc_parts is None else mc_parts
            if parts > 1 and c.attention_mc_variant == "attention_mc_d{hd}":
                self._attention_mc_split(prog, pc, reads, out, n_rows, n_head, n_kv, head_dim, parts, (wgs, n_kv),
                                         act, kv, params, sb, sinks, label, f"attention_mc_d{head_dim}_split" + tag)
                return False
            prog.dispatch(alg, push, (wgs, n_kv, 1), reads, out, label)
            return False
        # V words per lane; sized for the smallest subgroup the device may use
        wpl = -(-(head_dim // 2) // self.min_subgroup())
        # V rows a lane loads ahead of their use: up to 32 words, at least 8 rows
        vb = max(8, min(32, 32 // wpl))
        if split is not None and c.attention_dec:
            if gate is not None:
                g, gs, gb = gate
                if g.buf is not act or not gb:
                    raise ValueError("the attention gate: a nonzero block in the activation buffer")
                pc.update(gate_off=g.off, gate_stride=gs, gate_blk=gb)
                reads.append(rows_range(g, n_rows, gs, (n_head - 1) * gb + head_dim))
                label += "+gate"
            self._attention_dec(prog, pc, reads, out, split, sync, n_rows, n_head, n_kv, head_dim, wpl, vb, act, kv,
                                params, label, tag, sb)
            return gate is not None
        n_parts = self.attention_parts(n_ctx, n_head, n_kv, head_dim) if split is not None else 1
        name = ("attention_split" if split is not None else "attention") + tag
        push = self._push(name, **pc, chunk=self.ATTN_CHUNK if split is not None else 0, n_parts=n_parts,
                          part_off=split.off if split is not None else 0, sync_off=sync.off if sync is not None else 0)
        alg = self._alg_spec(name, [act, act, params, kv, sb], (c.wg, c.items, wpl, head_dim, vb), push)
        if split is None:
            prog.dispatch(alg, push, self._grid(math.ceil(n_rows * n_head / c.items)), reads, out, label)
            return False
        tmp_words = self.attention_tmp_words(n_rows, n_head, n_kv, head_dim, n_ctx)
        if split.buf is not act or split.words < tmp_words:
            raise ValueError("split-K attention needs a scratch region in the activation buffer")
        if sync is None or sync.buf is not act or sync.words < self.attention_sync_words(n_rows, n_head):
            raise ValueError("split-K attention needs zeroed counters in the activation buffer")
        tmp = (split.buf, split.off * 4, (split.off + tmp_words) * 4)
        prog.dispatch(alg, push, self._grid(math.ceil(n_rows * n_head * n_parts / c.items)),
                      reads + [tmp, sync.range], out + [tmp, sync.range], label)
        return False

    def _attention_dec(self, prog: Program, pc: dict, reads: list, out: list, split: Region, sync: Region | None,
                       n_rows: int, n_head: int, n_kv: int, head_dim: int, wpl: int, vb: int, act: Buffer,
                       kv: Buffer, params: Buffer, label: str, tag: str, sb: Buffer) -> None:
        """Split decode attention by KV-head group (attention_dec.comp; tag: the KV types' variant suffix)."""
        c = self.caps
        gq, n_groups, n_parts = self.dec_layout(n_head, n_kv, head_dim)
        tmp_words = self.attention_tmp_words(n_rows, n_head, n_kv, head_dim, 0)
        if split.buf is not act or split.words < tmp_words:
            raise ValueError("split decode attention needs a scratch region in the activation buffer")
        if sync is None or sync.buf is not act or sync.words < n_rows * n_kv * n_groups:
            raise ValueError("split decode attention needs zeroed counters in the activation buffer")
        name = self.dec_variant + tag
        push = self._push(name, **pc, n_parts=n_parts, min_chunk=self.DEC_MIN_CHUNK, part_off=split.off,
                          sync_off=sync.off)
        lp = self.dec_lanes(head_dim) if "k" not in tag else 1   # (f16 K only)
        kh = int(c.attn_khoist and lp > 1)
        vw = self.dec_vwide(head_dim, tag)
        vb = c.attn_vb or (8 if vw else vb)   # (wide V rows: uvec4 loads ahead a lane)
        alg = self._alg_spec(name, [act, act, params, kv, sb], (c.wg, c.items, wpl, head_dim, vb, gq, lp,
                                                            self.dec_kpf(head_dim, lp, tag),
                                                            int(c.attn_vpre), kh, vw,
                                                            self.dec_combine(gq, head_dim), c.attn_merge,
                                                            int(c.attn_parts_down), int(c.attn_qsh and lp > 1)),
                             push)
        tmp = (split.buf, split.off * 4, (split.off + tmp_words) * 4)
        prog.dispatch(alg, push, self._grid(n_rows * n_kv * n_groups * (n_parts // c.items)),
                      reads + [tmp, sync.range], out + [tmp, sync.range], label)
