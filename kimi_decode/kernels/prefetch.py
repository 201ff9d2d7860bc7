"""L2 prefetch of a weight tensor's first bytes, for a later kernel, while latency-bound kernels run beside it.

At batch 1 the KDA core, the output projection and AttnRes (about 15 us per layer) and the expert kernels (about
15 us) leave most of the HBM bandwidth unused, and the kernels after them (the 51 MB latent down-projection and the
51 MB up-projection) are pure weight streams. A few CTAs on a stream of their own ask L2 for the first part of those
weights with bulk prefetches (`cp.async.bulk.prefetch.L2`, one request per 4 KB chunk, handled by the copy engine of
the SM, no data returned to the CTA), so the streaming kernel later finds that part in L2 and reads less from HBM.
The prefetch is only a hint: what L2 drops again is read from HBM as before, and results never depend on it.

The first bytes of a weight serve a kernel whose CTAs run in waves over its rows (the GEMVs at batch 1). A projection
of one wave (the warpgroup-mma kernel from 2 rows: every CTA starts at once, each streaming its row group's K slice
from its start) ends when its slowest CTA does, so the first rows in L2 only let some CTAs end early. `stripe_view`
instead names the first part of every row's K slice as the projection splits K (`gemm_wgmma.WgmmaPlan`): each CTA
then finds the same share of its stream in L2.
"""
from __future__ import annotations

import torch

from .cute_common import HAVE_CUTE, compile_kernel, cute, cutlass, fake_like, launch, signature

CHUNK = 4096  # bytes per bulk prefetch request
THREADS = 128
CTAS = 16  # enough copy engines to request several TB/s


if HAVE_CUTE:
    from .cute_common import bulk_prefetch_l2

    class PrefetchL2:
        """Bulk-prefetch every [r, s, :] of a [rows, stripes, head] byte view (head a multiple of 16, each stripe
        16-byte aligned) into L2: one request per stripe."""

        def __init__(self, rows: int, stripes: int, head: int):
            self.stripes, self.head = stripes, head
            self.requests = rows * stripes
            self.per_thread = -(-self.requests // (CTAS * THREADS))

        @cute.jit
        def __call__(self, data: cute.Tensor, stream):
            self.kernel(data).launch(grid=[CTAS, 1, 1], block=[THREADS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, data: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            first = bidx * THREADS + tidx
            for i in cutlass.range_constexpr(self.per_thread):
                c = first + i * (CTAS * THREADS)
                if c < self.requests:
                    r = c // self.stripes
                    bulk_prefetch_l2(data[r, c - r * self.stripes, None], self.head)


def _byte_rows(w: torch.Tensor) -> torch.Tensor:
    if not w.is_contiguous() or w.data_ptr() % 16:
        raise ValueError("L2 prefetch needs a contiguous, 16-byte aligned tensor")
    return w.view(-1).view(torch.uint8)


def prefetch_view(w: torch.Tensor, nbytes: int) -> torch.Tensor | None:
    """The first `nbytes` of `w` (rounded down to whole chunks, at most all of it) as a [chunks, 1, CHUNK] uint8 view,
    or None when that is not a single chunk."""
    data = _byte_rows(w)
    chunks = min(nbytes, data.numel()) // CHUNK
    if chunks < 1:
        return None
    return data[: chunks * CHUNK].view(chunks, 1, CHUNK)


def stripe_view(w: torch.Tensor, split: int, percent: int) -> torch.Tensor | None:
    """The first `percent` % of each K slice of `split` columns (the last slice may be shorter) of every row of the 2-D
    weight `w`, as a [rows, slices, head] uint8 view of its bytes: head is `percent` % of a slice's bytes rounded down
    to 16, at most the shortest slice's; None when that is 0."""
    if w.dim() != 2 or not 0 < split:
        raise ValueError("stripe_view needs a 2-D weight and a positive slice width")
    data = _byte_rows(w)
    rows, K = w.shape
    esize = w.element_size()
    slices = -(-K // split)
    head = min(split * esize * percent // 100, (K - (slices - 1) * split) * esize) // 16 * 16
    if (K * esize) % 16 or (split * esize) % 16 or head < 16:
        return None
    return data.as_strided((rows, slices, head), (K * esize, split * esize, 1))


def compile_prefetch(view: torch.Tensor):
    return compile_kernel(("prefetch_l2", *signature(view)), PrefetchL2(*view.shape), fake_like(view))


def prefetch_bytes(view: torch.Tensor | None) -> None:
    """Ask L2 for the bytes of `view` (`prefetch_view`, `stripe_view`) on the current stream; returns before the
    data arrives. None asks for nothing."""
    if view is not None:
        launch(compile_prefetch(view), view)


def prefetch_weights(w: torch.Tensor, nbytes: int) -> None:
    """Ask L2 for the first `nbytes` of `w`, on the current stream (returns before the data arrives)."""
    prefetch_bytes(prefetch_view(w, nbytes))
