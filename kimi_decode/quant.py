"""Weight and cache formats: MXFP4 routed experts and the FP8 (e4m3) latent KV cache.

MXFP4 (OCP microscaling): each weight is an e2m1 code (sign, 2 exponent bits, 1 mantissa bit; magnitudes 0, 0.5, 1,
1.5, 2, 3, 4, 6); every 32 consecutive weights along K share one ue8m0 scale byte s meaning 2**(s - 127). Two codes
are packed per byte, the even element in the low nibble.
"""
from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
UE8M0_BIAS = 127
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def _e2m1_table(device, dtype) -> torch.Tensor:
    mags = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return torch.cat([mags, -mags])  # code = sign << 3 | magnitude index


def mxfp4_unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 codes [..., K]."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def mxfp4_pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even) -> packed uint8 [..., K/2]."""
    if codes.shape[-1] % 2:
        raise ValueError("MXFP4 packing needs an even number of values along K")
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def mxfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype=torch.float32, group: int = 32):
    """Packed uint8 [..., K/2] and ue8m0 scales [..., K/group] -> values [..., K] in `dtype`."""
    codes = mxfp4_unpack_codes(packed)
    if codes.shape[-1] != scales.shape[-1] * group:
        raise ValueError(f"MXFP4: {codes.shape[-1]} values need {codes.shape[-1] // group} scales per row, "
                         f"got {scales.shape[-1]}")
    values = _e2m1_table(packed.device, dtype)[codes.long()]
    scale = torch.exp2(scales.to(dtype) - UE8M0_BIAS)
    return (values.unflatten(-1, (-1, group)) * scale.unsqueeze(-1)).flatten(-2)


def mxfp4_quantize(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Round `w` [..., K] to MXFP4: returns (packed uint8 [..., K/2], ue8m0 scales uint8 [..., K/group]).

    The shared exponent is floor(log2(amax)) - 2, so the group's largest magnitude lands in [4, 8) before rounding
    (values above 6 saturate), as the OCP specification prescribes; each value then rounds to the nearest e2m1 code.
    """
    if w.shape[-1] % group:
        raise ValueError(f"MXFP4: K={w.shape[-1]} is not a multiple of the group size {group}")
    g = w.float().unflatten(-1, (-1, group))
    amax = g.abs().amax(dim=-1, keepdim=True)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0**-126))) - 2,
                      torch.full_like(amax, -UE8M0_BIAS))
    exp = exp.clamp(-UE8M0_BIAS, 127)
    scaled = (g / torch.exp2(exp)).clamp(-E2M1_MAX, E2M1_MAX)
    mags = torch.tensor(E2M1_VALUES, device=w.device)
    idx = (scaled.abs().unsqueeze(-1) - mags).abs().argmin(dim=-1)
    codes = (idx | ((scaled < 0).long() << 3)).to(torch.uint8).flatten(-2)
    scales = (exp.squeeze(-1) + UE8M0_BIAS).to(torch.uint8)
    return mxfp4_pack_codes(codes), scales


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Per-tensor FP8 e4m3: stores x / scale, saturating at +-448."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor | float, dtype=torch.float32) -> torch.Tensor:
    return q.to(dtype) * (scale.to(dtype) if torch.is_tensor(scale) else scale)


def fp8_scale_for(x: torch.Tensor, headroom: float = 2.0) -> torch.Tensor:
    """A per-tensor scale that leaves `headroom` for later values larger than today's maximum."""
    return (x.detach().abs().amax().float() * headroom / FP8_MAX).clamp_min(1e-12).reshape(())
