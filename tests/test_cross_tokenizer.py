"""Teacher and student with different tokenizers (kd.cross_tokenizer): the character-offset alignment on a
hand-checked example, the ULD loss against a dense formula written here, a tiny run with two BPE
tokenizers of different vocabulary sizes, and the one-line error without the flag.

Run: .venv/bin/python -m pytest tests/test_cross_tokenizer.py -q
"""

from __future__ import annotations

import functools

import torch
import yaml

from kdistill.data.align import align_ends, retokenize
from kdistill.models.tokenizer import load_tokenizer
from kdistill.ops.uld import uld_rows
from tests.test_train_kit import assets, base_config, one_error_line, read_summary, run_cli
from tests.tiny import make_tiny_model


@functools.cache
def other_student():
    """A student with its own, smaller BPE tokenizer (320 symbols vs the teacher's 384)."""
    return make_tiny_model(
        assets().root, "qwen2", tied=True, seed=4, name="student-tok320", tokenizer_vocab=320
    )


def test_alignment_hand_checked():
    # text "the cat sat": student tokens end at 3 ("the"), 7 (" cat"), 8 (" "), 11 ("sat");
    # teacher tokens end at 2 ("th"), 7 ("e cat"), 9 (" s"), 11 ("at").
    # 3 -> nearest end 2 (|3-2| = 1 < |7-3|): 0; 7 -> exact: 1; 8 -> 7 and 9 tie: the earlier, 1; 11 -> 3.
    assert align_ends([3, 7, 8, 11], [2, 7, 9, 11]) == [0, 1, 1, 3]
    assert align_ends([1, 20], [5, 10]) == [0, 1]  # before the first and past the last teacher token


def test_alignment_of_two_real_tokenizers():
    s_tok = load_tokenizer(other_student())
    t_tok = load_tokenizer(assets().teacher)
    text = "the teacher model learns tokens"
    ids = s_tok.encode(text)
    t_ids, pairs = retokenize(s_tok, t_tok, ids)
    assert t_ids == t_tok.encode(text)
    _, s_ends = s_tok.encode_offsets(text)
    _, t_ends = t_tok.encode_offsets(text)
    assert s_ends[-1] == t_ends[-1] == len(text) and pairs[-1] == len(t_ids) - 1
    for e, j in zip(s_ends, pairs):  # where a teacher token ends at the same offset, that one is taken
        if e in t_ends:
            assert t_ends[j] == e
    same, same_pairs = retokenize(t_tok, t_tok, t_tok.encode(text))  # one tokenizer: the identity
    assert same_pairs == list(range(len(same)))


def test_uld_matches_dense_formula():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(5, 11, generator=g, dtype=torch.float64)
    got = uld_rows(s, t, 2.0)
    for i in range(5):
        q = sorted(torch.softmax(s[i].detach() / 2.0, -1).tolist(), reverse=True) + [0.0] * 4
        p = sorted(torch.softmax(t[i] / 2.0, -1).tolist(), reverse=True)
        assert abs(float(got[i].detach()) - sum(abs(a - b) for a, b in zip(p, q))) < 1e-12
    (g_s,) = torch.autograd.grad(got.sum(), [s])
    # dense gradient: d/dq_k |p_k - q_k| = sign(q_k - p_k) at q's sorted ranks, through softmax(s / T)
    for i in range(5):
        q = torch.softmax(s[i].detach() / 2.0, -1)
        order = q.argsort(descending=True)
        p = torch.softmax(t[i] / 2.0, -1).sort(descending=True).values
        sign = torch.zeros(7, dtype=torch.float64)
        sign[order] = torch.sign(q[order] - p[:7])
        jac = (torch.diag(q) - q[:, None] * q[None, :]) / 2.0
        assert torch.allclose(g_s[i], jac @ sign, atol=1e-12)


def test_cross_tokenizer_run_finishes(tmp_path, capsys):
    cfg = base_config(tmp_path / "run", steps=6)
    cfg["student"] = {"path": str(other_student())}
    cfg["kd"]["cross_tokenizer"] = True
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    s = read_summary(tmp_path / "run")
    assert s["status"] == "completed" and s["final_loss"] < s["initial_loss"]
    assert (tmp_path / "run" / "student" / "model.safetensors").is_file()


def test_without_the_flag_a_tokenizer_mismatch_is_one_line(tmp_path, capsys):
    cfg = base_config(tmp_path / "run", steps=2)
    cfg["student"] = {"path": str(other_student())}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc != 0 and "tokenizer differs from the teacher's" in one_error_line(err)


def test_cross_tokenizer_config_errors(tmp_path, capsys):
    import pytest

    from kdistill.config import load_config
    from kdistill.errors import UserError

    with pytest.raises(UserError, match="kd.cross_tokenizer needs one live teacher"):
        load_config(None, base={"teachers": [{"path": "a"}], "kd": {"cross_tokenizer": True}}).validate()
    with pytest.raises(UserError, match="cannot be combined"):
        load_config(None, base={"kd": {"cross_tokenizer": True, "layer_map": [[0, 0]]}}).validate(
            need_paths=False
        )
    cfg = base_config(tmp_path / "run", steps=2)  # the student is a config.json: no tokenizer of its own
    cfg["kd"]["cross_tokenizer"] = True
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc != 0 and "kd.cross_tokenizer needs the student's tokenizer" in one_error_line(err)


def test_on_policy_across_tokenizers_on_raw_text_is_one_line(tmp_path, capsys):
    cfg = base_config(tmp_path / "run", steps=2)
    cfg["student"] = {"path": str(other_student())}
    cfg["kd"].update(cross_tokenizer=True, on_policy=1.0, max_new_tokens=4)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 2 and "needs conversation data" in one_error_line(err)
    assert (
        not (tmp_path / "run" / "summary.json").exists()
        or read_summary(tmp_path / "run")["status"] != "completed"
    )
