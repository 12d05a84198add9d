"""runtime.profile_steps: the exposed-collective interval arithmetic and the kernel groups on hand-made
kernels, a tiny CPU run that profiles one step (the report files, the same losses as without the
profiler, the step left out of the steady rate), the config error, and two gloo ranks that each write
their own report.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kdistill.config import RuntimeConfig
from kdistill.errors import UserError
from kdistill.train.profiling import (
    GROUPS,
    device_kernels,
    exposed_collective_us,
    host_at,
    host_spans,
    idle_gaps,
    idle_table,
    kernel_group,
    kernel_launches,
    launcher_of,
    merge_intervals,
    render_text,
    summarize,
    union_length,
)
from tests.test_train_kit import one_error_line, read_summary, run_cli, write_config

NCCL = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT"
ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int)"


# ----------------------------------------------------------------------------------------------
# interval arithmetic
# ----------------------------------------------------------------------------------------------
def test_merge_and_union_length():
    assert merge_intervals([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 7)]
    assert union_length([(0, 10), (2, 3), (8, 12)]) == 12
    assert union_length([]) == 0


@pytest.mark.parametrize(
    "kernels, exposed",
    [
        ([], 0.0),  # no kernels at all
        ([(GEMM, 0, 10), (ADD, 10, 12)], 0.0),  # no collective
        ([(NCCL, 0, 10)], 10.0),  # a collective alone
        ([(NCCL, 0, 10), (GEMM, 20, 30)], 10.0),  # disjoint: all of it exposed
        ([(NCCL, 0, 10), (GEMM, 4, 14)], 4.0),  # overlapping compute hides its part
        ([(NCCL, 0, 10), (GEMM, 2, 5)], 7.0),  # compute nested in the collective
        ([(NCCL, 3, 6), (GEMM, 0, 10)], 0.0),  # the collective nested in compute: hidden
        # two overlapping collectives count once; two compute kernels on other streams overlap each other
        ([(NCCL, 0, 10), (NCCL, 5, 15), (GEMM, 2, 6), (ADD, 4, 8), (GEMM, 12, 13)], 8.0),
        # a memcpy runs on a copy engine: it hides nothing
        ([(NCCL, 0, 10), ("Memcpy DtoD (Device -> Device)", 0, 10)], 10.0),
    ],
)
def test_exposed_collective_time(kernels, exposed):
    assert exposed_collective_us(kernels) == pytest.approx(exposed)


# ----------------------------------------------------------------------------------------------
# kernel groups
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, group",
    [
        (NCCL, "collectives"),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collectives"),
        (GEMM, "GEMM"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "GEMM"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn>", "GEMM"),
        ("matmul_kernel", "GEMM"),
        (
            "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64, 64, 4, cutlass::bfloat16_t>>",
            "attention",
        ),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
        ("_kd_forward_kernel", "Triton kernels"),
        ("_rmsnorm_bwd_kernel", "Triton kernels"),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
            "optimizer",
        ),
        ("void at::native::multi_tensor_apply_kernel<TensorListMetadata<2>, foreach_binary_op>", "optimizer"),
        (ADD, "copy/elementwise"),
        (
            "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t>>",
            "copy/elementwise",
        ),
        (
            "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>>",
            "copy/elementwise",
        ),
        ("void at::native::unrolled_elementwise_kernel<at::native::FillFunctor<float>>", "copy/elementwise"),
        ("Memcpy HtoD (Pageable -> Device)", "copy/elementwise"),
        ("Memset (Device)", "copy/elementwise"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "other"),
        ("void at::native::index_elementwise_kernel_helper", "copy/elementwise"),
        ("some_library_thing", "other"),
    ],
)
def test_kernel_group(name, group):
    assert kernel_group(name) == group


def test_summarize_per_step_tables():
    # two steps of the same kernels: per-step numbers are half the window's totals
    step = [(GEMM, 0, 600), (NCCL, 500, 1500), (ADD, 1500, 1700)]
    kernels = step + [(name, start + 2000, end + 2000) for name, start, end in step]
    report = summarize(kernels, [0.004, 0.006], [3, 4], [("aten::mm", 800.0, 4)], {"rank": 0, "world": 2})
    assert report["steps"] == [3, 4] and report["step_ms"] == [4.0, 6.0] and report["step_ms_mean"] == 5.0
    assert report["kernel_ms_per_step"] == pytest.approx(1.8)  # (600 + 1000 + 200) us x 2 / 2
    assert report["collective_ms_per_step"] == pytest.approx(1.0)
    assert report["exposed_collective_ms_per_step"] == pytest.approx(0.9)  # 100 us hidden by the GEMM
    assert report["device_busy_ms_per_step"] == pytest.approx(1.7)
    groups = {g["group"]: g for g in report["groups"]}
    assert list(groups) == list(GROUPS)
    assert groups["GEMM"]["ms_per_step"] == pytest.approx(0.6) and groups["GEMM"]["launches_per_step"] == 1
    assert groups["other"]["ms_per_step"] == 0
    assert sum(g["share"] for g in report["groups"]) == pytest.approx(1, abs=1e-3)
    assert [k["name"] for k in report["top_kernels"]] == [NCCL, GEMM, ADD]
    assert report["top_cpu_ops"] == [{"name": "aten::mm", "self_ms_per_step": 0.4, "calls_per_step": 2}]
    text = render_text(report)
    assert "exposed collectives per step" in text and "rank 0 of 2" in text and NCCL[:40] in text


def test_idle_gaps_between_device_work_only():
    kernels = [(GEMM, 0, 100), (ADD, 50, 120), (ADD, 125, 200), (GEMM, 260, 300), (ADD, 300, 310)]
    # 120-125 is shorter than the threshold; nothing before the first or after the last counts
    assert idle_gaps(kernels, min_us=10) == [(200, 260)]
    assert idle_gaps(kernels, min_us=5) == [(120, 125), (200, 260)]
    assert idle_gaps([], min_us=1) == []


def test_host_at_names_the_phase_and_the_ops_holding_each_gap():
    spans = [
        ("kdistill.step", 0, 1000),
        ("kdistill.generate", 10, 400),
        ("aten::item", 100, 300),
        ("aten::_local_scalar_dense", 110, 290),
        ("cudaMemcpyAsync", 120, 280),
        ("kdistill.score", 400, 700),
        ("aten::mm", 650, 660),
    ]
    gaps = [(150, 250), (500, 520), (900, 950), (1500, 1600), (640, 670)]
    hosts = host_at(gaps, spans)
    assert [(h.phase, h.outer, h.inner) for h in hosts] == [
        ("generate", "aten::item", "cudaMemcpyAsync"),  # the innermost phase; the outer and inner op
        ("score", "-", "-"),  # the host ran Python between ops
        ("step", "-", "-"),  # in the step, outside its phases
        ("-", "-", "-"),  # outside any range
        ("score", "aten::mm", "aten::mm"),
    ]
    # each gap's start, into its phase and into the step (the outermost range)
    assert [(h.into_phase_us, h.into_step_us) for h in hosts] == [
        (140, 150),
        (100, 500),
        (900, 900),
        (0, 0),
        (240, 640),
    ]


def test_idle_table_sums_gaps_by_phase_and_host_op_per_step():
    kernels = [(GEMM, 0, 100), (GEMM, 300, 400), (GEMM, 405, 500), (GEMM, 1100, 1200), (GEMM, 1400, 1500)]
    spans = [
        ("kdistill.generate", 0, 600),
        ("cudaStreamSynchronize", 120, 280),
        ("kdistill.generate", 1000, 1600),
        ("cudaStreamSynchronize", 1220, 1380),
    ]
    table = idle_table(kernels, spans, n_steps=2, min_us=20)
    assert table["gaps_per_step"] == 1.5  # 100-300, 500-1100, 1200-1400 (400-405 too short)
    assert table["idle_ms_per_step"] == pytest.approx((200 + 600 + 200) / 2 / 1000)
    assert table["by_phase_ms_per_step"] == {"-": 0.3, "generate": 0.2}
    top = table["top"]
    assert [(r["phase"], r["host_inner"], r["gaps_per_step"], r["longest_us"]) for r in top] == [
        ("-", "-", 0.5, 600.0),
        ("generate", "cudaStreamSynchronize", 1.0, 200.0),
    ]
    assert [(g["us"], g["phase"], g["into_phase_ms"]) for g in table["longest"]] == [
        (600.0, "-", 0.0),
        (200.0, "generate", 0.1),
        (200.0, "generate", 0.2),
    ]
    report = summarize(kernels, [0.001, 0.001], [3, 4], host_spans=spans)
    assert report["idle"] == idle_table(kernels, spans, n_steps=2)  # the default threshold: the same gaps
    assert report["idle"]["gaps_per_step"] == 1.5
    text = render_text(report)
    assert "device idle per step" in text and "longest gaps" in text
    assert text.count("cudaStreamSynchronize") == 3  # one (phase, op) row, two of the longest gaps


def test_host_spans_keep_the_host_side():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(name, device_type, start, end):
        return SimpleNamespace(
            name=name, device_type=device_type, time_range=SimpleNamespace(start=start, end=end)
        )

    events = [
        ev("aten::mm", DeviceType.CPU, 1, 5),
        ev(GEMM, DeviceType.CUDA, 2, 4),
        ev("kdistill.score", DeviceType.CPU, 0, 9),
    ]
    assert host_spans(events) == [("aten::mm", 1.0, 5.0), ("kdistill.score", 0.0, 9.0)]


def _host_chain(*names, shapes=None, kernels=(), device_type=None):
    """Hand-made host events, outermost first, each the cpu_parent of the next; the last (innermost)
    carries `kernels` ((name, device, duration_us) each) and the given input shapes."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    parent = None
    for i, name in enumerate(names):
        last = i == len(names) - 1
        parent = SimpleNamespace(
            name=name,
            device_type=device_type or DeviceType.CPU,
            cpu_parent=parent,
            input_shapes=[],
            kernels=[SimpleNamespace(name=k, device=d, duration=us) for k, d, us in kernels] if last else [],
        )
    return parent


