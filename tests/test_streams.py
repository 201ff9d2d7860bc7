"""The process's shared streams: one per device and purpose, whoever asks (slices built one after another must not
each make a stream of their own: torch keeps a cuBLAS workspace per stream for the process)."""
import torch

from kimi_decode import streams


def test_one_stream_per_device_name_and_priority_made_once(monkeypatch):
    made = []

    def fake_stream(device, priority=0):
        made.append((device, priority))
        return object()

    monkeypatch.setattr(torch.cuda, "Stream", fake_stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    streams._stream.cache_clear()
    try:
        warmup = streams.process_stream(torch.device("cuda", 1), "warmup")
        assert streams.process_stream("cuda", "warmup") is warmup  # no index: the current device
        assert streams.process_stream("cuda:1", "warmup") is warmup
        other_name = streams.process_stream("cuda:1", "other")
        other_device = streams.process_stream("cuda:0", "warmup")
        router = streams.process_stream("cuda:1", "router", priority=-1)
        assert streams.process_stream("cuda", "router", priority=-1) is router
        assert len({id(warmup), id(other_name), id(other_device), id(router)}) == 4
        cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
        assert made == [(cuda1, 0), (cuda1, 0), (cuda0, 0), (cuda1, -1)]
    finally:
        streams._stream.cache_clear()
