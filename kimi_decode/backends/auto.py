"""The generic decode path: one operation per kernel, as vLLM's normal forward runs it.

cuBLAS GEMMs through torch, torch element-wise ops, and Triton kernels where the generic path uses Triton (AttnRes,
the KDA convolution and recurrent step, the gated norm, activations, and the MXFP4 routed-expert GEMVs, which read
only the selected experts). On the CPU, or where Triton is missing, each Triton kernel has a torch twin computing the
same function, so the `tiny` model runs anywhere. Every method allocates its outputs with torch: under CUDA-graph
capture they come from the graph's private pool, so replays reuse the same buffers.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..config import ShardConfig
from ..quant import FP8_DTYPE, FP8_MAX, mxfp4_dequantize
from ..state import KDAState, MLACache, ResidualState
from ..weights import AttnResWeights, KDAWeights, MLAWeights, MoEWeights

try:
    from ..kernels import triton_kernels as tk
except ImportError:  # no Triton (CPU-only installs): torch twins run instead
    tk = None

BF16 = torch.bfloat16


def _situ_glu_torch(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.float().chunk(2, dim=-1)
    return 4 * torch.tanh(gate / 4) * torch.sigmoid(gate) * (25 * torch.tanh(up / 25))


class AutoBackend:
    """Stage implementations of the generic path. Other backends override the stages they specialise."""

    name = "auto"

    def __init__(self, poison: bool = False):
        self.last_routes: dict[int, torch.Tensor] = {}  # layer -> top-k expert ids of the last step, for checks
        self.poison = poison  # fill every output buffer with NaN first, so an unwritten element shows

    def _empty(self, *shape, dtype=BF16, device=None) -> torch.Tensor:
        if self.poison:
            return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)
        return torch.empty(shape, dtype=dtype, device=device)

    @staticmethod
    def _use_triton(t: torch.Tensor) -> bool:
        return tk is not None and t.is_cuda

    def begin_layer(self, lw, batch: int, reduced: bool = False) -> None:
        """Called before each layer; a specialized backend picks its kernels (or falls back) here. `reduced`: the
        layer's partial results are all-reduced across ranks between stages (tensor parallel over several GPUs)."""

    def end_layer(self) -> None:
        """Called after each layer, also when it raised."""

    def branch(self, name: str, *inputs: torch.Tensor):
        """Context for a stage that may run beside the main stream (a fork of the MoE block). The generic path runs
        every stage in order on the current stream."""
        return contextlib.nullcontext()

    def join(self, name: str, *outputs: torch.Tensor) -> None:
        """The current stream waits for the branch `name` (nothing to wait for in the generic path)."""

    # ---- AttnRes -----------------------------------------------------------------------------------------------------
    def attn_res(self, res: ResidualState, w: AttnResWeights, *, n_blocks: int, commit: bool,
                 delta: torch.Tensor | None, delta_mode: int, use_partial: bool, eps: float) -> torch.Tensor:
        """Residual update (delta_mode 1: partial += delta, 2: partial = delta), optional commit of the open block
        into blocks[n_blocks - 1], softmax mix over candidates, then the sublayer's input RMSNorm -> bf16 [B, H]."""
        out = self._empty(*res.partial.shape, device=res.partial.device)
        if self._use_triton(out):
            tk.attn_res(res.blocks, res.partial, delta, w.query, w.key_norm, w.input_norm, out, n_blocks=n_blocks,
                        commit=commit, delta_mode=delta_mode, use_partial=use_partial, eps=eps)
            return out
        if commit:
            res.blocks[:, n_blocks - 1] = res.partial
        if delta_mode == 1:
            res.partial += delta.float()
        elif delta_mode == 2:
            res.partial.copy_(delta)
        cands = res.blocks[:, :n_blocks]
        if use_partial:
            cands = torch.cat([cands, res.partial.unsqueeze(1)], dim=1)
        keys = cands * torch.rsqrt(cands.pow(2).mean(-1, keepdim=True) + eps)
        probs = torch.softmax(keys @ (w.key_norm * w.query), dim=-1)
        mix = (probs.unsqueeze(-1) * cands).sum(1)
        out.copy_(F.rms_norm(mix, (mix.shape[-1],), w.input_norm, eps))
        return out

    # ---- dense pieces ------------------------------------------------------------------------------------------------
    @staticmethod
    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    def attn_out_proj(self, o: torch.Tensor, w) -> torch.Tensor:
        return self.linear(o, w.o_proj)

    def situ_glu(self, h: torch.Tensor) -> torch.Tensor:
        if self._use_triton(h):
            out = self._empty(h.shape[0], h.shape[1] // 2, device=h.device)
            tk.situ_glu(h, out)
            return out
        return _situ_glu_torch(h).to(BF16)

    def glu_mlp(self, x, gate_up, down):
        return self.linear(self.situ_glu(self.linear(x, gate_up)), down)

    # ---- KDA ---------------------------------------------------------------------------------------------------------
    def kda_in_proj(self, x: torch.Tensor, w: KDAWeights, shard: ShardConfig):
        y = self.linear(x, w.in_proj)
        a, b = shard.kda_in_proj_layout["f_a"]
        f = self.linear(y[:, a:b], w.f_b)
        return y, f

    def kda_core(self, y: torch.Tensor, f: torch.Tensor, w: KDAWeights, state: KDAState, shard: ShardConfig):
        """Short conv + SiLU, gate, beta, q/k L2 norm and the delta rule on the fp32 state, gated RMSNorm."""
        m, h, D, d = shard.model, shard.kda_heads, shard.model.kda_head_dim, shard.kda_dim
        lay = shard.kda_in_proj_layout
        B = y.shape[0]
        qkv_in = y[:, : 3 * d]
        beta_src = y[:, lay["b"][0]: lay["b"][1]]
        g = y[:, lay["g"][0]: lay["g"][1]]
        out = self._empty(B, d, device=y.device)
        if self._use_triton(y):
            qkv = self._empty(B, 3 * d, device=y.device)
            tk.conv_update(qkv_in, state.conv, w.conv, qkv)
            o = self._empty(B, d, device=y.device)
            tk.kda_recurrent(qkv, f, beta_src, w.A_log, w.dt_bias, state.recurrent, o,
                             lower_bound=m.kda_gate_lower_bound)
            tk.gated_rmsnorm(o, g, w.o_norm, out, heads=h, eps=m.rms_eps)
            return out
        window = torch.cat([state.conv.float(), qkv_in.float().unsqueeze(-1)], dim=-1)
        state.conv.copy_(window[..., 1:])
        qkv = F.silu((window * w.conv).sum(-1)).to(BF16).float()
        q, k, v = (t.reshape(B, h, D) for t in qkv.split(d, dim=-1))
        q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * D**-0.5
        k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        decay = m.kda_gate_lower_bound * torch.sigmoid(
            torch.exp(w.A_log).view(1, h, 1) * (f.float() + w.dt_bias).view(B, h, D))
        beta = torch.sigmoid(beta_src.float()).view(B, h, 1, 1)
        S = state.recurrent
        S.mul_(torch.exp(decay).unsqueeze(-1))
        kS = torch.einsum("bhk,bhkv->bhv", k, S)
        S.add_(beta * torch.einsum("bhk,bhv->bhkv", k, v - kS))
        o = torch.einsum("bhk,bhkv->bhv", q, S).to(BF16).float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + m.rms_eps) * w.o_norm
        out.copy_((o * torch.sigmoid(g.float().view(B, h, D))).reshape(B, d))
        return out

    # ---- MLA ---------------------------------------------------------------------------------------------------------
    def mla_in_proj(self, x: torch.Tensor, w: MLAWeights, shard: ShardConfig):
        """-> q [B, h, nope + rope], the new latent cache entry [B, kv_lora + rope], gate pre-activation [B, h v]."""
        m, h = shard.model, shard.mla_heads
        qkv = self.linear(x, w.qkv_a)
        q_lat, kv_lat = qkv[:, : m.q_lora_rank], qkv[:, m.q_lora_rank:]
        q_lat = F.rms_norm(q_lat.float(), (m.q_lora_rank,), w.q_a_norm, m.latent_eps).to(BF16)
        q = self.linear(q_lat, w.q_b).view(-1, h, m.qk_head_dim)
        c = F.rms_norm(kv_lat[:, : m.kv_lora_rank].float(), (m.kv_lora_rank,), w.kv_a_norm, m.latent_eps)
        entry = torch.cat([c, kv_lat[:, m.kv_lora_rank:].float()], dim=-1)
        gate = self.linear(x, w.g_proj)
        return q, entry, gate

    def mla_core(self, q, entry, gate, w: MLAWeights, cache: MLACache, shard: ShardConfig):
        """Write the new token into the FP8 cache, absorbed NoPE attention over it, W_UV, output gate."""
        m, h = shard.model, shard.mla_heads
        B = q.shape[0]
        nope, vd, C = m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank
        pos = cache.lengths.clamp(max=cache.capacity - 1)
        rows = torch.arange(B, device=q.device)
        cache.kv[rows, pos] = (entry / cache.scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        cache.lengths.add_(1).clamp_(max=cache.capacity)

        kv_b = w.kv_b.view(h, nope + vd, C)
        q_abs = torch.bmm(q[..., :nope].transpose(0, 1), kv_b[:, :nope])  # [h, B, C]
        q_full = torch.cat([q_abs.transpose(0, 1), q[..., nope:]], dim=-1)  # [B, h, C + rope]
        sm_scale = m.qk_head_dim**-0.5
        if self._use_triton(q):
            o_lat = self._empty(B, h, C, device=q.device)
            tk.mla_decode(q_full, cache.kv, cache.scale, cache.lengths, o_lat, sm_scale=sm_scale, kv_lora=C)
        else:
            lat = cache.kv.to(BF16)  # unscaled: the scale multiplies the scores and the output
            scores = torch.bmm(q_full, lat.transpose(1, 2)).float() * (cache.scale * sm_scale)
            t = torch.arange(cache.capacity, device=q.device)
            scores.masked_fill_(t.view(1, 1, -1) >= cache.lengths.view(B, 1, 1), float("-inf"))
            p = torch.softmax(scores, dim=-1).to(BF16)
            o_lat = torch.bmm(p, lat[..., :C]) * cache.scale.to(BF16)  # [B, h, C]
        o = torch.bmm(o_lat.transpose(0, 1), kv_b[:, nope:].transpose(1, 2))  # [h, B, v]
        return (o.transpose(0, 1) * torch.sigmoid(gate.view(B, h, vd))).reshape(B, h * vd)

    # ---- MoE ---------------------------------------------------------------------------------------------------------
    def router(self, x: torch.Tensor, w: MoEWeights, shard: ShardConfig, layer: int):
        """fp32 logits, sigmoid scores, top-k on score + correction bias, renormalised weights."""
        m = shard.model
        logits = self.router_logits(x, w)
        if self._use_triton(x):
            ids = self._empty(x.shape[0], m.top_k, dtype=torch.int32, device=x.device)
            weights = self._empty(x.shape[0], m.top_k, dtype=torch.float32, device=x.device)
            tk.route_topk(logits, w.router_bias, ids, weights, scaling=m.routed_scaling)
        else:
            scores = torch.sigmoid(logits)
            ids = torch.topk(scores + w.router_bias, m.top_k, dim=-1).indices
            weights = scores.gather(-1, ids)
            weights = weights / weights.sum(-1, keepdim=True) * m.routed_scaling
        self.last_routes[layer] = ids
        return ids, weights

    @staticmethod
    def router_logits(x: torch.Tensor, w: MoEWeights) -> torch.Tensor:
        if x.is_cuda:  # bf16 operands, fp32 accumulation and output in one cuBLAS call
            return torch.mm(x, w.router.T, out_dtype=torch.float32)
        return torch.mm(x.float(), w.router.T.float())

    def shared_experts(self, x: torch.Tensor, w: MoEWeights) -> torch.Tensor:
        return self.glu_mlp(x, w.shared_gate_up, w.shared_down)

    def routed_experts(self, x, ids, weights, w: MoEWeights, shard: ShardConfig) -> torch.Tensor:
        """Latent down-projection, then the selected experts (this rank's slice) -> weighted sum, fp32 [B, latent]."""
        return self.experts_on_latent(self.latent_down(x, w), ids, weights, w, shard)

    def expert_alignment(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """The (token, slot) pairs of `ids` [B, k] sorted by expert (Triton `moe_align`): pair order, and per distinct
        expert its segment's start, length and id, four int32 [B * k]."""
        align = [self._empty(ids.numel(), dtype=torch.int32, device=ids.device) for _ in range(4)]
        tk.moe_align(ids.reshape(-1), *align)
        return align

    def experts_on_latent(self, latent, ids, weights, w: MoEWeights, shard: ShardConfig) -> torch.Tensor:
        """The selected experts (this rank's slice) on the latent [B, latent] -> weighted sum, fp32 [B, latent]."""
        B, k = ids.shape
        if self._use_triton(latent):
            align = self.expert_alignment(ids)
            h = self._empty(B * k, w.w13.shape[1], device=latent.device)
            tk.moe_mxfp4(latent, w.w13, w.w13_scale, align, h, x_per_pair=False)
            act = self.situ_glu(h)
            out = self._empty(B * k, w.w2.shape[1], dtype=torch.float32, device=latent.device)
            tk.moe_mxfp4(act, w.w2, w.w2_scale, align, out, x_per_pair=True, row_scale=weights.reshape(-1))
            return out.view(B, k, -1).sum(1)
        group = shard.model.mxfp4_group
        ids = ids.long()
        w13 = mxfp4_dequantize(w.w13[ids], w.w13_scale[ids], torch.float32, group)  # [B, k, 2I, latent]
        w2 = mxfp4_dequantize(w.w2[ids], w.w2_scale[ids], torch.float32, group)  # [B, k, latent, I]
        h = torch.einsum("bkil,bl->bki", w13, latent.float()).to(BF16)
        act = _situ_glu_torch(h).to(BF16).float()
        return torch.einsum("bkli,bki,bk->bl", w2, act, weights)

    def latent_down(self, x: torch.Tensor, w: MoEWeights) -> torch.Tensor:
        return self.linear(x, w.down)

    def moe_tail(self, routed: torch.Tensor, shared: torch.Tensor, w: MoEWeights, res: ResidualState,
                 shard: ShardConfig) -> None:
        """RMSNorm of the reduced latent, up-projection, and the block output added to the residual."""
        m = shard.model
        normed = F.rms_norm(routed, (m.moe_latent,), w.latent_norm, m.rms_eps).to(BF16)
        res.partial.add_(self.linear(normed, w.up)).add_(shared)
