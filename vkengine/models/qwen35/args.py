"""Qwen3.5 hyperparameters (from GGUF metadata or a Hugging Face config.json)
and the Hugging Face -> GGUF tensor name map (data). See __init__.py."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...errors import VkEngineError
from ...gguf_file import ModelFile, SafetensorsFolder
from ..base import ModelArgs

_L = r"(?:model\.)?(?:language_model\.)?layers\.(\d+)\."
_M = r"(?:model\.)?mtp\.layers\.0\."
# per-layer Hugging Face names -> GGUF names (the MTP block's layer uses the same)
_LAYER_NAMES = {
    r"input_layernorm\.weight": "attn_norm.weight",
    r"post_attention_layernorm\.weight": "post_attention_norm.weight",
    r"self_attn\.q_proj\.weight": "attn_q.weight",
    r"self_attn\.k_proj\.weight": "attn_k.weight",
    r"self_attn\.v_proj\.weight": "attn_v.weight",
    r"self_attn\.o_proj\.weight": "attn_output.weight",
    r"self_attn\.q_norm\.weight": "attn_q_norm.weight",
    r"self_attn\.k_norm\.weight": "attn_k_norm.weight",
    r"linear_attn\.in_proj_qkv\.weight": "attn_qkv.weight",
    r"linear_attn\.in_proj_z\.weight": "attn_gate.weight",
    r"linear_attn\.in_proj_b\.weight": "ssm_beta.weight",
    r"linear_attn\.in_proj_a\.weight": "ssm_alpha.weight",
    r"linear_attn\.conv1d\.weight": "ssm_conv1d.weight",
    r"linear_attn\.dt_bias": "ssm_dt.bias",
    r"linear_attn\.A_log": "ssm_a",                      # -exp() applied on load
    r"linear_attn\.norm\.weight": "ssm_norm.weight",
    r"linear_attn\.out_proj\.weight": "ssm_out.weight",
    r"mlp\.gate_proj\.weight": "ffn_gate.weight",
    r"mlp\.up_proj\.weight": "ffn_up.weight",
    r"mlp\.down_proj\.weight": "ffn_down.weight",
    r"mlp\.gate\.weight": "ffn_gate_inp.weight",
    r"mlp\.experts\.gate_up_proj": "ffn_gate_up_exps.weight",
    r"mlp\.experts\.down_proj": "ffn_down_exps.weight",
    r"mlp\.experts\.(\d+)\.gate_proj\.weight": r"ffn_gate_exp.\2.weight",   # per-expert checkpoints,
    r"mlp\.experts\.(\d+)\.up_proj\.weight": r"ffn_up_exp.\2.weight",       # stacked on load
    r"mlp\.experts\.(\d+)\.down_proj\.weight": r"ffn_down_exp.\2.weight",
    r"mlp\.shared_expert\.gate_proj\.weight": "ffn_gate_shexp.weight",
    r"mlp\.shared_expert\.up_proj\.weight": "ffn_up_shexp.weight",
    r"mlp\.shared_expert\.down_proj\.weight": "ffn_down_shexp.weight",
    r"mlp\.shared_expert_gate\.weight": "ffn_gate_inp_shexp.weight",
}
MTP_BLOCK = "mtp"   # block id of the MTP layer in names mapped from HF (GGUF: blk.<n_layer>)
HF_NAMES = {
    r"(?:model\.)?(?:language_model\.)?embed_tokens\.weight": "token_embd.weight",
    r"(?:model\.)?(?:language_model\.)?norm\.weight": "output_norm.weight",
    r"lm_head\.weight": "output.weight",
    r"(?:model\.)?mtp\.fc\.weight": f"blk.{MTP_BLOCK}.nextn.eh_proj.weight",
    r"(?:model\.)?mtp\.pre_fc_norm_embedding\.weight": f"blk.{MTP_BLOCK}.nextn.enorm.weight",
    r"(?:model\.)?mtp\.pre_fc_norm_hidden\.weight": f"blk.{MTP_BLOCK}.nextn.hnorm.weight",
    r"(?:model\.)?mtp\.norm\.weight": f"blk.{MTP_BLOCK}.nextn.shared_head_norm.weight",
    **{_L + k: r"blk.\1." + v for k, v in _LAYER_NAMES.items()},
    **{_M + k: f"blk.{MTP_BLOCK}." + v.replace(r"\2", r"\1") for k, v in _LAYER_NAMES.items()},
}

# RMSNorm weights that GGUF stores with the +1 of x*(1+w) folded in (added on
# load from HF), by GGUF name suffix (convert_hf_to_gguf: Qwen3NextModel.modify_tensors)
PLUS_ONE_NORMS = ("attn_norm.weight", "post_attention_norm.weight", "output_norm.weight", "attn_q_norm.weight",
                  "attn_k_norm.weight", "nextn.enorm.weight", "nextn.hnorm.weight",
                  "nextn.shared_head_norm.weight")


def hf_value(name: str, v: np.ndarray) -> np.ndarray:
    """A Hugging Face vector in GGUF's convention (WeightPlanner's hf_value)."""
    if name.endswith(PLUS_ONE_NORMS):
        return v + np.float32(1.0)
    if name.endswith(".ssm_a"):
        return -np.exp(v)
    return v


@dataclass(frozen=True, kw_only=True)
class Qwen35Args(ModelArgs):
    arch: str                     # qwen35 | qwen35moe
    layer_types: tuple[str, ...]  # "linear" | "full" per main layer (n_layer: main layers; the MTP block is extra)
    conv_kernel: int
    nk: int                       # linear attention key heads (ssm.group_count)
    nv: int                       # value heads (ssm.time_step_rank)
    dk: int                       # key head size (ssm.state_size)
    dv: int                       # value head size (ssm.inner_size / nv)
    v_heads_tiled: bool           # GGUF value-head order (see the module docstring)
    n_ff: int = 0                 # dense FFN
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    expert_weights_scale: float = 1.0
    rope_sections: tuple[int, ...] = field(default=(), compare=False)

    # -- derived ----------------------------------------------------------------
    @property
    def moe(self) -> bool:
        return self.n_expert > 0

    @property
    def conv_dim(self) -> int:
        return 2 * self.nk * self.dk + self.nv * self.dv

    @property
    def lin_width(self) -> int:
        """Columns of the linear block's input projection: [qkv | z | beta | alpha]."""
        return self.conv_dim + self.nv * self.dv + 2 * self.nv

    @property
    def attn_layers(self) -> list[int]:
        full = [i for i, t in enumerate(self.layer_types) if t == "full" and self.owns(i)]
        # the MTP block has its own KV cache (on the last part of a split model)
        return full + ([self.n_layer] if self.n_nextn and self.last_part else [])

    @property
    def rec_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear" and self.owns(i)]

    @property
    def kv_layers(self) -> list[int]:
        return self.attn_layers

    @property
    def moe_layers(self) -> list[int]:
        return list(range(self.n_layer)) if self.moe else []

    def validate(self) -> Qwen35Args:
        if len(self.layer_types) != self.n_layer or set(self.layer_types) - {"linear", "full"}:
            raise VkEngineError(f"layer types {self.layer_types} do not describe {self.n_layer} layers")
        if self.nv % self.nk:
            raise VkEngineError(f"{self.nv} linear-attention value heads do not divide among {self.nk} key heads")
        if self.n_rot % 2 or self.n_rot > self.head_dim:
            raise VkEngineError(f"{self.n_rot} rotated dims do not fit heads of {self.head_dim}")
        if self.moe and not (0 < self.n_expert_used <= self.n_expert):
            raise VkEngineError(f"{self.n_expert_used} of {self.n_expert} experts per token")
        if self.n_nextn > 1:
            raise VkEngineError(f"{self.n_nextn} MTP blocks: only one is supported (as llama.cpp)")
        s = self.rope_sections
        if s and sum(s) and not _mrope_is_plain(s, self.n_rot):
            raise VkEngineError(f"rope sections {list(s)} with {self.n_rot} rotated dims leave some dims on the "
                                "extra M-RoPE position; only text positions are supported")
        return self

    @classmethod
    def from_file(cls, mf: ModelFile) -> Qwen35Args:
        if isinstance(mf, SafetensorsFolder):
            return _args_from_hf(cls, mf).validate()
        return _args_from_gguf(cls, mf).validate()


