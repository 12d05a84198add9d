"""A decoder's fused projections read [q; k; v] and [gate; up] as one matrix without concatenating them at
every forward: a built or loaded model keeps each group's weights (and q/k/v biases) adjacent in one
storage, the parameters views of it. Values and gradients are those of the concatenating path bit for
bit; a model whose weights were given storage of their own (a copy, an adapter, a shard) concatenates as
before."""

from __future__ import annotations

import pytest
import torch

from kdistill.models.decoder import _adjacent, build_decoder, join_projections, joined
from kdistill.models.hf_io import load_model, save_model
from tests.test_contract import make_spec

SPEC = make_spec(hidden=24, inter=40, layers=2)


def _groups(model: torch.nn.Module) -> list[list[torch.Tensor]]:
    out = []
    for block in model.model.layers:
        a, m = block.self_attn, block.mlp
        out.append([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        out.append([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
        out.append([m.gate_proj.weight, m.up_proj.weight])
    return out


def _apart(model: torch.nn.Module) -> None:
    """Each parameter in storage of its own (as an unjoined model's)."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()


def _grads(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = model(ids).float()
    out.square().mean().backward()
    return {"out": out.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}


def test_a_built_model_has_its_projection_groups_joined():
    model = build_decoder(SPEC, seed=1)
    assert SPEC.attention_bias  # the q/k/v biases are a group too
    assert all(_adjacent(g) for g in _groups(model))
    assert join_projections(model) == 0  # already joined: nothing to do


def test_joined_weights_give_the_concatenating_paths_values_and_gradients_bit_for_bit(monkeypatch):
    ids = torch.randint(0, SPEC.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    model, ref = build_decoder(SPEC, seed=1), build_decoder(SPEC, seed=1)
    _apart(ref)
    assert not any(_adjacent(g) for g in _groups(ref))
    expected = _grads(ref, ids)
    cats = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda ts, *a, **k: cats.append(ts) or real_cat(ts, *a, **k))
    got = _grads(model, ids)
    params = {id(p) for p in model.parameters()}
    assert not [ts for ts in cats if any(id(t) in params for t in ts)]  # no weight concatenated
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    # the unjoined model concatenates its weights, once a group a forward
    cats.clear()
    _grads(ref, ids)
    ref_params = {id(p) for p in ref.parameters()}
    assert len([ts for ts in cats if any(id(t) in ref_params for t in ts)]) == 3 * SPEC.num_layers


def test_joining_keeps_the_parameters_and_their_values():
    model = build_decoder(SPEC, seed=1)
    _apart(model)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    assert join_projections(model) == 3 * SPEC.num_layers
    for n, p in model.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1]), n
    assert all(_adjacent(g) for g in _groups(model))


def test_joined_is_cat_where_tensors_are_not_adjacent():
    a, b = torch.randn(3, 4), torch.randn(2, 4)
    assert torch.equal(joined([a, b]), torch.cat([a, b]))
    buf = torch.randn(5, 4)
    view = joined([buf[:3], buf[3:]])
    assert view.data_ptr() == buf.data_ptr() and torch.equal(view, buf)
    assert torch.equal(joined([buf[3:], buf[:3]]), torch.cat([buf[3:], buf[:3]]))  # out of order: a copy


def test_a_loaded_model_is_joined_and_saves_and_loads_back_unchanged(tmp_path):
    model = build_decoder(SPEC, seed=3)
    save_model(model, tmp_path / "m", dtype=torch.float32)
    back = load_model(tmp_path / "m", dtype=torch.float32)
    assert all(_adjacent(g) for g in _groups(back))
    sd = back.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(sd[name], value), name


@pytest.mark.parametrize("how", ["copy", "dtype"])
def test_a_model_whose_weights_moved_apart_still_runs(how):
    ids = torch.randint(0, SPEC.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    model = build_decoder(SPEC, seed=1)
    expected = model(ids)
    if how == "copy":
        _apart(model)
    else:
        model = model.to(torch.float64).to(torch.float32)
    assert torch.equal(model(ids), expected)
