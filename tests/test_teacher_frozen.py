"""The teacher is frozen, provably: after a whole run (training steps, held-out evals, checkpoints and
the export) every tensor of the teacher in memory is bit-identical to what was loaded, none of them
requires grad or holds a gradient, and the teacher's files on disk hash the same; for a run that trains
the whole student, for a LoRA run, and for a run with two teachers (every teacher checked).
"""

from __future__ import annotations

import pytest
import torch
import yaml

from kdistill.fileio import file_sha256
from kdistill.train import recipe
from tests.test_train_kit import assets, base_config, run_cli

MODES = {
    "full": {},
    "lora": {
        "student": {
            "path": None,  # filled in below: the tiny student with weights
            "init": "pretrained",
            "lora": {"rank": 4, "alpha": 8, "dropout": 0.1, "targets": ["q_proj", "v_proj", "up_proj"]},
        }
    },
    "two_teachers": {},  # teachers: filled in below (the tiny teacher and a second one)
}


@pytest.mark.parametrize("mode", list(MODES))
def test_teacher_is_bit_identical_after_a_run(tmp_path, capsys, monkeypatch, mode):
    a = assets()
    cfg = base_config(tmp_path / "run", steps=4, eval_every=2, checkpoint_every=2)
    cfg.update(MODES[mode])
    if mode == "lora":
        cfg["student"]["path"] = str(a.student)
    dirs = [a.teacher]
    if mode == "two_teachers":
        from tests.test_multi_teacher import second_teacher

        dirs.append(second_teacher())
        cfg.pop("teacher")
        cfg["teachers"] = [{"path": str(d), "weight": 1} for d in dirs]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))

    files = sorted(p for d in dirs for p in d.iterdir() if p.is_file())
    hashes = {str(p): file_sha256(p) for p in files}
    seen: dict = {"teachers": []}
    real, real_mixture = recipe.load_models, recipe.load_mixture

    def spy(*args, **kwargs):
        teacher, student, init = real(*args, **kwargs)
        seen["teachers"].append((teacher, {k: v.detach().clone() for k, v in teacher.state_dict().items()}))
        return teacher, student, init

    def spy_mixture(*args, **kwargs):
        mixture = real_mixture(*args, **kwargs)
        for t, _ in (mixture or [])[1:]:
            seen["teachers"].append((t, {k: v.detach().clone() for k, v in t.state_dict().items()}))
        return mixture

    monkeypatch.setattr(recipe, "load_models", spy)
    monkeypatch.setattr(recipe, "load_mixture", spy_mixture)
    rc, out, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err

    assert len(seen["teachers"]) == len(dirs)
    for teacher, loaded in seen["teachers"]:
        after = teacher.state_dict()
        assert after.keys() == loaded.keys() and loaded
        changed = [k for k in loaded if not torch.equal(after[k], loaded[k])]
        assert not changed, f"teacher tensors changed: {changed[:5]}"
        assert not any(p.requires_grad or p.grad is not None for p in teacher.parameters())
        assert not teacher.training
    assert {str(p): file_sha256(p) for p in files} == hashes