def test_a_kernels_launcher_is_its_phase_and_the_ops_above_the_runtime_call():
    copy = "void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>"
    call = _host_chain(
        "kdistill.step",
        "autograd::engine::evaluate_function: MmBackward0",
        "aten::mm",
        "aten::copy_",
        "cudaLaunchKernel",
    )
    call.cpu_parent.input_shapes = [[4096, 1536], [1536, 4096], []]
    assert launcher_of(call) == (
        "step",
        "autograd::engine::evaluate_function: MmBackward0",
        "aten::copy_",
        "[[4096, 1536], [1536, 4096], []]",
    )
    # a graph's replay: the runtime call is the inner op where no op holds it; no phase: "-"
    assert launcher_of(_host_chain("cudaGraphLaunch")) == ("-", "cudaGraphLaunch", "cudaGraphLaunch", "")
    assert launcher_of(_host_chain("kdistill.generate", "kdistill.generate.decode", "cudaGraphLaunch"))[
        0
    ] == ("generate.decode")
    events = [
        _host_chain(
            "kdistill.score", "aten::contiguous", "aten::copy_", "cudaLaunchKernel", kernels=[(copy, 0, 30.0)]
        ),
        _host_chain(
            "kdistill.score", "aten::contiguous", "aten::copy_", "cudaLaunchKernel", kernels=[(copy, 0, 34.0)]
        ),
        _host_chain("kdistill.step", "aten::to", "aten::copy_", "cudaLaunchKernel", kernels=[(copy, 0, 5.0)]),
        _host_chain(
            "kdistill.step", "aten::to", "aten::copy_", "cudaLaunchKernel", kernels=[(copy, 1, 99.0)]
        ),
        _host_chain("kdistill.step", "aten::mm", "cudaLaunchKernel"),  # no kernel of its own
    ]
    got = kernel_launches(events, device_index=0)
    assert got == {
        copy: {
            ("score", "aten::contiguous", "aten::copy_", ""): [64.0, 2],
            ("step", "aten::to", "aten::copy_", ""): [5.0, 1],
        }
    }
    # the report: under each top kernel its launchers by device time, per step (two steps here)
    report = summarize([(copy, 0, 30), (copy, 40, 74), (copy, 80, 85)], [0.1, 0.1], [3, 4], launches=got)
    top = report["top_kernels"][0]
    assert [r["phase"] for r in top["launched_by"]] == ["score", "step"]
    assert top["launched_by"][0]["ms_per_step"] == pytest.approx(0.032)
    assert top["launched_by"][0]["launches_per_step"] == 1.0 and "shapes" not in top["launched_by"][0]
    assert top["unlinked_ms_per_step"] == 0.0
    text = render_text(report)
    assert "<- score: aten::contiguous > aten::copy_" in text and "<- step: aten::to > aten::copy_" in text
    assert "no host call linked" not in text
    # device time with no launch linked to it (a graph's replay): counted apart, and the text says so
    more = summarize(
        [(copy, 0, 30), (copy, 40, 74), (copy, 80, 85), (copy, 90, 100)], [0.1, 0.1], [3, 4], launches=got
    )
    assert more["top_kernels"][0]["unlinked_ms_per_step"] == pytest.approx(0.005)
    assert "no host call linked" in render_text(more)
    # without launches (a CPU run) the rows carry none
    assert "launched_by" not in summarize([(copy, 0, 30)], [0.1], [3])["top_kernels"][0]


