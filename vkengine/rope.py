"""Rotary position embedding tables, computed on the host in float64 so that
every device (and the numpy reference) rotates by the same angles."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import VkEngineError


@dataclass(frozen=True)
class Yarn:
    """YaRN context extension (Qwen2.5/Qwen3 past 32k, gpt-oss): frequencies
    interpolated by `factor` below the correction range, extrapolated above it,
    ramped between (ggml's rope_yarn, transformers' _compute_yarn_parameters),
    and cos/sin times the attention factor (0.1 ln factor + 1 unless given)."""
    factor: float
    orig_ctx: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attn_factor: float = 0.0    # 0: 0.1 ln(factor) + 1
    truncate: bool = True       # the correction range rounded out to whole pairs (ggml; transformers' default);
                                # gpt-oss's Hugging Face config sets truncate false (its exact range)

    @classmethod
    def from_hf(cls, rs: dict, config: dict) -> Yarn:
        """transformers' rope_scaling of type yarn; the original context from it,
        else from the config (original_max_position_embeddings, gpt-oss's
        initial_context_length), else max_position_embeddings / factor."""
        if rs.get("mscale") not in (None, 1, 1.0) or rs.get("mscale_all_dim") not in (None, 0, 0.0):
            raise VkEngineError(f"rope_scaling {rs}: YaRN with mscale or mscale_all_dim is not supported")
        factor = float(rs["factor"])
        orig = int(rs.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
                   or config.get("initial_context_length") or int(config["max_position_embeddings"]) / factor)
        return cls(factor, orig, float(rs.get("beta_fast") or 32.0), float(rs.get("beta_slow") or 1.0),
                   float(rs.get("attention_factor") or 0.0), truncate=rs.get("truncate", True) is not False)

    def mscale(self) -> float:
        if self.attn_factor:
            return self.attn_factor
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1.0 else 1.0

    def corr_dims(self, n_rot: int, base: float) -> tuple[float, float]:
        """ggml_rope_yarn_corr_dims (transformers' find_correction_range): the
        pairs where the ramp starts and ends."""
        def dim(beta: float) -> float:
            return n_rot * math.log(self.orig_ctx / (beta * 2 * math.pi)) / (2 * math.log(base))
        lo, hi = dim(self.beta_fast), dim(self.beta_slow)
        if self.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        return max(0.0, lo), min(n_rot - 1.0, hi)


def rope_angles(n_ctx: int, n_rot: int, base: float, freq_scale: float = 1.0,
                freq_factors: np.ndarray | None = None) -> np.ndarray:
    """theta[pos, i] = pos * freq_scale * base^(-2i / n_rot) / factor_i, float64 (n_ctx, n_rot/2)."""
    inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, np.float64)[: n_rot // 2]
    return np.arange(n_ctx, dtype=np.float64)[:, None] * freq_scale * inv[None, :]


def yarn_angles(n_ctx: int, n_rot: int, base: float, yarn: Yarn) -> np.ndarray:
    """theta[pos, i] of YaRN: pair i's interpolated angle (divided by the
    factor) mixed with its extrapolated one by the ramp over the correction
    range (1 - clamp((i - low) / max(0.001, high - low), 0, 1) of the
    extrapolated one), float64 (n_ctx, n_rot/2)."""
    extrap = rope_angles(n_ctx, n_rot, base)
    low, high = yarn.corr_dims(n_rot, base)
    i = np.arange(n_rot // 2, dtype=np.float64)
    mix = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)
    return extrap / yarn.factor * (1.0 - mix) + extrap * mix


def rope_table(n_ctx: int, n_rot: int, base: float, freq_scale: float = 1.0,
               freq_factors: np.ndarray | None = None, yarn: Yarn | None = None) -> np.ndarray:
    """float32 (n_ctx, n_rot/2, 2) of (cos, sin), the layout rope_kv.comp reads
    (yarn: YaRN's angles and cos/sin times its attention factor; freq_scale is
    then 1 / yarn.factor and not applied again)."""
    if yarn is not None:
        th = yarn_angles(n_ctx, n_rot, base, yarn)
        return (np.stack([np.cos(th), np.sin(th)], axis=-1) * yarn.mscale()).astype(np.float32)
    th = rope_angles(n_ctx, n_rot, base, freq_scale, freq_factors)
    return np.stack([np.cos(th), np.sin(th)], axis=-1).astype(np.float32)
