"""The process's shared streams: one per device and purpose, whoever asks (slices and backends built one after
another must not each make streams of their own: torch keeps a cuBLAS workspace per stream for the process)."""
import torch

from kimi_decode import streams


def test_one_stream_per_device_and_name_made_once(monkeypatch):
    made = []

    def fake_stream(device, priority=0):
        made.append((device, priority))
        return object()

    monkeypatch.setattr(torch.cuda, "Stream", fake_stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    streams._stream.cache_clear()
    try:
        router = streams.process_stream(torch.device("cuda", 1), "router", priority=-1)
        assert streams.process_stream("cuda", "router", priority=-1) is router  # no index: the current device
        assert streams.process_stream("cuda:1", "router", priority=-1) is router
        warmup = streams.process_stream("cuda:1", "warmup")
        other_device = streams.process_stream("cuda:0", "warmup")
        assert len({id(router), id(warmup), id(other_device)}) == 3
        assert made == [(torch.device("cuda", 1), -1), (torch.device("cuda", 1), 0), (torch.device("cuda", 0), 0)]
    finally:
        streams._stream.cache_clear()
