"""The generic backend against the float64 reference, on the `tiny` model (CPU)."""
import pytest
import torch

from kimi_decode import DecodeSlice, reference as R
from kimi_decode.backends import get_backend
from kimi_decode.config import shard
from kimi_decode.testing import BF16_TOL, check_layer, check_routing, layer_case, rel_err
from kimi_decode.weights import init_layer

TINY = shard("tiny")


def _layer_inputs(layer, batch, seed):
    return layer_case(TINY, layer, batch, seed, context=40)


# layer 0: dense MLP and a block start; 1: KDA + MoE; 3: MLA + MoE; 4: KDA at a block start; 12: the last (MLA)
@pytest.mark.parametrize("layer", [0, 1, 3, 4, 12])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_auto_layer_matches_reference(layer, batch):
    seed = 1000 * layer + batch  # fresh random weights and inputs for every case
    lw, res, state = _layer_inputs(layer, batch, seed)
    check = check_layer(get_backend("auto", poison=True), lw, res, state, TINY)
    check.assert_within(BF16_TOL)
    assert check.errors["partial"] > 0  # the comparison saw bf16 arithmetic, not a copy of the reference


def test_a_wrong_layer_fails_the_check():
    lw, res, state = _layer_inputs(1, 4, seed=7)
    other = init_layer(TINY, 1, seed=8)
    lw.attn.o_proj = other.attn.o_proj
    backend = get_backend("auto")
    from kimi_decode.model import decode_layer
    res_b, st_b = res.clone(), state.clone()
    decode_layer(backend, lw, res_b, st_b, TINY)
    lw_ref = init_layer(TINY, 1, seed=7)
    res_r, _ = R.decode_layer(lw_ref, res, state, TINY, route_ids=backend.last_routes[1])
    assert rel_err(res_b.partial, res_r.partial) > 10 * BF16_TOL


def test_routing_check_accepts_only_near_ties():
    sel = torch.tensor([[0.9, 0.8, 0.7, 0.695, 0.1]])
    check_routing(sel, torch.tensor([[0, 1, 3]]))  # 0.695 vs 0.7: a near-tie
    with pytest.raises(AssertionError):
        check_routing(sel, torch.tensor([[0, 1, 4]]))
    with pytest.raises(AssertionError):
        check_routing(sel, torch.tensor([[0, 0, 1]]))


def _reference_step(sl: DecodeSlice, states, routes):
    res = sl.input.clone()
    new_states = []
    for lw, st in zip(sl.layers, states):
        res, st = R.decode_layer(lw, res, st, sl.shard, route_ids=routes.get(lw.index))
        new_states.append(st)
    return res, new_states


@pytest.mark.parametrize("first, n", [(1, 4), (2, 5)])  # (2, 5) crosses the block boundary at layer 4
def test_slice_runs_several_steps_with_states_updated(first, n):
    sl = DecodeSlice(model="tiny", tp=1, batch=8, first_layer=first, num_layers=n, context=32, device="cpu",
                     seed=first)
    ref_states = [st.clone() for st in sl.states]
    lengths0 = [st.lengths.clone() for st in sl.states if hasattr(st, "lengths")]
    for step in range(3):
        before = [st.clone() for st in sl.states]
        sl.step()
        ref_res, ref_states = _reference_step(sl, ref_states, sl.backend.last_routes)
        assert rel_err(sl.res.partial, ref_res.partial) < BF16_TOL
        for b, a in zip(before, sl.states):  # every state moved
            for name, t in a.tensors():
                if t.is_floating_point() and name != "scale":  # the FP8 scale is fixed by design
                    assert not torch.equal(t, getattr(b, name)), name
        # carry on from the backend's own states so errors do not compound across steps
        ref_states = [st.clone() for st in sl.states]
    lengths = [st.lengths for st in sl.states if hasattr(st, "lengths")]
    assert lengths and all(torch.equal(l1, l0 + 3) for l0, l1 in zip(lengths0, lengths))


def test_activations_stay_of_order_one_across_the_model():
    sl = DecodeSlice(model="tiny", tp=1, batch=4, first_layer=0, num_layers=13, context=16, device="cpu")
    sl.step()
    rms = sl.res.partial.pow(2).mean().sqrt().item()
    blocks = sl.res.blocks[:, : sl.shard.model.num_blocks].pow(2).mean(-1).sqrt()
    assert 0.05 < rms < 10 and torch.isfinite(sl.res.partial).all()
    assert ((blocks > 0.05) & (blocks < 10)).all(), blocks


def test_instrumentation_names_reach_torch_profiler():
    sl = DecodeSlice(model="tiny", tp=1, batch=1, first_layer=2, num_layers=2, context=8, device="cpu")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sl.step()
    names = {e.name for e in prof.events()}
    assert {"decode_step", "layer[2]:kda", "layer[3]:mla", "attn_res", "qkv_proj", "kda_core", "mla_core",
            "o_proj", "router", "shared_experts", "routed_experts", "moe_tail"} <= names


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="batch"):
        DecodeSlice(model="tiny", tp=1, batch=65, device="cpu")
    with pytest.raises(ValueError, match="outside"):
        DecodeSlice(model="tiny", tp=1, first_layer=10, num_layers=4, device="cpu")
    with pytest.raises(ValueError, match="unknown backend"):
        DecodeSlice(model="tiny", tp=1, backend="fast", device="cpu")
