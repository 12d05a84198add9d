"""The Triton KD-loss kernel against the PyTorch reference, on the CPU through Triton's interpreter.

TRITON_INTERPRET=1 must be set before triton decorates the kernel, and it is process-wide. So this
module never sets it in the pytest process: a module-scoped fixture runs this same file as a
script in a child process whose environment has TRITON_INTERPRET=1 from the start; the child runs
every case through the kernel and saves the outputs; the tests here compare them with
`chunk_divergence_reference` (and the chunked `kd_loss`) computed in the parent. The rest of the
suite never sees the variable.

Also here: the key function, and a compile of the kernel to sm_90 / sm_80 cubins without a GPU.

Run: .venv/bin/python -m pytest tests/test_kd_loss_triton.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kdistill.config import DIVERGENCES
from kdistill.kernels import kd_loss as kd
from kdistill.ops.kd_loss import chunk_divergence_reference, kd_loss


def kd_loss_kernel_key(vocab_size, divergence, logits_dtype, arch, **kw):
    return kd.key(arch, vocab_size=vocab_size, divergence=divergence, logits_dtype=logits_dtype, **kw)


IGNORE = -100
ROWS, V, BLOCK_V = 13, 1271, 256  # BLOCK_V does not divide V: 4 full blocks + a partial one


def _case(name, divergence="forward_kl", temperature=2.0, alpha=0.3, dtype=torch.float32, grad_dtype=None,
          v=V, block_v=BLOCK_V, scale=3.0, all_ignored=False, need_grad=True, beta=0.3):  # fmt: skip
    return dict(name=name, divergence=divergence, temperature=temperature, alpha=alpha, dtype=dtype,
                grad_dtype=grad_dtype, v=v, block_v=block_v, scale=scale, all_ignored=all_ignored,
                need_grad=need_grad, beta=beta)  # fmt: skip


CASES = (
    [_case(f"{d}-T{t}", d, t) for d in DIVERGENCES for t in (0.5, 2.0)]
    + [_case(f"{d}-T1-alpha1", d, 1.0, alpha=1.0) for d in DIVERGENCES]
    + [
        _case("no-kd-alpha0", "jsd", 2.0, alpha=0.0),
        _case("all-ignored", "tvd", all_ignored=True),
        _case("bf16-logits", "forward_kl", dtype=torch.bfloat16),
        _case("bf16-logits-skew", "skew_kl", dtype=torch.bfloat16),
        _case("fp32-logits-bf16-grad", "reverse_kl", grad_dtype=torch.bfloat16),
        _case("no-grad", "jsd", need_grad=False),
        _case("one-partial-block", "skew_reverse_kl", block_v=None),  # default BLOCK_V 2048 > V
        _case("v-multiple-of-block", "jsd", v=1024),
    ]
    + [_case(f"extreme-{d}", d, 1.0, alpha=0.7, scale=40.0) for d in DIVERGENCES]
)
CASE_IDS = [c["name"] for c in CASES]
E2E = [("forward_kl", 2.0), ("jsd", 0.5), ("skew_reverse_kl", 4.0)]


def case_inputs(i: int, c: dict):
    g = torch.Generator().manual_seed(100 + i)
    s = (torch.randn(ROWS, c["v"], generator=g) * c["scale"]).to(c["dtype"])
    t = (torch.randn(ROWS, c["v"], generator=g) * c["scale"]).to(c["dtype"])
    y = torch.randint(0, c["v"], (ROWS,), generator=g)
    y[[0, 6, 12]] = IGNORE
    if c["all_ignored"]:
        y[:] = IGNORE
    return s, t, y


def case_kwargs(c: dict) -> dict:
    return dict(alpha=c["alpha"], temperature=c["temperature"], divergence=c["divergence"], beta=c["beta"],
                ignore_index=IGNORE, grad_scale=0.37, need_grad=c["need_grad"], grad_dtype=c["grad_dtype"])  # fmt: skip


def e2e_inputs(i: int):
    g = torch.Generator().manual_seed(7 + i)
    n, h, ht, vt = 41, 40, 24, V + 29
    sh, sw = torch.randn(n, h, generator=g), torch.randn(V, h, generator=g) * 0.3
    th, tw = torch.randn(n, ht, generator=g), torch.randn(vt, ht, generator=g) * 0.4
    y = torch.randint(0, V, (n,), generator=g)
    y[[1, 2, 30]] = IGNORE
    return sh, sw, th, tw, y


def _e2e(i, divergence, temperature, chunk_fn):
    sh, sw, th, tw, y = e2e_inputs(i)
    sh.requires_grad_()
    sw.requires_grad_()
    r = kd_loss(sh, sw, th, tw, y, alpha=0.5, temperature=temperature, divergence=divergence, chunk_size=16,
                chunk_fn=chunk_fn)  # fmt: skip
    (r.loss * 1.7).backward()
    return {"loss": r.loss.detach(), "ce": r.ce, "kd": r.kd, "gh": sh.grad, "gw": sw.grad}


def _worker(out_path: str) -> None:
    """Child process (TRITON_INTERPRET=1): run every case through the kernel, save the outputs."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from kdistill.kernels.kd_loss import kd_loss_chunk_triton

    results = {}
    for i, c in enumerate(CASES):
        s, t, y = case_inputs(i, c)
        out = kd_loss_chunk_triton(s, t, y, block_v=c["block_v"], **case_kwargs(c))
        results[c["name"]] = [None if x is None else x.clone() for x in out]
    for i, (d, temp) in enumerate(E2E):
        results[f"e2e-{d}"] = _e2e(i, d, temp, kd_loss_chunk_triton)
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def kernel_results(tmp_path_factory):
    pytest.importorskip("triton")  # a platform without Triton has no kernel to check
    out = tmp_path_factory.mktemp("kd_triton") / "results.pt"
    env = dict(os.environ, TRITON_INTERPRET="1")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"interpreter worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out)


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # relative to the reference's largest value


