"""The campaign plot's reading aids: overlapping points drawn once with their count, a preset named
once, the front as steps."""

from types import SimpleNamespace

from pnmix.config import preset
from pnmix.layerwise import LayerRange, LayerwiseConfig
from pnmix.tuner.commands.plot import front_steps, spots


def rec(number, bits, accuracy, config, se=0.03):
    return SimpleNamespace(number=number, bits=bits, accuracy=accuracy, accuracy_se=se, config=config)


def test_overlapping_points_are_drawn_once_with_their_count_and_each_preset_is_named_once():
    paper, kivi2 = preset("pnmix-paper"), preset("kivi2")
    lw = LayerwiseConfig(paper, (LayerRange(3, 3, (("b_high", 2),)),))
    records = [rec(0, 2.263, 0.68, paper), rec(1, 2.250, 0.70, kivi2), rec(2, 2.255, 0.685, paper.with_(seed=1)),
               rec(3, 2.248, 0.81, lw), rec(4, 1.25, 0.01, preset("kivi1")), rec(5, 2.998, 0.933, paper.with_(b_low=2)),
               rec(6, 2.999, 0.933, paper.with_(b_low=2, residual_len=256))]
    marks = spots(records, front={3, 4, 5, 6})
    front = [s for s in marks if s.on_front]
    # 2.998 and 2.999 bits at the same accuracy: one marker of two points; 1.25 and 2.248 stay apart.
    assert sorted((round(s.bits, 3), s.count) for s in front) == [(1.25, 1), (2.248, 1), (2.998, 2)]
    assert next(s for s in front if s.bits == 2.248).layered
    # Off the front, 2.250-2.263 bits: pnmix-paper's two points (0.685, 0.68) merge, drawn at the first by
    # bits; kivi2 (0.70: 0.015 above) stands apart.
    off = sorted((round(s.bits, 3), s.count, tuple(s.names)) for s in marks if not s.on_front)
    assert off == [(2.25, 1, ("kivi2",)), (2.255, 2, ("pnmix-paper",))]
    names = [n for s in marks for n in s.names]
    assert sorted(names) == ["kivi1", "kivi2", "pnmix-paper"]  # each once


def test_the_front_is_drawn_as_steps_never_as_a_slope_across_unscored_bits():
    marks = spots([rec(0, 1.25, 0.01, preset("kivi1")), rec(1, 2.248, 0.81, preset("kivi2"))], front={0, 1})
    xs, ys = front_steps([s for s in marks if s.on_front])
    assert (xs, ys) == ([1.25, 2.248, 2.248], [0.01, 0.01, 0.81])
    assert all(x0 == x1 or y0 == y1 for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:], strict=False))  # no slope
