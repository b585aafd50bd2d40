import pytest
import torch

from pnmix.config import CRITERIA
from pnmix.saliency import pair_channels, saliency_scores, select_salient_pairs


def planted(pairs_to_plant, pairing="rotate_half", d=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((1, 4, 20, d), generator=gen) * 0.1
    k = torch.randn((1, 2, 20, d), generator=gen) * 0.1
    for i in pairs_to_plant:
        a, b = (i, i + d // 2) if pairing == "rotate_half" else (2 * i, 2 * i + 1)
        for x in (q, k):  # large in magnitude, norm and range
            x[..., a] = x[..., a] * 20 + 3.0
            x[..., b] = x[..., b] * 20 - 2.0
    return q, k


@pytest.mark.parametrize("criterion", [c for c in CRITERIA if c != "random"])
@pytest.mark.parametrize("pairing", ["rotate_half", "interleaved"])
def test_planted_high_norm_pairs_are_selected(criterion, pairing):
    plant = [2, 9, 13]
    q, k = planted(plant, pairing)
    mask = torch.ones((1, 20), dtype=torch.bool)
    scores = saliency_scores(criterion, q, k, mask, pairing)
    assert scores.shape == (1, 2, 16)
    assert select_salient_pairs(scores, 3).tolist() == [[plant, plant]]


def test_pairing_follows_the_model_family():
    # Adjacent channels (4, 5) are not a rotate_half pair: one big pair must not look like two.
    d = 32
    q, k = planted([], d=d)
    for x in (q, k):
        x[..., 4] += 3.0
        x[..., 4 + d // 2] += 3.0
    mask = torch.ones((1, 20), dtype=torch.bool)
    top = select_salient_pairs(saliency_scores("qk_pair_norm", q, k, mask, "rotate_half"), 1)
    assert top.flatten().tolist() == [4, 4]
    assert pair_channels(top, d, "rotate_half").tolist() == [[[4, 20], [4, 20]]]
    assert pair_channels(torch.tensor([[1, 3]]), 8, "interleaved").tolist() == [[2, 3, 6, 7]]


def test_pad_tokens_do_not_count():
    q, k = planted([5])
    k[:, :, :4, 11] = 100.0  # huge values only in the (padded) first tokens
    q[:, :, :4, 11] = 100.0
    mask = torch.ones((1, 20), dtype=torch.bool)
    mask[0, :4] = False
    top = select_salient_pairs(saliency_scores("qk_pair_norm", q, k, mask, "rotate_half"), 1)
    assert top.flatten().tolist() == [5, 5]


def test_query_norms_average_over_the_kv_group():
    d = 16
    q = torch.zeros((1, 4, 3, d))
    k = torch.ones((1, 2, 3, d))
    q[:, 0, :, 1] = 4.0  # query head 0 reads KV head 0 (group of 2)
    scores = saliency_scores("qk_pair_norm", q, k, torch.ones((1, 3), dtype=torch.bool), "rotate_half")
    assert scores[0, 0, 1].item() == pytest.approx(2.0 * 2**0.5)  # mean of 4 and 0, times ||(1, 1)||
    assert scores[0, 1].abs().sum().item() == 0.0


def test_random_criterion_is_seeded():
    q, k = planted([])
    mask = torch.ones((1, 20), dtype=torch.bool)
    a = saliency_scores("random", q, k, mask, "rotate_half", seed=3)
    assert torch.equal(a, saliency_scores("random", q, k, mask, "rotate_half", seed=3))
    assert not torch.equal(a, saliency_scores("random", q, k, mask, "rotate_half", seed=4))