def _close(a, e, rel, what):
    a, e = a.double(), e.double()
    assert torch.isfinite(a).all(), f"{what}: non-finite"
    err, ref = float((a - e).abs().max()), float(e.abs().max())
    assert err <= rel * ref + 1e-7, f"{what}: max abs error {err:.3e} > {rel:.1e} * {ref:.3e}"


@pytest.mark.parametrize("i", range(len(CASES)), ids=CASE_IDS)
def test_kernel_matches_reference(kernel_results, i):
    c = CASES[i]
    s, t, y = case_inputs(i, c)
    # The oracle is the reference in fp64 on the same (possibly bf16-rounded) logits.
    ref = chunk_divergence_reference(s.double(), t.double(), y, **case_kwargs(c))
    got = kernel_results[c["name"]]
    tol = TOL[c["dtype"]]
    for what, a, e in zip(("loss_sum", "ce_sum", "kd_sum"), got[:3], ref[:3]):
        assert a.dtype == torch.float32 and a.dim() == 0
        _close(a, e, tol, what)
    if not c["need_grad"]:
        assert got[3] is None and ref[3] is None
        return
    g = got[3]
    assert g.shape == s.shape
    assert g.dtype == (c["grad_dtype"] or c["dtype"])
    # A bf16 gradient holds ~3 significant digits.
    _close(g, ref[3], 1e-2 if g.dtype == torch.bfloat16 else tol, "grad_logits")
    ignored = y == IGNORE
    assert float(g[ignored].abs().max()) == 0.0, "ignored rows must get a zero gradient"
    if c["all_ignored"]:
        assert float(got[0]) == 0.0 and float(g.abs().max()) == 0.0


@pytest.mark.parametrize("i", range(len(E2E)), ids=[f"{d}-T{t}" for d, t in E2E])
def test_kd_loss_with_kernel_chunk_fn_matches_reference(kernel_results, i):
    d, temp = E2E[i]
    ref = _e2e(i, d, temp, None)
    got = kernel_results[f"e2e-{d}"]
    for k in ("loss", "ce", "kd", "gh", "gw"):
        _close(got[k], ref[k], 2e-5, k)


def test_key_names_every_specialization():
    base = kd_loss_kernel_key(151936, "jsd", torch.bfloat16, "sm_90")
    assert (base.op, base.arch, dict(base.params)) == ("kd_loss", "sm_90", {
        "vocab_size": 151936, "BLOCK_V": 4096, "num_warps": 8, "DIVERGENCE": 2,
        "HAS_KD": True, "NEED_GRAD": True, "UNIT_T": False, "logits_dtype": "bfloat16",
        "grad_dtype": "bfloat16",
    })  # fmt: skip
    variants = [
        kd_loss_kernel_key(151936, "tvd", torch.bfloat16, "sm_90"),
        kd_loss_kernel_key(151936, "jsd", torch.float32, "sm_90"),
        kd_loss_kernel_key(151936, "jsd", torch.bfloat16, "sm_80"),
        kd_loss_kernel_key(151930, "jsd", torch.bfloat16, "sm_90"),
        kd_loss_kernel_key(151936, "jsd", torch.bfloat16, "sm_90", need_grad=False),
        kd_loss_kernel_key(151936, "jsd", torch.bfloat16, "sm_90", has_kd=False),
        kd_loss_kernel_key(151936, "jsd", torch.float32, "sm_90", grad_dtype=torch.bfloat16),
        kd_loss_kernel_key(151936, "jsd", torch.bfloat16, "sm_90", block_v=1024),
        kd_loss_kernel_key(151936, "jsd", torch.bfloat16, "sm_90", unit_t=True),
    ]
    assert len({base, *variants}) == len(variants) + 1, "each parameter must change the key"
    # Without KD neither the divergence nor the temperature is compiled in: one variant for all of them.
    no_kd = {
        kd_loss_kernel_key(1271, d, "float32", "sm_90", has_kd=False, unit_t=u)
        for d in DIVERGENCES
        for u in (0, 1)
    }
    assert len(no_kd) == 1
    # Temperature 1's variant only where it measured faster (not reverse KL, say).
    assert kd_loss_kernel_key(1271, "forward_kl", "float32", "sm_90", unit_t=True)["UNIT_T"] is True
    assert kd_loss_kernel_key(1271, "reverse_kl", "float32", "sm_90", unit_t=True)["UNIT_T"] is False
    # The key's constexprs are exactly what the launcher passes.
    kp = kd.tiles(151936, "jsd", True, True)
    assert {k: base[k] for k in kp} == kp


