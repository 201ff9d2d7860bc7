"""The generic backend at the real TP8 / TP16 shard shapes on a GPU, and CUDA-graph replay against eager runs."""
import pytest
import torch

from kimi_decode import DecodeSlice
from kimi_decode.backends import get_backend
from kimi_decode.config import shard
from kimi_decode.testing import BF16_TOL, check_layer, layer_case, rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("layer", [1, 3])  # KDA + MoE, MLA + MoE
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_auto_layer_matches_reference_at_shard_shapes(tp, layer, batch):
    s = shard("k3", tp=tp)
    lw, res, state = layer_case(s, layer, batch, seed=100 * tp + 10 * layer + batch, device="cuda")
    check = check_layer(get_backend("auto", poison=True), lw, res, state, s)
    print(tp, layer, batch, check.errors)
    check.assert_within(BF16_TOL)


def _snapshot(sl):
    return [st.clone() for st in sl.states]


def test_graph_replay_equals_eager():
    sl = DecodeSlice(backend="auto", tp=16, batch=8, first_layer=1, num_layers=4, context=1024, device="cuda")
    sl.capture()
    before = _snapshot(sl)
    sl.replay()
    torch.cuda.synchronize()
    graph_partial, graph_states = sl.res.partial.clone(), _snapshot(sl)
    for st, b in zip(sl.states, before):
        st.copy_(b)
    sl.res.partial.fill_(float("nan"))
    sl.step()
    torch.cuda.synchronize()
    assert rel_err(graph_partial, sl.res.partial) < 1e-6
    for g, e in zip(graph_states, sl.states):
        for name, t in e.tensors():
            assert torch.equal(getattr(g, name), t), name
