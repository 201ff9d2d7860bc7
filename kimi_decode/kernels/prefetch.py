"""L2 prefetch of a weight tensor's first bytes, for a later kernel, while latency-bound kernels run beside it.

At batch 1 the KDA core, the output projection and AttnRes (about 15 us per layer) and the expert kernels (about
15 us) leave most of the HBM bandwidth unused, and the kernels after them (the 51 MB latent down-projection and the
51 MB up-projection) are pure weight streams. A few CTAs on a stream of their own ask L2 for the first part of those
weights with bulk prefetches (`cp.async.bulk.prefetch.L2`, one request per 4 KB chunk, handled by the copy engine of
the SM, no data returned to the CTA), so the streaming kernel later finds that part in L2 and reads less from HBM.
The prefetch is only a hint: what L2 drops again is read from HBM as before, and results never depend on it.
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
        """Bulk-prefetch every CHUNK of a [chunks, CHUNK] byte view into L2."""

        def __init__(self, chunks: int):
            self.chunks = chunks
            self.per_thread = -(-chunks // (CTAS * THREADS))

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
                if c < self.chunks:
                    bulk_prefetch_l2(data[c, None], CHUNK)


def prefetch_view(w: torch.Tensor, nbytes: int) -> torch.Tensor | None:
    """The first `nbytes` of `w` (rounded down to whole chunks, at most all of it) as a [chunks, CHUNK] uint8 view,
    or None when that is not a single chunk."""
    if not w.is_contiguous() or w.data_ptr() % 16:
        raise ValueError("L2 prefetch needs a contiguous, 16-byte aligned tensor")
    chunks = min(nbytes, w.numel() * w.element_size()) // CHUNK
    if chunks < 1:
        return None
    return w.view(-1).view(torch.uint8)[: chunks * CHUNK].view(chunks, CHUNK)


def compile_prefetch(view: torch.Tensor):
    return compile_kernel(("prefetch_l2", *signature(view)), PrefetchL2(view.shape[0]), fake_like(view))


def prefetch_weights(w: torch.Tensor, nbytes: int) -> None:
    """Ask L2 for the first `nbytes` of `w`, on the current stream (returns before the data arrives)."""
    view = prefetch_view(w, nbytes)
    if view is not None:
        launch(compile_prefetch(view), view)
