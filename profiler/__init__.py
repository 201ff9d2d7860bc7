"""Getting traces in: recorders (CUPTI, torch.profiler, Nsight Systems) and readers, plus the `kprof` CLI."""
