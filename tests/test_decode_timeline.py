"""decode_profile's timeline: each launch of a block placed on the step's critical path from the
profiler's start and end times (pure bookkeeping, no GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_profile  # noqa: E402


def _step(t0: float, blocks: int) -> tuple[list[tuple[str, float, float, float]], float]:
    """A step of `blocks` blocks of three chained launches: a product placed 1 us before the previous
    end that ends 3 us after it, the attention placed 0.5 us early ending 2 us after, a norm placed at
    the previous end ending 1 us after; plus a head launch. Returns (kernels, the step's end)."""
    out = [("head", 1.0, t0, t0 + 1.0)]
    end = t0 + 1.0
    for _ in range(blocks):
        for name, early, add in (
            ("decode_gemv_kernel", 1.0, 3.0),
            ("decode_attn_split_kernel", 0.5, 2.0),
            ("rmsnorm", 0.0, 1.0),
        ):
            start = end - early
            out.append((name, end + add - start, start, end + add))
            end += add
    return out, end


def test_timeline_places_each_launch_of_a_block_on_the_critical_path():
    ks: list[tuple[str, float, float, float]] = []
    t = 0.0
    for _ in range(3):  # three replays, one after the other
        step, t = _step(t + 10.0, blocks=8)
        ks += step
    tl = decode_profile.timeline(ks, steps=3)
    rows = tl["launches"]
    assert [r["launch"] for r in rows] == ["decode_attn_split_kernel", "rmsnorm", "decode_gemv_kernel"]
    assert [round(r["delta"], 6) for r in rows] == [2.0, 1.0, 3.0]
    assert [round(r["placed"], 6) for r in rows] == [-0.5, 0.0, -1.0]
    assert [round(r["duration"], 6) for r in rows] == [2.5, 1.0, 4.0]
    assert tl["block_us"] == pytest.approx(6.0)


def test_timeline_is_empty_without_blocks_to_average():
    step, _ = _step(0.0, blocks=2)
    assert decode_profile.timeline(step, steps=1) == {}


def test_the_interleaved_step_experiment_gives_the_engines_tokens(tmp_path, monkeypatch):
    """decode_profile --interleave: the step's rows in two groups, each group's blocks on a stream of its
    own, then one lm_head and sampler over every row: on the reference path (streams stood in for, as a
    CPU has none) the greedy tokens are the engine's own step's, row by row, and every group step ran."""
    import contextlib

    import torch
    from tiny import make_tiny_model

    from kdistill.decode import DecodeEngine, Sampling
    from kdistill.models.hf_io import load_model

    class _Stream:
        def wait_stream(self, other) -> None:
            pass

    model = load_model(make_tiny_model(tmp_path, family="qwen2", hidden_size=64, head_dim=32)).eval()
    g = torch.Generator().manual_seed(0)
    lens = (3, 9, 5, 7, 4, 11, 2, 6)
    prompts = [torch.randint(5, model.spec.vocab_size - 5, (n,), generator=g).tolist() for n in lens]
    s = Sampling(max_new_tokens=6)
    want = DecodeEngine(model, batch_size=8, max_len=40, sampling=s).generate(prompts)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    groups = []
    step = decode_profile.interleaved_step(2)

    def counted(self, st):
        groups.append(st.batch)
        return step(self, st)

    monkeypatch.setattr(DecodeEngine, "_decode_step", counted)
    eng = DecodeEngine(model, batch_size=8, max_len=40, sampling=s)
    assert eng.rope_in_attention  # the experiment's step: RoPE inside the attention
    assert eng.generate(prompts) == want
    assert groups and set(groups) == {8} and len(eng._group_streams) == 1
