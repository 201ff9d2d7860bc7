"""The benchmark scripts' timing: back-to-back launches captured in one CUDA graph, timed by device events."""
import statistics

import torch


def launch_us(fn, n: int, replays: int) -> float:
    """us per launch of fn: a graph of 2n launches fn(i % n) (n rotated inputs, so weights come from HBM), the median
    over `replays` replays after 3 warm-up ones."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(2 * n):
            fn(i % n)
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / (2 * n))
    return statistics.median(times)
