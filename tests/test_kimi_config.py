import pytest

from kimi_decode.config import DENSE, K3, KDA, MLA, TINY, shard


def test_k3_layer_schedule():
    kinds = K3.schedule()
    mla = [i for i, k in enumerate(kinds) if k == MLA]
    assert mla == list(range(3, 92, 4)) + [92]
    assert len(mla) == 24 and kinds.count(KDA) == 69
    assert K3.layer_kind(0) == DENSE and K3.mlp_kind(0) == DENSE and K3.mlp_kind(1) == "moe"
    assert [K3.layer_kind(i) for i in (1, 2, 3, 4)] == ["kda", "kda", "mla", "kda"]
    assert K3.num_blocks == 8 and K3.completed_blocks(92) == 8


@pytest.mark.parametrize("tp, heads, rows, expert, expert_used, shared", [
    (1, 96, 4 * 12288 + 128 + 96, 3072, 3072, 6144),
    (8, 12, 6288, 384, 384, 768),
    (16, 6, 3216, 256, 192, 384),
])
def test_k3_shards_match_the_spec_table(tp, heads, rows, expert, expert_used, shared):
    s = shard("k3", tp=tp)
    assert s.kda_heads == heads and s.mla_heads == heads
    assert s.kda_in_proj_rows == rows and s.kda_in_proj_rows % 16 == 0
    assert s.expert_inter == expert and s.expert_inter_used == expert_used
    assert s.shared_inter == shared


def test_in_proj_layout_is_contiguous_and_padded():
    s = shard("k3", tp=8)
    lay = s.kda_in_proj_layout
    assert list(lay) == ["q", "k", "v", "g", "f_a", "b"]
    assert lay["f_a"][1] - lay["f_a"][0] == 128 and lay["b"][1] - lay["b"][0] == 12
    assert lay["b"][1] == 6284 < s.kda_in_proj_rows == 6288


def test_unpadded_experts_and_bad_shards():
    assert shard("k3", tp=16, pad_experts=False).expert_inter == 192
    with pytest.raises(ValueError, match="rank"):
        shard("k3", tp=8, rank=8)
    with pytest.raises(ValueError, match="divide"):
        shard("k3", tp=5)
    with pytest.raises(ValueError, match="outside"):
        K3.attention_kind(93)


def test_tiny_has_the_same_structure():
    assert TINY.schedule()[:4] == ["kda", "kda", "kda", "mla"] and TINY.schedule()[-1] == "mla"
    assert TINY.layer_kind(0) == DENSE
