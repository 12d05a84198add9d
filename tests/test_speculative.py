"""Speculative decoding on the CPU (kdistill.speculative): the target's own tokens, its own distribution,
per-row acceptance, the planned keys, and the command line (`generate --draft`, `eval --draft-for`).

- Greedy: token for token what the target decodes alone, with an identical draft (every draft kept), a
  slightly perturbed one (some kept, a different count per row) and a different random init (none kept),
  for K = 1 and 4, in buckets of 1, 2 and 8 rows (rows wait and take freed slots), with a stop token.
- Per row: each row's filled length is its prompt plus its own new tokens (less the pending one).
- Sampled: the first three tokens of thousands of rows follow the target's exact distribution (computed
  here by enumerating every sequence with the model's full forward) by a chi-square test, while the
  draft's own distribution is far from it (the test can tell them apart).
- Every Triton key of a speculative generate is in kernels.plan.speculative_kernels.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from kdistill.acceptance import expected_tokens, speedup
from kdistill.cli import main
from kdistill.decode import DecodeEngine, Sampling
from kdistill.kernels import plan as plan_mod
from kdistill.kernels import runtime
from kdistill.models.hf_io import load_model
from kdistill.speculative import SpeculativeDecoder
from tests.test_train_kit import base_config, read_summary, run_cli
from tests.tiny import corpus_text, make_tiny_model, sample_ids

LENS = (7, 3, 11, 5, 9)


def ragged(vocab: int) -> list[list[int]]:
    return [sample_ids(vocab, 1, n, seed=n)[0].add(1).clamp(max=vocab - 1).tolist() for n in LENS]


def perturbed(model_dir: Path, std: float, seed: int = 1):
    """The model of model_dir with Gaussian noise added to every weight: a draft that agrees often."""
    m = load_model(model_dir).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return m


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target_dir = make_tiny_model(root, family="qwen3", tied=False, seed=0)
    other_dir = make_tiny_model(root, family="qwen3", tied=False, seed=7)
    target = load_model(target_dir).eval()
    return {
        "target": target,
        "target_dir": target_dir,
        "identical": load_model(target_dir).eval(),
        "perturbed": perturbed(target_dir, 0.01),
        "other": load_model(other_dir).eval(),
    }


@pytest.mark.parametrize("draft", ["identical", "perturbed", "other"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculative_decoding_is_the_target_alone_token_for_token(models, draft, k):
    target = models["target"]
    rows = ragged(target.spec.vocab_size)
    s = Sampling(max_new_tokens=16)
    alone = DecodeEngine(target, batch_size=8, max_len=40, sampling=s).generate(rows)
    stop = alone[1][5]  # a token greedy decoding meets: some rows end early, at a stop
    want = DecodeEngine(target, batch_size=8, max_len=40, sampling=s, stop_ids={stop}).generate(rows)
    assert any(r[-1] == stop and len(r) < 16 for r in want)
    for batch in (1, 2, 8):
        dec = SpeculativeDecoder(
            target, models[draft], draft_tokens=k, batch_size=batch, max_len=40, sampling=s, stop_ids={stop}
        )
        assert dec.generate(rows) == want, (draft, k, batch)
        accepted = [a for a, _ in dec.stats]
        rounds = [r for _, r in dec.stats]
        if draft == "identical":
            assert all(a == k * r for a, r in dec.stats)
        elif draft == "other":
            assert accepted == [0] * len(rows)
        assert all(r >= 1 for r in rounds)


def test_a_padded_teacher_vocabulary_changes_nothing(tmp_path):
    target_dir = make_tiny_model(tmp_path, family="llama", tied=False, vocab_pad=16, seed=2, name="padded")
    target = load_model(target_dir).eval()
    draft = load_model(make_tiny_model(tmp_path, family="llama", tied=True, seed=4)).eval()
    assert target.spec.vocab_size == draft.spec.vocab_size + 16
    rows = ragged(draft.spec.vocab_size)
    s = Sampling(max_new_tokens=10)
    want = DecodeEngine(target, batch_size=8, max_len=32, sampling=s).generate(rows)
    dec = SpeculativeDecoder(target, draft, draft_tokens=2, batch_size=8, max_len=32, sampling=s)
    assert dec.generate(rows) == want
    sampled = Sampling(max_new_tokens=10, temperature=1.0, seed=1)
    dec = SpeculativeDecoder(target, draft, draft_tokens=2, batch_size=8, max_len=32, sampling=sampled)
    assert all(len(r) == 10 for r in dec.generate(rows))


def test_rows_accept_their_own_counts_and_grow_by_them(models):
    target = models["target"]
    rows = ragged(target.spec.vocab_size)
    s = Sampling(max_new_tokens=20)
    dec = SpeculativeDecoder(
        target, models["perturbed"], draft_tokens=4, batch_size=8, max_len=40, sampling=s
    )
    out = dec.generate(rows)
    fractions = {a / (4 * r) for a, r in dec.stats}
    assert len(fractions) > 1 and 0 < min(fractions) < 1  # rows of one batch kept different shares
    assert dec.rounds < 19  # fewer verify steps than tokens: drafts were kept
    pr = dec.pair
    assert pr is not None
    for i, (prompt, new) in enumerate(zip(rows, out)):  # no refill: prompt i sits in slot i
        assert int(pr.t.lens[i]) == len(prompt) + len(new) - 1  # the pending token is not yet cached
        assert int(pr.t.ngen[i]) == len(new) == 20


def _exact(model, prompt: list[int], depth: int, temperature: float, top_k: int) -> dict[tuple, float]:
    """P(first `depth` new tokens) under softmax(logits / T) over the top_k likeliest, by enumeration
    with the model's full forward (no cache)."""

    def step(prefix: list[int]) -> dict[int, float]:
        with torch.no_grad():
            h = model(torch.tensor([prefix]))[0, -1]
            logits = (h @ model.lm_head_weight.t()).double() / temperature
        vals, idx = torch.topk(logits, top_k)
        return dict(zip(idx.tolist(), vals.softmax(-1).tolist()))

    out: dict[tuple, float] = {(): 1.0}
    for _ in range(depth):
        nxt: dict[tuple, float] = {}
        for seq, p in out.items():
            for t, q in step(prompt + list(seq)).items():
                nxt[seq + (t,)] = p * q
        out = nxt
    return out


