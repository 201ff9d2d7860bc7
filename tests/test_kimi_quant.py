import torch

from kimi_decode.quant import (E2M1_VALUES, FP8_DTYPE, fp8_dequantize, fp8_quantize, fp8_scale_for,
                               mxfp4_dequantize, mxfp4_pack_codes, mxfp4_quantize, mxfp4_unpack_codes)


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = mxfp4_pack_codes(codes)
    assert packed.shape == (5, 32)
    assert torch.equal(mxfp4_unpack_codes(packed), codes)
    assert packed[0, 0] == codes[0, 0] | (codes[0, 1] << 4)  # even element in the low nibble


def test_dequantize_known_values():
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)  # 32 values, one group
    scales = torch.tensor([127 + 3], dtype=torch.uint8)  # 2**3
    vals = mxfp4_dequantize(mxfp4_pack_codes(codes), scales, torch.float64)
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float64) * 8
    assert torch.equal(vals[:16], torch.cat([mags, -mags]))


def test_quantize_is_exact_on_representable_values_and_close_otherwise():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (4, 8, 128), dtype=torch.uint8, generator=g)
    codes[..., ::32] = 7  # each group holds a 6 * 2**e, so the shared exponent is recovered exactly
    scales = torch.randint(100, 140, (4, 8, 4), dtype=torch.uint8, generator=g)
    packed = mxfp4_pack_codes(codes)
    w = mxfp4_dequantize(packed, scales)
    p2, s2 = mxfp4_quantize(w)
    assert torch.equal(mxfp4_dequantize(p2, s2), w)

    x = torch.randn(64, 256, generator=g)
    px, sx = mxfp4_quantize(x)
    err = (mxfp4_dequantize(px, sx) - x).norm() / x.norm()
    assert 0.01 < err < 0.2  # 4-bit: coarse but bounded


def test_fp8_round_trip():
    x = torch.randn(3, 100, 576)
    scale = fp8_scale_for(x)
    q = fp8_quantize(x, scale)
    assert q.dtype == FP8_DTYPE
    err = (fp8_dequantize(q, scale) - x).norm() / x.norm()
    assert err < 0.05
    assert fp8_dequantize(fp8_quantize(x * 1e6, scale), scale).abs().max() <= 448 * scale * 1.0001  # saturates