def _mrope_is_plain(sections, n_rot: int) -> bool:
    """True when llama.cpp's interleaved M-RoPE (ggml_mrope_cache_init, is_imrope)
    gives every rotated pair a t/h/w position: for text these all equal the token
    position, so the rotation is plain NEOX RoPE."""
    s = list(sections) + [0] * (4 - len(sections))
    total = sum(s)
    for i in range(n_rot // 2):
        sec = i % total
        ok = (sec % 3 == 0 and sec < 3 * s[0]) or (sec % 3 == 1 and sec < 3 * s[1]) or \
             (sec % 3 == 2 and sec < 3 * s[2])
        if not ok:
            return False
    return True


def _args_from_gguf(cls, mf: ModelFile) -> Qwen35Args:
    a, m = mf.arch, mf.meta
    n_all = int(m(f"{a}.block_count"))
    n_nextn = int(m(f"{a}.nextn_predict_layers", 0))
    n_layer = n_all - n_nextn
    n_embd = int(m(f"{a}.embedding_length"))
    n_head = int(m(f"{a}.attention.head_count"))
    hd = int(m(f"{a}.attention.key_length", n_embd // n_head))
    rec = m(f"{a}.attention.recurrent_layers", None)
    if rec is not None:
        types = tuple("linear" if bool(x) else "full" for x in list(rec)[:n_layer])
    else:
        interval = int(m(f"{a}.full_attention_interval", 4))
        types = tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(n_layer))
    nv = int(m(f"{a}.ssm.time_step_rank"))
    n_vocab = m(f"{a}.vocab_size", None)
    if n_vocab is None:
        n_vocab = mf.tensor_info("token_embd.weight")[1][0]
    scale = float(m(f"{a}.expert_weights_scale", 0.0))
    st = m(f"{a}.rope.scaling.type", None)
    if st not in (None, "none"):
        raise VkEngineError(f"RoPE scaling {st!r} is not supported for {a}")
    return cls(
        arch=a, n_vocab=int(n_vocab), n_embd=n_embd, n_layer=n_layer, layer_types=types, n_head=n_head,
        n_head_kv=int(m(f"{a}.attention.head_count_kv", n_head)), head_dim=hd,
        n_rot=int(m(f"{a}.rope.dimension_count", hd)), rope_base=float(m(f"{a}.rope.freq_base", 10000.0)),
        rms_eps=float(m(f"{a}.attention.layer_norm_rms_epsilon")), n_ctx_train=int(m(f"{a}.context_length")),
        conv_kernel=int(m(f"{a}.ssm.conv_kernel")), nk=int(m(f"{a}.ssm.group_count")), nv=nv,
        dk=int(m(f"{a}.ssm.state_size")), dv=int(m(f"{a}.ssm.inner_size")) // nv, v_heads_tiled=True,
        n_ff=int(m(f"{a}.feed_forward_length", 0)), n_expert=int(m(f"{a}.expert_count", 0)),
        n_expert_used=int(m(f"{a}.expert_used_count", 0)),
        n_ff_exp=int(m(f"{a}.expert_feed_forward_length", 0)),
        n_ff_shexp=int(m(f"{a}.expert_shared_feed_forward_length", 0)),
        expert_weights_scale=scale if scale else 1.0, n_nextn=n_nextn,
        rope_sections=tuple(int(x) for x in m(f"{a}.rope.dimension_sections", [])))


def _args_from_hf(cls, mf: SafetensorsFolder) -> Qwen35Args:
    c = dict(mf.config)
    c = {**c, **(c.get("text_config") or {})}
    rp = {**{k: c[k] for k in ("rope_theta", "partial_rotary_factor", "mrope_section") if k in c},
          **(c.get("rope_parameters") or c.get("rope_scaling") or {})}
    n_layer = int(c["num_hidden_layers"])
    types = c.get("layer_types")
    if types:
        types = tuple("linear" if t == "linear_attention" else "full" for t in types[:n_layer])
    else:
        interval = int(c.get("full_attention_interval", 4))
        types = tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(n_layer))
    n_head = int(c["num_attention_heads"])
    hd = int(c.get("head_dim") or c["hidden_size"] // n_head)
    moe = int(c.get("num_experts", 0) or 0) > 0
    n_nextn = int(c.get("mtp_num_hidden_layers", 0) or 0)
    if n_nextn and not mf.has(f"blk.{MTP_BLOCK}.nextn.eh_proj.weight"):
        n_nextn = 0
    return cls(
        arch="qwen35moe" if moe else "qwen35", n_vocab=int(c["vocab_size"]), n_embd=int(c["hidden_size"]),
        n_layer=n_layer, layer_types=types, n_head=n_head, n_head_kv=int(c.get("num_key_value_heads", n_head)),
        head_dim=hd, n_rot=int(hd * float(rp.get("partial_rotary_factor", 0.25))),
        rope_base=float(rp.get("rope_theta", 10000.0)), rms_eps=float(c.get("rms_norm_eps", 1e-6)),
        n_ctx_train=int(c.get("max_position_embeddings", 32768)), conv_kernel=int(c.get("linear_conv_kernel_dim", 4)),
        nk=int(c["linear_num_key_heads"]), nv=int(c["linear_num_value_heads"]), dk=int(c["linear_key_head_dim"]),
        dv=int(c["linear_value_head_dim"]), v_heads_tiled=False, n_ff=int(c.get("intermediate_size", 0) or 0),
        n_expert=int(c.get("num_experts", 0) or 0), n_expert_used=int(c.get("num_experts_per_tok", 0) or 0),
        n_ff_exp=int(c.get("moe_intermediate_size", 0) or 0),
        n_ff_shexp=int(c.get("shared_expert_intermediate_size", 0) or 0), n_nextn=n_nextn,
        rope_sections=tuple(int(x) for x in rp.get("mrope_section", [])))