def _chi_square(counts: dict[tuple, int], probs: dict[tuple, float], n: int) -> tuple[float, int]:
    """Pearson's statistic with bins of expected count below 5 pooled (and unseen outcomes counted),
    and its degrees of freedom."""
    stat, pooled_obs, pooled_exp, bins = 0.0, 0, 0.0, 0
    for key in set(probs) | set(counts):
        e, o = probs.get(key, 0.0) * n, counts.get(key, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
        else:
            stat, bins = stat + (o - e) ** 2 / e, bins + 1
    if pooled_exp > 0:
        stat, bins = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, bins + 1
    elif pooled_obs:
        return math.inf, bins
    return stat, bins - 1


def _critical(df: int, z: float = 3.29) -> float:
    """The chi-square quantile at 1 - 5e-4 (z of the normal) by the Wilson-Hilferty approximation."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def test_sampled_speculative_output_has_the_targets_exact_distribution(models):
    target, draft = models["target"], models["perturbed"]
    prompt = ragged(target.spec.vocab_size)[1]
    temperature, top_k, depth, n = 1.5, 3, 3, 3000
    s = Sampling(max_new_tokens=depth, temperature=temperature, top_k=top_k, seed=11)
    dec = SpeculativeDecoder(target, draft, draft_tokens=2, batch_size=512, max_len=16, sampling=s)
    out = dec.generate([prompt] * n)
    counts: dict[tuple, int] = {}
    for row in out:
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    accepted = sum(a for a, _ in dec.stats) / (2 * sum(r for _, r in dec.stats))
    assert 0.2 < accepted < 0.95  # refusals and resamples both happened
    want = _exact(target, prompt, depth, temperature, top_k)
    stat, df = _chi_square(counts, want, n)
    assert df >= 5 and stat < _critical(df), (stat, df)
    # the test has the power to see a wrong distribution: the draft's own is rejected by it
    theirs = _exact(draft, prompt, depth, temperature, top_k)
    tv = 0.5 * sum(abs(want.get(key, 0) - theirs.get(key, 0)) for key in set(want) | set(theirs))
    assert tv > 0.15
    fake = {key: round(p * n) for key, p in theirs.items()}
    assert _chi_square(fake, want, n)[0] > _critical(df)


def test_sampled_rows_follow_their_seed(models):
    target, draft = models["target"], models["perturbed"]
    rows = ragged(target.spec.vocab_size)

    def run(seed):
        s = Sampling(max_new_tokens=8, temperature=1.0, seed=seed)
        return SpeculativeDecoder(target, draft, batch_size=4, max_len=24, sampling=s).generate(rows)

    assert run(3) == run(3) and run(3) != run(4)
    assert list(itertools.chain(*run(3)))  # tokens came out


@pytest.mark.parametrize("head_dim", [16, 32])
def test_speculative_keys_are_planned(tmp_path, head_dim):
    d = make_tiny_model(
        tmp_path,
        family="qwen3",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
    )
    target = load_model(d).eval()
    draft = perturbed(d, 0.01)
    rows = ragged(target.spec.vocab_size)
    s = Sampling(max_new_tokens=6)
    with runtime.using(mode="reference", arch="sm_90"), runtime.recording() as rec:
        SpeculativeDecoder(target, draft, draft_tokens=3, batch_size=2, max_len=30, sampling=s).generate(rows)
    plan = plan_mod.speculative_kernels(
        target.spec, draft.spec, "sm_90", "fp32", batch=2, prompt_len=11, max_len=30 + 4, draft_tokens=3
    )
    triton = {k for k in rec.keys() if not k.is_library}
    assert triton <= plan, triton - plan
    assert {"decode_attn_split", "decode_attn_multi_split", "decode_attn_combine", "rope_fwd"} <= {
        k.op for k in triton
    }
    # one T-token attention key per T-token step: the draft's two tokens, the verify step's K + 1
    assert {k["T"] for k in triton if k.op == "decode_attn_multi_split"} == {2, 4}
    # from a head of 32 on, the draft and verify steps rotate inside the attention kernel, as the step does
    splits = {"decode_attn_split", "decode_attn_multi_split"}
    assert {k["ROPE"] for k in triton if k.op in splits} == {head_dim >= 32}


# -- the command line ----------------------------------------------------------------------------
def cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-cli")
    return {
        "teacher": make_tiny_model(root, family="qwen2", tied=False, seed=0),
        "student": make_tiny_model(root, family="qwen2", tied=True, seed=3, num_hidden_layers=1),
        "foreign": make_tiny_model(
            root, family="qwen2", tied=True, seed=3, tokenizer_vocab=320, name="foreign"
        ),
    }


def test_generate_with_a_draft_prints_what_the_model_alone_prints(dirs, capsys):
    args = ["--prompt", "the teacher", "--prompt", "a quick brown fox", "--max-new-tokens", "12", "--json"]
    args += ["--device", "cpu"]
    rc, alone, _ = cli(capsys, "generate", "--model", str(dirs["teacher"]), *args)
    assert rc == 0
    for k in ("1", "3"):
        draft = ["--draft", str(dirs["student"]), "--draft-tokens", k]
        rc, out, _ = cli(capsys, "generate", "--model", str(dirs["teacher"]), *args, *draft)
        assert rc == 0
        assert sorted(out.splitlines()) == sorted(alone.splitlines())
    one = ["--prompt", "the teacher", "--max-new-tokens", "12", "--device", "cpu"]  # streamed as it grows
    rc, alone, _ = cli(capsys, "generate", "--model", str(dirs["teacher"]), *one)
    rc2, out, _ = cli(
        capsys, "generate", "--model", str(dirs["teacher"]), *one, "--draft", str(dirs["student"])
    )
    assert rc == rc2 == 0 and out == alone and alone.strip()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--draft", "{foreign}"], "tokenizer differs from"),
        (["--draft", "{missing}"], "--draft '"),
        (
            ["--draft", "{student}", "--draft-tokens", "0"],
            "--draft-tokens is 0, expected an integer from 1 to 64",
        ),
        (["--draft", "{student}", "--out", "{tmp}/a.jsonl"], "--draft does not combine with --out"),
        (["--draft-tokens", "3"], "--draft-tokens needs --draft DIR"),
    ],
)
def test_a_bad_draft_is_refused_in_one_line(dirs, tmp_path, capsys, extra, message):
    names = {k: str(v) for k, v in dirs.items()} | {"missing": str(tmp_path / "nope"), "tmp": str(tmp_path)}
    extra = [e.format(**names) for e in extra]
    rc, _, err = cli(capsys, "generate", "--model", str(dirs["teacher"]), "--prompt", "a", *extra)
    assert rc == 2
    assert err.count("\n") == 1 and message in err, err


# -- acceptance as a metric -----------------------------------------------------------------------
def test_the_predicted_speedup_is_the_standard_formula():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.0, 4) == 1
    assert speedup(0.5, 2, c_draft=0.1, c_verify=1.2) == pytest.approx(1.75 / 1.4)


def test_eval_of_a_draft_identical_to_its_teacher_accepts_everything(dirs, tmp_path, capsys):
    twin = tmp_path / "twin"
    shutil.copytree(dirs["teacher"], twin)
    data = tmp_path / "heldout.txt"
    data.write_text(corpus_text(400, seed=3))
    argv = ["eval", "--model", str(twin), "--draft-for", str(dirs["teacher"]), "--data", str(data)]
    argv += ["--prompts", "6", "--max-new-tokens", "10", "--draft-tokens", "3", "--device", "cpu", "--json"]
    rc, out, _ = cli(capsys, *argv)
    assert rc == 0
    res = json.loads(out)
    for mode in ("greedy", "t=1"):
        r = res[mode]
        assert r["alpha"] == 1.0 and r["alpha_se"] == 0.0
        assert (
            r["accepted_per_verify"] == 3 and r["tokens_per_verify"] == 4
        )  # K, and K + 1 with the teacher's
        assert r["prompts"] == 6
        assert r["predicted_tokens_per_verify"] == 4
        c = res["costs"]
        assert r["predicted_speedup"] == pytest.approx(4 / (3 * c["c_draft"] + c["c_verify"]))
        assert r["speedup_from_tokens_per_verify"] == pytest.approx(r["predicted_speedup"])  # alpha = 1
    # another student is accepted less, and the table names both modes
    argv[2] = str(dirs["student"])
    rc, out, _ = cli(capsys, *argv)
    assert rc == 0 and json.loads(out)["greedy"]["alpha"] < 1
    rc, out, _ = cli(capsys, *argv[:-1])
    assert rc == 0 and "greedy" in out and "t=1" in out and "predicted speed-up" in out
    argv[argv.index("--prompts") + 1] = "1"  # one prompt: no standard error
    rc, out, _ = cli(capsys, *argv[:-1])
    assert rc == 0 and "alpha" in out and "± n/a" in out


def test_eval_refuses_a_draft_of_another_tokenizer_in_one_line(dirs, tmp_path, capsys):
    data = tmp_path / "heldout.txt"
    data.write_text(corpus_text(50))
    argv = ["eval", "--model", str(dirs["foreign"]), "--draft-for", str(dirs["teacher"]), "--data", str(data)]
    rc, _, err = cli(capsys, *argv)
    assert rc == 2 and err.count("\n") == 1 and "tokenizer differs from" in err, err


def test_a_finished_run_reports_its_students_acceptance_as_the_teachers_draft(tmp_path, capsys):
    cfg = base_config(tmp_path / "run", steps=3)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    draft = read_summary(tmp_path / "run")["draft"]
    assert draft["mode"] == "greedy" and draft["draft_tokens"] == 4 and draft["max_new_tokens"] == 32
    assert 0 <= draft["alpha"] <= 1 and draft["prompts"] >= 1 and draft["verify_steps"] >= draft["prompts"]
    assert draft["tokens_per_verify"] == pytest.approx(1 + 4 * draft["alpha"])
    rc, out, _ = run_cli(capsys, "report", str(tmp_path / "run"))
    assert rc == 0 and f"draft       alpha {draft['alpha']:.3f}" in out


def test_a_run_whose_teacher_cannot_verify_says_why_acceptance_is_not_measured(tmp_path, capsys):
    from types import SimpleNamespace

    from kdistill.acceptance import run_acceptance

    ctx = SimpleNamespace(cache=object(), teacher=None, cross=None)
    assert "teacher is a cache" in run_acceptance(SimpleNamespace(ctx=ctx))["skipped"]
    ctx = SimpleNamespace(cache=None, teacher=object(), cross=object())
    assert "another tokenizer" in run_acceptance(SimpleNamespace(ctx=ctx))["skipped"]
    summary = tmp_path / "run" / "summary.json"
    summary.parent.mkdir()
    (summary.parent / "manifest.json").write_text("{}")
    summary.write_text(json.dumps({"status": "completed", "draft": {"skipped": "the teacher is a cache"}}))
    rc, out, _ = run_cli(capsys, "report", str(summary.parent))
    assert rc == 0 and "draft       acceptance not measured: the teacher is a cache" in out
    one = {"alpha": 0.5, "alpha_se": None, "tokens_per_verify": 3.0, "draft_tokens": 4, "prompts": 1}
    summary.write_text(json.dumps({"status": "completed", "draft": one}))
    rc, out, _ = run_cli(capsys, "report", str(summary.parent))
    assert rc == 0 and "draft       alpha 0.500 ± n/a greedy, 3.00 tokens per verify step" in out
