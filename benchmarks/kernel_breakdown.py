"""Per-kernel GPU time of one backend's decode step (CUDA-graph replays under torch.profiler).

    python benchmarks/kernel_breakdown.py --backend auto --tp 16 --batch 1
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from kimi_decode import DecodeSlice

p = argparse.ArgumentParser()
p.add_argument("--backend", default="auto")
p.add_argument("--tp", type=int, default=16)
p.add_argument("--batch", type=int, default=1)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--replays", type=int, default=20)
a = p.parse_args()
sl = DecodeSlice(backend=a.backend, tp=a.tp, batch=a.batch, num_layers=a.layers, device="cuda")
sl.capture()
sl.run(5)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    sl.run(a.replays)
    torch.cuda.synchronize()
print(f"backend {a.backend} tp {a.tp} batch {a.batch}: {a.layers} layers, per-step totals")
table = {}
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        t = table.setdefault(e.name, [0, 0.0])
        t[0] += 1
        t[1] += e.device_time
rows = sorted(table.items(), key=lambda kv: -kv[1][1])
total = sum(v[1] for v in table.values()) / a.replays
print(f"{'us/step':>9} {'calls/step':>10}  kernel   (sum {total:.1f} us/step)")
for name, (n, us) in rows[:40]:
    print(f"{us / a.replays:9.1f} {n / a.replays:10.1f}  {name[:110]}")
