"""The memory planner under FSDP2 and activation checkpointing, the big-teacher presets, and
`kdistill plan`'s per-process estimate and GPU count."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kdistill.config import RunConfig
from kdistill.memory import GIB, Layout, choose_layout, estimate_memory, gpus_needed
from kdistill.models.spec import load_spec
from tests.test_train_kit import run_cli


def _cfg(batch=8, seq=2048, **runtime) -> RunConfig:
    cfg = RunConfig()
    cfg.schedule.batch_size, cfg.data.seq_len = batch, seq
    cfg.runtime = dataclasses.replace(cfg.runtime, **runtime)
    return cfg


def test_presets_have_the_published_sizes():
    sizes = {"qwen2.5-14b": 14.77e9, "qwen2.5-32b": 32.76e9, "qwen2.5-72b": 72.71e9}
    for name, total in sizes.items():
        spec = load_spec(name)
        assert spec.param_counts()["total"] == pytest.approx(total, rel=1e-3), name
        assert spec.vocab_size == 152064 and spec.rope_theta == 1e6 and spec.rms_eps == 1e-5
        assert spec.num_kv_heads == 8 and not spec.tie_word_embeddings


def test_sharding_divides_the_student_state_and_the_teacher_by_placement():
    t, s = load_spec("qwen2.5-7b"), load_spec("qwen2.5-1.5b")
    cfg = _cfg()
    one = estimate_memory(t, s, cfg, batch=4)
    rep = estimate_memory(t, s, cfg, batch=4, layout=Layout(world=4))
    shard = estimate_memory(t, s, cfg, batch=4, layout=Layout(world=4, teacher_sharded=True))
    assert rep["student_weights"] == one["student_weights"] // 4
    assert rep["optimizer_state"] == one["optimizer_state"] // 4
    assert "autocast_weight_copies" not in rep and rep["student_gathered_units"] > 0
    assert rep["teacher_weights"] == one["teacher_weights"]
    assert one["teacher_weights"] // 4 < shard["teacher_weights"] < one["teacher_weights"] // 2
    assert shard["total"] < rep["total"] < one["total"]


def test_checkpointing_makes_the_7b_pair_at_4096_fit_one_80gb_gpu():
    t, s = load_spec("qwen2.5-7b"), load_spec("qwen2.5-1.5b")
    budget = int(80 * GIB * 0.95)
    without = estimate_memory(t, s, _cfg(seq=4096, activation_checkpointing="none"))
    with_ = estimate_memory(t, s, _cfg(seq=4096, activation_checkpointing="blocks"))
    assert without["total"] > budget >= with_["total"]
    assert with_["student_activations"] < without["student_activations"] / 5
    auto = choose_layout(t, s, _cfg(seq=4096), budget)
    assert auto == Layout(world=1, teacher_sharded=False, checkpointing=True)
    assert choose_layout(t, s, _cfg(seq=512), budget) == Layout(swiglu_kept=True)  # fits: nothing recomputed


def test_auto_keeps_the_swiglu_output_where_it_fits_then_recomputes_it_then_blocks():
    """activation_checkpointing=auto: nothing recomputed when that fits, then only the SwiGLU output
    (I elements a token and layer less), then whole blocks; explicit choices hold."""
    t, s = load_spec("qwen2.5-1.5b"), load_spec("qwen2.5-0.5b")
    cfg = _cfg(batch=16)
    kept = estimate_memory(t, s, _cfg(batch=16, activation_checkpointing="none"))
    swiglu = estimate_memory(t, s, _cfg(batch=16, activation_checkpointing="swiglu"))
    blocks = estimate_memory(t, s, _cfg(batch=16, activation_checkpointing="blocks"))
    n = 16 * 2048
    assert (
        kept["student_activations"] - swiglu["student_activations"]
        == n * s.num_layers * s.intermediate_size * 2
    )
    assert estimate_memory(t, s, cfg) == swiglu  # auto without a budget: the middle choice
    assert choose_layout(t, s, cfg, kept["total"]) == Layout(swiglu_kept=True)
    assert choose_layout(t, s, cfg, kept["total"] - 1) == Layout()
    assert choose_layout(t, s, cfg, swiglu["total"] - 1) == Layout(checkpointing=True)
    assert blocks["total"] < swiglu["total"] < kept["total"]
    none = _cfg(batch=16, activation_checkpointing="none")
    assert choose_layout(t, s, none, 1) == Layout(swiglu_kept=True)  # held even when it does not fit
    fp8 = _cfg(batch=16, precision="fp8")
    a, b = (estimate_memory(t, s, fp8, layout=Layout(swiglu_kept=k)) for k in (True, False))
    assert a == b  # an FP8 student keeps its fp8 copy either way: nothing to trade


def test_auto_placement_replicates_when_it_fits_and_explicit_choices_hold():
    t, s = load_spec("qwen2.5-1.5b"), load_spec("qwen2.5-0.5b")
    budget = int(80 * GIB * 0.95)
    # it fits: the teacher whole, and the student's blocks kept gathered from forward to backward
    assert choose_layout(t, s, _cfg(), budget, world=2, batch=4) == Layout(2, False, False, True, True)
    shard = choose_layout(t, s, _cfg(teacher_placement="shard"), budget, world=2, batch=4)
    assert shard == Layout(2, True, False, True, True)
    regather = choose_layout(t, s, _cfg(student_reshard="after_forward"), budget, world=2, batch=4)
    assert regather == Layout(2, False, False, False, True)
    big = load_spec("qwen2.5-72b")  # 135 GiB in bf16: never whole on one GPU
    assert choose_layout(big, s, _cfg(), budget, world=2, batch=4).teacher_sharded
    pinned = choose_layout(big, s, _cfg(teacher_placement="replicate"), budget, world=2, batch=4)
    assert not pinned.teacher_sharded  # does not fit: the caller refuses, naming the layout


def test_gpus_needed_for_big_teachers():
    s = load_spec("qwen2.5-1.5b")
    gpu = 80 * GIB
    assert gpus_needed(load_spec("qwen2.5-7b"), s, _cfg(), gpu) == (1, Layout(swiglu_kept=True))
    world, layout = gpus_needed(load_spec("qwen2.5-32b"), s, _cfg(), gpu)
    assert world == 2 and layout.teacher_sharded
    world72, _ = gpus_needed(load_spec("qwen2.5-72b"), s, _cfg(), gpu)
    assert world72 >= 4


def test_plan_command_says_what_the_layout_recomputes(capsys):
    rc, out, _ = run_cli(capsys, "plan", "qwen2.5-1.5b:qwen2.5-0.5b", "schedule.batch_size=16")
    assert rc == 0 and "recompute: nothing)" in out  # an 80 GiB GPU keeps the SwiGLU outputs
    rc, out, _ = run_cli(
        capsys, "plan", "qwen2.5-1.5b:qwen2.5-0.5b", "runtime.activation_checkpointing=swiglu"
    )
    assert rc == 0 and "recompute: SwiGLU outputs)" in out
    rc, out, _ = run_cli(
        capsys, "plan", "qwen2.5-7b:qwen2.5-1.5b", "data.seq_len=4096", "schedule.batch_size=8"
    )
    assert rc == 0 and "recompute: blocks (activation checkpointing))" in out


def test_plan_command_prints_the_gpus_a_pair_needs(capsys):
    rc, out, _ = run_cli(capsys, "plan", "qwen2.5-32b:qwen2.5-1.5b", "schedule.batch_size=8", "--nproc", "2")
    assert rc == 0
    assert "needs 2 GPUs of 80 GiB with the teacher sharded" in out
    assert "2 process(es) of batch 4, teacher sharded" in out
    rc, out, _ = run_cli(
        capsys,
        "plan",
        "qwen2.5-7b:qwen2.5-1.5b",
        "data.seq_len=4096",
        "schedule.batch_size=8",
        "runtime.activation_checkpointing=blocks",
        "--json",
    )
    plan = json.loads(out)
    assert plan["layout"]["checkpointing"] and plan["memory_gib"]["total"] < 80 * 0.95
    assert plan["gpus"]["needed"] == 1
    rc, _, err = run_cli(capsys, "plan", "qwen2.5-7b:qwen2.5-1.5b", "schedule.batch_size=6", "--nproc", "4")
    assert rc != 0 and "--nproc 4" in err


def test_sharded_lora_student_is_planned_with_its_own_terms():
    """Under FSDP2 a LoRA student keeps AdamW state for its adapters only, its base at base_dtype,
    and its gathered blocks as stored (an fp32 base gathers 4 bytes per weight, not 2)."""
    t, s = load_spec("qwen2.5-1.5b"), load_spec("qwen2.5-0.5b")
    cfg = RunConfig()
    cfg.student.lora.rank = 16
    terms = estimate_memory(t, s, cfg, layout=Layout(world=2))
    adapters = s.lora_params(16, cfg.student.lora.targets)
    assert terms["optimizer_state"] == adapters * 8 // 2
    assert terms["student_weights"] == (s.param_counts()["total"] * 4 + adapters * 4) // 2
    full = estimate_memory(t, s, RunConfig(), layout=Layout(world=2))
    assert terms["student_gathered_units"] > 1.9 * full["student_gathered_units"]


def test_student_kept_gathered_plans_every_block_in_bf16_and_is_dropped_when_it_does_not_fit():
    """Kept from forward to backward, all of the student's blocks are gathered at the peak (2 bytes per
    weight) instead of two; `auto` gives that up before it shards the teacher or checkpoints."""
    t, s = load_spec("qwen2.5-7b"), load_spec("qwen2.5-1.5b")
    cfg = _cfg()
    per_block = estimate_memory(t, s, cfg, batch=4, layout=Layout(world=2))
    kept = estimate_memory(t, s, cfg, batch=4, layout=Layout(world=2, student_kept=True))
    c = s.param_counts()
    extra = kept["student_gathered_units"] - per_block["student_gathered_units"]
    assert extra == (s.num_layers - 2) * c["per_layer"] * 2
    # kept, its blocks are sharded 7 to a unit (28 / 4 units): each unit's fp32 gradients at once
    assert per_block["student_reduce_unit"] == c["per_layer"] * 4
    assert kept["student_reduce_unit"] == 7 * c["per_layer"] * 4
    extra += kept["student_reduce_unit"] - per_block["student_reduce_unit"]
    assert kept["total"] - per_block["total"] == extra
    # a budget between the two: the blocks are regathered in backward, nothing else is traded
    budget = (kept["total"] + per_block["total"]) // 2
    assert choose_layout(t, s, cfg, budget, world=2, batch=4) == Layout(2, False, False, False)
    pinned = choose_layout(t, s, _cfg(student_reshard="after_backward"), budget, world=2, batch=4)
    assert pinned.student_kept
    assert choose_layout(t, s, cfg, 10**15, world=1, batch=8) == Layout(
        swiglu_kept=True
    )  # one process: no FSDP


def test_student_unit_blocks_set_how_many_blocks_are_gathered_and_reduced_at_once():
    """runtime.student_unit_blocks: one block a unit for a kept student (its fp32 gradients of one block
    at the reduce-scatter); 3 a unit regathered in backward (two units, 6 blocks, gathered at once)."""
    t, s = load_spec("qwen2.5-7b"), load_spec("qwen2.5-1.5b")
    c = s.param_counts()
    kept = Layout(world=2, student_kept=True)
    one = estimate_memory(t, s, _cfg(student_unit_blocks=1), batch=4, layout=kept)
    assert one["student_reduce_unit"] == c["per_layer"] * 4
    compute = estimate_memory(t, s, _cfg(student_unit_blocks=1, grad_reduce="compute"), batch=4, layout=kept)
    assert compute["student_reduce_unit"] == c["per_layer"] * 2  # reduced in bf16
    regathered = Layout(world=2)
    three = estimate_memory(t, s, _cfg(student_unit_blocks=3), batch=4, layout=regathered)
    default = estimate_memory(t, s, _cfg(), batch=4, layout=regathered)
    assert three["student_gathered_units"] - default["student_gathered_units"] == 4 * c["per_layer"] * 2
    assert three["student_reduce_unit"] == 3 * default["student_reduce_unit"]


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            ["runtime.student_unit_blocks=-1"],
            "runtime.student_unit_blocks is -1, expected 0 (auto) or a positive number of decoder blocks a unit",
        ),
        (
            ["runtime.student_unit_blocks=2", "student.lora.rank=8"],
            "runtime.student_unit_blocks is 2, but a LoRA student (student.lora) is sharded one decoder block "
            "a unit: expected 0 or 1",
        ),
    ],
)
def test_student_unit_blocks_is_refused_in_one_line(capsys, overrides, expected):
    rc, _, err = run_cli(capsys, "plan", "qwen2.5-1.5b:qwen2.5-0.5b", *overrides)
    assert rc == 2
    assert err.strip().splitlines()[-1] == f"kdistill: error: {expected}"


def test_student_reshard_must_be_one_of_the_choices(capsys):
    rc, _, err = run_cli(capsys, "plan", "qwen2.5-1.5b:qwen2.5-0.5b", "runtime.student_reshard=never")
    assert rc == 2
    assert err.strip().splitlines()[-1] == (
        "kdistill: error: runtime.student_reshard is 'never', expected one of: auto, after_forward, after_backward"
    )


def test_compute_dtype_logits_halve_the_head_buffers_on_a_gpu_only():
    """kd.logits_dtype=compute: the two [chunk x vocab] buffers in bf16 on a GPU, fp32 on a CPU."""
    t, s = load_spec("qwen2.5-1.5b"), load_spec("qwen2.5-0.5b")
    cfg = RunConfig()
    fp32 = estimate_memory(t, s, cfg, device="cuda")["loss_chunk_logits"]
    cfg.kd.logits_dtype = "compute"
    assert estimate_memory(t, s, cfg, device="cuda")["loss_chunk_logits"] * 2 == fp32
    assert estimate_memory(t, s, cfg, device="cpu")["loss_chunk_logits"] == fp32
    chunk = min(cfg.kd.chunk_size, cfg.schedule.batch_size * cfg.data.seq_len)
    assert fp32 == 2 * chunk * s.vocab_size * 4


def test_a_lora_student_plans_no_inputs_for_its_frozen_linears():
    """A frozen base keeps no GEMM input for a weight gradient; adapters without dropout keep the input
    they read, once per input their targets share (q/k/v one, gate/up another), and keeping the SwiGLU
    output costs a LoRA student nothing (its frozen down_proj saves no input)."""
    t, s = load_spec("qwen2.5-1.5b"), load_spec("qwen2.5-0.5b")
    n, layers, h = 8 * 2048, s.num_layers, s.hidden_size

    def acts(targets, dropout=0.0, **runtime):
        cfg = _cfg(**runtime)
        cfg.student.lora.rank, cfg.student.lora.dropout, cfg.student.lora.targets = 16, dropout, targets
        return estimate_memory(t, s, cfg, layout=Layout.of(cfg.runtime.activation_checkpointing))

    full = estimate_memory(t, s, _cfg(activation_checkpointing="swiglu"), layout=Layout.of("swiglu"))
    qkv = acts(["q_proj", "k_proj", "v_proj"], activation_checkpointing="swiglu")
    assert full["student_activations"] - qkv["student_activations"] == n * layers * 4 * h
    gate = acts(["q_proj", "k_proj", "v_proj", "gate_proj"], activation_checkpointing="swiglu")
    assert gate["student_activations"] - qkv["student_activations"] == n * layers * 2 * h
    both = acts(["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"], activation_checkpointing="swiglu")
    assert both["student_activations"] == gate["student_activations"]
    kept = acts(["q_proj", "k_proj", "v_proj"], activation_checkpointing="none")
    assert kept["student_activations"] == qkv["student_activations"]
    with_dropout = acts(["q_proj", "k_proj", "v_proj"], dropout=0.1, activation_checkpointing="swiglu")
    assert qkv["student_activations"] - with_dropout["student_activations"] == n * layers * 2 * h


def _onpolicy(cfg: RunConfig, on_policy: float = 1.0) -> RunConfig:
    cfg.kd = dataclasses.replace(cfg.kd, on_policy=on_policy, max_new_tokens=256)
    return cfg


def test_a_replicated_student_is_planned_as_one_process_plus_its_gradient_buffer():
    t, s = load_spec("qwen2.5-7b"), load_spec("qwen2.5-1.5b")
    trainable = s.param_counts()["total"]
    for reduce, width in (("fp32", 4), ("compute", 2)):
        cfg = _onpolicy(_cfg(batch=8, seq=512, grad_reduce=reduce))
        one = estimate_memory(t, s, cfg, batch=4)
        rep = estimate_memory(t, s, cfg, batch=4, layout=Layout(world=2, student_replicated=True))
        assert rep["gradient_average_buffer"] == trainable * width
        assert rep["total"] == one["total"] + trainable * width
        # every step generated: the update is captured under torchrun too, its pool planned beside writing
        assert "generation_beside_graph_pool" in rep
    # data steps are not captured under torchrun (one process captures them): no graph pool planned
    data = _cfg(batch=8, seq=512)
    rep = estimate_memory(t, s, data, batch=4, layout=Layout(world=2, student_replicated=True))
    assert "eval_beside_graph_pool" in estimate_memory(t, s, data, batch=4)
    assert "eval_beside_graph_pool" not in rep and "gradient_average_buffer" in rep


def test_capture_under_torchrun_needs_a_replicated_student_and_generated_steps():
    from kdistill.memory import capture_blocker

    cfg = _onpolicy(_cfg())
    assert capture_blocker(cfg, "cuda", 2) == (
        "the run is under torchrun with a sharded student (FSDP2's collectives are not captured)"
    )
    assert capture_blocker(cfg, "cuda", 2, replicated=True) is None
    assert "not every step is generated" in capture_blocker(_onpolicy(_cfg(), 0.5), "cuda", 2, True)
    assert "not every step is generated" in capture_blocker(_cfg(), "cuda", 2, True)  # off-policy
    assert capture_blocker(_cfg(), "cuda", 1) is None


def test_auto_replicates_a_student_that_writes_where_it_fits_and_explicit_choices_hold():
    t, s = load_spec("qwen2.5-7b"), load_spec("qwen2.5-1.5b")
    cfg = _onpolicy(_cfg(batch=8, seq=512))
    assert choose_layout(t, s, cfg, 140 * GIB, world=2, batch=4).student_replicated
    # too little memory for whole copies: FSDP2 (its frugal layouts), as before
    small = choose_layout(t, s, cfg, 30 * GIB, world=2, batch=4)
    assert not small.student_replicated
    assert not choose_layout(t, s, _cfg(batch=8, seq=512), 140 * GIB, world=2, batch=4).student_replicated
    shard = _onpolicy(_cfg(batch=8, seq=512, student_placement="shard"))
    assert not choose_layout(t, s, shard, 140 * GIB, world=2, batch=4).student_replicated
    forced = _cfg(batch=8, seq=512, student_placement="replicate")  # off-policy, asked for
    layout = choose_layout(t, s, forced, 140 * GIB, world=2, batch=4)
    assert layout.student_replicated and not layout.teacher_sharded
    assert "student replicated" in layout.describe()
    assert not choose_layout(t, s, cfg, 140 * GIB, world=1, batch=4).student_replicated  # one process


def test_a_replicated_student_beside_a_sharded_teacher_is_refused_in_one_line(capsys):
    rc, _, err = run_cli(
        capsys,
        "plan",
        "qwen2.5-1.5b:qwen2.5-0.5b",
        "runtime.student_placement=replicate",
        "runtime.teacher_placement=shard",
    )
    assert rc == 2
    assert err.strip().splitlines()[-1] == (
        "kdistill: error: runtime.student_placement=replicate keeps a whole student on every process beside "
        "a whole teacher, but runtime.teacher_placement is shard: set runtime.teacher_placement to replicate "
        "or auto"
    )


def test_plan_command_says_the_student_is_whole_on_every_process(capsys):
    argv = ["plan", "qwen2.5-1.5b:qwen2.5-0.5b", "data.seq_len=384", "schedule.batch_size=8", "--nproc", "2"]
    rc, out, err = run_cli(capsys, *argv, "kd.on_policy=1", "kd.max_new_tokens=256")
    assert rc == 0, err
    assert "teacher whole, student whole, recompute" in out and "gradient_average_buffer" in out
    rc, out, err = run_cli(capsys, *argv)  # off-policy: FSDP2 under auto
    assert rc == 0, err
    assert "student whole" not in out and "gradient_average_buffer" not in out
