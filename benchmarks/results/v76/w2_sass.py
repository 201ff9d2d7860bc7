"""Compile the expert kernels for sm_90a on a machine without a GPU (fake tensors, as the backend gives them:
quad-major codes, w2 rows cut to their used columns) so that their PTX can be assembled and read (item 135):

    KIMI_DECODE_W2_STAGE_ACT=1 CUTE_DSL_KEEP=ptx CUTE_DSL_DUMP_DIR=/tmp/dump TP=16 B=8 python w2_sass.py
    ptxas -arch=sm_90a -v /tmp/dump/*MoEW2Sum*.ptx -o w2.cubin && nvdisasm -c w2.cubin | grep -E "LDG|LDS|BAR|HMMA"

(cutlass-dsl 4.3.5 writes its PTX with CUTE_DSL_KEEP_PTX=1 and a trailing NUL byte: `tr -d '\\000'` before ptxas.)
TP, B and SHARED=1 (batch 1 with the shared experts' down-projection inside the w2 kernel) pick the form."""
import os

import torch

os.environ.setdefault("KIMI_DECODE_CUTE_ARCH", "sm_90a")

from kimi_decode.config import shard  # noqa: E402
from kimi_decode.kernels.moe_mxfp4 import compile_moe, quad_major  # noqa: E402

s = shard("k3", tp=int(os.environ.get("TP", "16")))
m, B = s.model, int(os.environ.get("B", "8"))
E, L, I, k, used = m.num_experts, m.moe_latent, s.expert_inter, m.top_k, s.expert_inter_used
u8, bf = torch.uint8, torch.bfloat16
args = (torch.empty(B, L, dtype=bf), torch.empty(B, k, dtype=torch.int32), torch.empty(B, k),
        quad_major(torch.zeros(E, 2 * I, L // 2, dtype=u8)), torch.empty(E, 2 * I, L // 32, dtype=u8),
        quad_major(torch.zeros(E, L, used // 2, dtype=u8)), torch.empty(E, L, I // 32, dtype=u8),
        torch.empty(B * k, used, dtype=torch.float16), torch.empty(B, L), torch.empty(B, L // 16), used)
shared = None
if os.environ.get("SHARED") == "1":
    H, S = m.hidden, s.shared_inter
    shared = (torch.empty(2 * S, H, dtype=bf), torch.empty(1, H, dtype=bf), torch.empty(1, S, dtype=bf),
              torch.empty(H, S, dtype=bf), torch.empty(1, H, dtype=bf))
print(compile_moe(*args, scaled=(torch.empty(L), torch.empty(B, L, dtype=bf)), quad_major=True, shared=shared,
                  shared_act_ready=shared is not None))
