"""benchmarks/step_boundaries.py without a GPU: its shapes are read or refused in one line, and the edges
are the differences of the right ways of timing the step."""

from __future__ import annotations

import pytest

from benchmarks import step_boundaries as sb


def test_shapes_are_model_rows_slots():
    assert sb.parse_shapes("qwen2.5-0.5b:16:1152, qwen2.5-1.5b:4:384") == [
        ("qwen2.5-0.5b", 16, 1152),
        ("qwen2.5-1.5b", 4, 384),
    ]


@pytest.mark.parametrize("bad", ["qwen2.5-0.5b:16", "qwen2.5-0.5b:x:1152", "qwen2.5-0.5b:0:1152", "m:4:128"])
def test_a_bad_shape_is_one_line(bad):
    with pytest.raises(SystemExit) as e:
        sb.parse_shapes(bad)
    assert repr(bad) in str(e.value) and "\n" not in str(e.value)


def test_the_edges_are_differences_of_the_ways():
    us = {"graph": 710.0, "engine": 716.0, "k_graph": 705.0, "k_engine": 706.0}
    out = sb.summarise(us)
    assert out["between_graphs_us"] == pytest.approx(5.0)
    assert out["uniforms_launch_us"] == pytest.approx(6.0)
    assert out["engine_edges_us"] == pytest.approx(10.0)
    assert out["edges_share_of_step"] == pytest.approx(10.0 / 716.0)
    assert "round_saves_us" not in out
    assert sb.summarise({**us, "round": 707.5})["round_saves_us"] == pytest.approx(8.5)