def test_device_kernels_keep_gpu_work_only():
    """From the profiler's events: kernels, memcpys and memsets of this process's GPU; not the CPU ops,
    not the user-annotation spans that record_function (FSDP's too) puts on the GPU timeline."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(name, device, activity, index=0, annotation=False, start=0.0, end=1.0):
        return SimpleNamespace(
            name=name,
            device_type=device,
            device_index=index,
            activity_type=activity,
            is_user_annotation=annotation,
            time_range=SimpleNamespace(start=start, end=end),
        )

    events = [
        ev("aten::mm", DeviceType.CPU, "cpu_op"),
        ev(GEMM, DeviceType.CUDA, "kernel", start=1, end=3),
        ev("Memcpy HtoD (Pageable -> Device)", DeviceType.CUDA, "gpu_memcpy"),
        ev("Memset (Device)", DeviceType.CUDA, "gpu_memset"),
        ev("FSDP::all_gather", DeviceType.CUDA, "gpu_user_annotation", annotation=True, end=50),
        ev(NCCL, DeviceType.CUDA, "kernel", index=1),  # another GPU
        ev("FSDP::post_backward", DeviceType.CUDA, None, annotation=True),  # a torch without activity_type
    ]
    assert device_kernels(events, 0) == [
        (GEMM, 1.0, 3.0),
        ("Memcpy HtoD (Pageable -> Device)", 0.0, 1.0),
        ("Memset (Device)", 0.0, 1.0),
    ]
    assert [k[0] for k in device_kernels(events)][-1] == NCCL


# ----------------------------------------------------------------------------------------------
# a tiny run
# ----------------------------------------------------------------------------------------------
REPORT_KEYS = {
    "rank",
    "world",
    "device",
    "torch",
    "steps",
    "step_ms",
    "step_ms_mean",
    "kernel_ms_per_step",
    "device_busy_ms_per_step",
    "collective_ms_per_step",
    "exposed_collective_ms_per_step",
    "groups",
    "top_kernels",
    "top_cpu_ops",
}


def _losses(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_run_profiles_one_step_and_trains_the_same(tmp_path, capsys):
    cfg = write_config(tmp_path, steps=4)
    rc, _, err = run_cli(capsys, "run", str(cfg), f"output.dir={tmp_path / 'plain'}", "--quiet")
    assert rc == 0, err
    rc, _, err = run_cli(
        capsys, "run", str(cfg), f"output.dir={tmp_path / 'prof'}", "runtime.profile_steps=1"
    )
    assert rc == 0, err
    run = tmp_path / "prof"
    # the step right after the warm-up steps (2) is profiled; rank 0 says where the profile is
    line = next(ln for ln in err.splitlines() if "profile (step 3, rank 0)" in ln)
    assert str(run / "profile" / "rank0.txt") in line and "exposed collectives" in line
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["rank0.json", "rank0.txt"]
    report = json.loads((run / "profile" / "rank0.json").read_text())
    assert REPORT_KEYS <= report.keys()
    assert report["rank"] == 0 and report["world"] == 1 and report["device"] == "cpu"
    assert report["steps"] == [3] and len(report["step_ms"]) == 1 and report["step_ms"][0] > 0
    assert report["kernel_ms_per_step"] == 0 and report["top_kernels"] == []  # no GPU
    assert [g["group"] for g in report["groups"]] == list(GROUPS)
    assert any(o["name"] == "aten::mm" for o in report["top_cpu_ops"])  # the CPU side was recorded
    assert "exposed collectives per step" in (run / "profile" / "rank0.txt").read_text()

    # the profiled step trains like any other: the same losses, bit for bit
    plain, prof = _losses(tmp_path / "plain"), _losses(run)
    assert [r["loss"] for r in prof] == [r["loss"] for r in plain]
    assert [r["grad_norm"] for r in prof] == [r["grad_norm"] for r in plain]
    assert [r.get("profiled", False) for r in prof] == [False, False, True, False]
    summary = read_summary(run)
    assert summary["final_loss"] == read_summary(tmp_path / "plain")["final_loss"]
    assert summary["profiled_steps"] == [3]
    # the steady rate is step 4's alone (step 3 is profiled, steps 1-2 are warm-up)
    assert summary["tokens_per_s_steady"] == pytest.approx(prof[3]["tokens_per_s"], rel=1e-6)
    assert "profiled_steps" not in read_summary(tmp_path / "plain")


def test_a_run_too_short_to_profile_warns_and_trains(tmp_path, capsys, caplog):
    cfg = write_config(tmp_path, steps=2)
    rc, _, err = run_cli(capsys, "run", str(cfg), "runtime.profile_steps=3", "--quiet")
    assert rc == 0, err
    assert "nothing profiled" in caplog.text
    assert not (tmp_path / "run" / "profile").exists()
    assert read_summary(tmp_path / "run")["profiled_steps"] == []


def test_a_profile_that_cannot_be_written_is_a_warning(tmp_path, capsys, caplog, monkeypatch):
    import errno

    from kdistill.train import profiling

    def disk_full(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(profiling, "atomic_write_json", disk_full)
    cfg = write_config(tmp_path, steps=3)
    rc, _, err = run_cli(capsys, "run", str(cfg), "runtime.profile_steps=1", "--quiet")
    assert rc == 0, err
    assert "cannot write the profile (No space left on device); training goes on" in caplog.text
    assert read_summary(tmp_path / "run")["status"] == "completed"


# ----------------------------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------------------------
def test_negative_profile_steps_is_a_one_line_error(tmp_path, capsys):
    cfg = write_config(tmp_path, steps=2)
    rc, _, err = run_cli(capsys, "run", str(cfg), "runtime.profile_steps=-1", "--quiet")
    assert rc == 2
    assert one_error_line(err) == "runtime.profile_steps is -1, expected 0 (off) or a positive integer"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value, shown", [("1.5", "1.5"), ("many", "'many'"), ("true", "True")])
def test_profile_steps_must_be_an_integer(tmp_path, capsys, value, shown):
    cfg = write_config(tmp_path, steps=2)
    rc, _, err = run_cli(capsys, "run", str(cfg), f"runtime.profile_steps={value}", "--quiet")
    assert rc == 2
    assert one_error_line(err) == f"runtime.profile_steps is {shown}, expected an integer"


def test_profile_steps_default_is_off():
    assert RuntimeConfig().profile_steps == 0
    with pytest.raises(UserError, match="runtime.profile_steps is -2"):
        RuntimeConfig(profile_steps=-2).validate()


# ----------------------------------------------------------------------------------------------
# two gloo ranks
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_every_rank_writes_its_own_profile(tmp_path):
    from tests.test_distributed import torchrun

    cfg = write_config(tmp_path, steps=3)
    run = tmp_path / "two"
    r = torchrun(["run", str(cfg), f"output.dir={run}", "runtime.profile_steps=1"], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    names = sorted(p.name for p in (run / "profile").iterdir())
    assert names == ["rank0.json", "rank0.txt", "rank1.json", "rank1.txt"]
    for rank in (0, 1):
        report = json.loads((run / "profile" / f"rank{rank}.json").read_text())
        assert report["rank"] == rank and report["world"] == 2 and report["steps"] == [3]
    lines = [ln for ln in r.stderr.splitlines() if "profile (step 3, rank 0)" in ln]
    assert len(lines) == 1 and "rank0 to rank1" in lines[0]  # rank 0 alone prints
    assert read_summary(run)["profiled_steps"] == [3]