def test_kernel_compiles_for_gpus_without_a_gpu():
    """`build_source(key)` compiles to cubins with Triton's bundled ptxas, no GPU needed."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    for args, kw in [
        ((151936, "skew_reverse_kl", torch.float32, "sm_90"), dict(grad_dtype=torch.bfloat16)),
        ((151936, "forward_kl", torch.bfloat16, "sm_80"), dict(need_grad=False)),
        ((1271, "tvd", torch.float32, "sm_90"), dict(has_kd=False)),
    ]:
        src, options = build_source(kd_loss_kernel_key(*args, **kw))
        cc = triton.compile(src, target=GPUTarget("cuda", int(args[3][3:]), 32), options=options)
        assert len(cc.asm["cubin"]) > 1000


def build_source(key):
    """(ASTSource, options) the cross-arch build compiles for `key` (the registered Kernel's)."""
    return kd.FWD.ast_source(key)


def _spec_of_source(src, options) -> tuple:
    """build_source's specialization in the form Triton's binder reports (contract.triton_specialization)."""
    out = []
    for i, (name, ty) in enumerate(src.signature.items()):
        if ty == "constexpr":
            out.append((name, "constexpr", src.constants[(i,)]))
        elif ty.startswith("*"):
            out.append((name, ty, "D" if (i,) in src.attrs else ""))
        elif name == "V":  # the one specialized integer: divisible by 16 or not
            out.append((name, ty, "D" if (i,) in src.attrs else ""))
        else:  # do_not_specialize integers and floats
            out.append((name, ty, None))
    return ("_kd_loss_rows", tuple(out), tuple(sorted(options.items())))


LAUNCHES = [
    # (rows, V, label offset, logits dtype, alpha, need_grad, grad dtype, misaligned logits view)
    (1, 1271, 0, torch.float32, 0.5, True, None, False),
    (7, 1271, 3, torch.float32, 0.5, True, None, True),
    (64, 1271, 5, torch.float32, 0.5, True, None, False),
    (1, 1280, 1, torch.bfloat16, 0.5, True, None, False),
    (9, 1280, 0, torch.bfloat16, 0.5, True, None, True),
    (3, 1280, 2, torch.float32, 0.5, True, torch.bfloat16, False),
    (5, 1280, 7, torch.float32, 0.5, True, torch.bfloat16, True),
    (2, 1280, 1, torch.float32, 0.0, False, None, False),
    (1, 151936, 1, torch.float32, 0.5, True, torch.bfloat16, False),
    (3, 151936, 0, torch.float32, 0.5, True, torch.bfloat16, False),
]


def test_key_determines_triton_specialization():
    """For launches of many row counts, label offsets and buffer alignments, Triton's own binder
    specializes the kernel exactly as build_source(key) says: the key names one binary, and a chunk
    of any size (the last, shorter one too) needs no other compile."""
    pytest.importorskip("triton")
    from kdistill.kernels.spec import triton_specialization

    seen: dict[tuple, tuple] = {}
    for rows, v, off, dt, alpha, need_grad, gd, misalign in LAUNCHES:
        base = torch.zeros((rows + 1) * v + 8, dtype=dt)
        s = base[1 : 1 + rows * v].view(rows, v) if misalign else torch.zeros(rows, v, dtype=dt)
        t = torch.zeros(rows, v, dtype=dt)
        y = torch.zeros(rows + off, dtype=torch.int64)[off:]
        for div, temp in (("forward_kl", 2.0), ("skew_reverse_kl", 2.0), ("forward_kl", 1.0)):
            kernel, _grid, args, kwargs, _ = kd.launch_args(s, t, y, alpha=alpha, temperature=temp, divergence=div,
                                                         need_grad=need_grad, grad_dtype=gd)  # fmt: skip
            got = triton_specialization(kernel, args, kwargs, "sm_90")
            key = kd_loss_kernel_key(
                v, div, dt, "sm_90", has_kd=alpha > 0, need_grad=need_grad, grad_dtype=gd, unit_t=temp == 1.0
            )
            assert got == _spec_of_source(*build_source(key)), (rows, v, off, dt, div, temp)
            assert seen.setdefault(key, got) == got
    # 5 configurations x 3 (divergence, temperature) pairs, less 2: no-KD keys ignore both
    assert len(seen) == 13


if __name__ == "__main__":
    _worker(sys.argv[1])
