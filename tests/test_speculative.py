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
import math
from pathlib import Path

import pytest
import torch

from kdistill.cli import main
from kdistill.decode import DecodeEngine, Sampling
from kdistill.kernels import plan as plan_mod
from kdistill.kernels import runtime
from kdistill.models.hf_io import load_model
from kdistill.speculative import SpeculativeDecoder
from tests.tiny import make_tiny_model, sample_ids

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


def test_speculative_keys_are_planned(tmp_path):
    d = make_tiny_model(
        tmp_path, family="qwen3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16
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
    assert {"decode_attn_split", "decode_attn_combine", "rope_fwd"} <= {k.op for k in triton}


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
    ],
)
def test_a_bad_draft_is_refused_in_one_line(dirs, tmp_path, capsys, extra, message):
    names = {k: str(v) for k, v in dirs.items()} | {"missing": str(tmp_path / "nope"), "tmp": str(tmp_path)}
    extra = [e.format(**names) for e in extra]
    rc, _, err = cli(capsys, "generate", "--model", str(dirs["teacher"]), "--prompt", "a", *extra)
    assert rc == 2
    assert err.count("\n") == 1 and message in err, err
