"""The process's shared streams: one per device and purpose, whoever asks (slices built one after another must not
each make a stream of their own: torch keeps a cuBLAS workspace per stream for the process)."""
import torch

from kimi_decode import streams


def test_one_stream_per_device_and_name_made_once(monkeypatch):
    made = []

    def fake_stream(device):
        made.append(device)
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
        assert len({id(warmup), id(other_name), id(other_device)}) == 3
        assert made == [torch.device("cuda", 1), torch.device("cuda", 1), torch.device("cuda", 0)]
    finally:
        streams._stream.cache_clear()
