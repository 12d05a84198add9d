"""LoRA students: the adapter math, PEFT's layout (peft loads our adapters onto transformers' model with
the same logits), a run that trains only the adapters and exports them, `kdistill export --merge` (with
the chat template a conversation run trained with), bit-identical resume (with kd.layer_map too: its
projections are checkpointed beside the adapters), config errors, and the memory plan and kernel plan of a
LoRA run.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from kdistill.config import RunConfig, load_config
from kdistill.kernels import library
from kdistill.kernels import plan as plan_mod
from kdistill.memory import estimate_memory
from kdistill.models.hf_io import load_model
from kdistill.models.lora import (
    LoraLinear,
    adapter_state,
    apply_lora,
    load_adapter,
    lora_modules,
    merge_lora,
    save_adapter,
)
from kdistill.models.spec import load_spec
from tests.test_train_kit import (
    assets,
    base_config,
    final_weights,
    one_error_line,
    run_cli,
    run_proc,
    start_proc,
)
from tests.tiny import load_hf, sample_ids

TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]


def _lora_config(run_dir, **schedule):
    cfg = base_config(run_dir, **schedule)
    cfg["student"] = {
        "path": str(assets().student),
        "init": "pretrained",
        "lora": {"rank": 4, "alpha": 8, "dropout": 0.1, "targets": TARGETS},
    }
    return cfg


def _write(folder, cfg):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _randomise_b(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)


def test_lora_linear_is_the_formula_and_starts_as_the_base():
    torch.manual_seed(0)
    base = torch.nn.Linear(12, 7, bias=True)
    w = LoraLinear(base, rank=3, alpha=6.0, dropout=0.0)
    w.reset_adapter(torch.Generator().manual_seed(0))
    x = torch.randn(5, 12)
    assert torch.equal(w(x), base(x))  # B = 0
    assert w.lora_A.weight.abs().max() <= 1 / 12**0.5  # kaiming-uniform(a=sqrt(5)) bound 1/sqrt(fan_in)
    with torch.no_grad():
        w.lora_B.weight.normal_()
    a, b = w.lora_A.weight, w.lora_B.weight
    torch.testing.assert_close(w(x), base(x) + (x @ a.t() @ b.t()) * 2.0)
    y = w(x)
    merged = w.merged()
    torch.testing.assert_close(merged(x), y, atol=1e-5, rtol=1e-5)


def test_only_adapters_are_trainable():
    m = load_model(assets().student)
    apply_lora(m, rank=2, alpha=4, dropout=0.0, targets=TARGETS)
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trainable == set(adapter_state(m))
    assert len(trainable) == 2 * len(TARGETS) * m.spec.num_layers


def test_peft_loads_our_adapter_with_the_same_logits(tmp_path):
    from peft import PeftModel

    student = assets().student
    m = load_model(student)
    apply_lora(m, rank=4, alpha=8, dropout=0.1, targets=TARGETS, seed=0)
    _randomise_b(m)
    m.eval()
    save_adapter(m, tmp_path / "adapter", base_model=str(student))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys

    peft_model = PeftModel.from_pretrained(load_hf(student), str(tmp_path / "adapter")).eval()
    ids = sample_ids(m.spec.vocab_size, batch=2, seq_len=24)
    with torch.no_grad():
        ours, theirs = m.logits(ids), peft_model(input_ids=ids).logits
        base = load_hf(student)(input_ids=ids).logits
    assert (ours - base).abs().max() > 1e-2  # the adapters change the model
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)

    # And back: our loader reads the adapter into a fresh base.
    again = load_adapter(load_model(student), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(again.logits(ids), ours, atol=0, rtol=0)


def test_lora_run_trains_adapters_exports_peft_layout_and_merges(tmp_path, capsys):
    from peft import PeftModel

    run_dir = tmp_path / "run"
    cfg = _write(tmp_path, _lora_config(run_dir, steps=6, checkpoint_every=3))
    rc, out, err = run_cli(capsys, "run", str(cfg), "--quiet")
    assert rc == 0, err
    adapter = run_dir / "adapter"
    assert (adapter / "adapter_config.json").is_file() and not (run_dir / "student").exists()
    # The checkpoint holds the adapters only (the base is the student's own weights).
    ckpt = final_weights(run_dir)
    assert set(ckpt) == {k for k in ckpt if ".lora_A." in k or ".lora_B." in k} and ckpt
    assert any(v.abs().max() > 0 for k, v in ckpt.items() if ".lora_B." in k)  # B moved off zero

    ours = load_adapter(load_model(assets().student), adapter).eval()
    ids = sample_ids(ours.spec.vocab_size, batch=2, seq_len=24, seed=3)
    peft_model = PeftModel.from_pretrained(load_hf(assets().student), str(adapter)).eval()
    with torch.no_grad():
        want = ours.logits(ids)
        torch.testing.assert_close(peft_model(input_ids=ids).logits, want, atol=1e-4, rtol=0)

    rc, out, err = run_cli(
        capsys, "export", "--run", str(run_dir), "--merge", "--out", str(tmp_path / "merged")
    )
    assert rc == 0, err
    merged = load_hf(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-4, rtol=0)
    assert (tmp_path / "merged" / "tokenizer.json").is_file()

    rc, out, err = run_cli(capsys, "export", "--run", str(run_dir), "--out", str(tmp_path / "copy"))
    assert rc == 0, err
    assert (tmp_path / "copy" / "adapter_model.safetensors").is_file()


def test_merged_export_carries_the_chat_template_the_run_trained_with(tmp_path, capsys):
    """A LoRA run on conversations rendered with data.chat_template: the merged model holds that
    template (not the base student's own), and transformers renders with it as the run did."""
    import shutil

    from transformers import AutoTokenizer

    from kdistill.data.chat_template import load_chat_template
    from tests.test_chat_train import TEMPLATE, write_chat_files

    student = tmp_path / "student"
    shutil.copytree(assets().student, student)
    (student / "chat_template.jinja").write_text("base: " + TEMPLATE, encoding="utf-8")
    data, template = write_chat_files(tmp_path / "data", n=24)
    run_dir = tmp_path / "run"
    cfg = _lora_config(run_dir, steps=2, batch_size=2)
    cfg["student"]["path"] = str(student)
    cfg["data"] = {
        "train": [str(data)],
        "heldout_fraction": 0.2,
        "seq_len": 48,
        "chat_template": str(template),
        "cache_dir": str(assets().cache),
    }
    rc, _, err = run_cli(capsys, "run", str(_write(tmp_path, cfg)), "--quiet")
    assert rc == 0, err
    merged = tmp_path / "merged"
    rc, _, err = run_cli(capsys, "export", "--run", str(run_dir), "--merge", "--out", str(merged))
    assert rc == 0, err
    assert (merged / "chat_template.jinja").read_text(encoding="utf-8") == TEMPLATE
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick fox"}]
    want = load_chat_template(assets().teacher, template).render(conv, add_generation_prompt=True)
    got = AutoTokenizer.from_pretrained(merged).apply_chat_template(
        conv, tokenize=False, add_generation_prompt=True
    )
    assert got == want and got.startswith("system: be brief")
    # The base student keeps its own template.
    assert (student / "chat_template.jinja").read_text(encoding="utf-8") == "base: " + TEMPLATE
    # The run kept the template as it trained with it: an edited template file changes nothing, and the
    # adapter export carries it too.
    assert (run_dir / "adapter" / "chat_template.jinja").read_text(encoding="utf-8") == TEMPLATE
    template.write_text("edited: " + TEMPLATE, encoding="utf-8")
    rc, _, err = run_cli(capsys, "export", "--run", str(run_dir), "--merge", "--out", str(tmp_path / "m1"))
    assert rc == 0, err
    assert (tmp_path / "m1" / "chat_template.jinja").read_text(encoding="utf-8") == TEMPLATE
    rc, _, err = run_cli(capsys, "export", "--run", str(run_dir), "--out", str(tmp_path / "a1"))
    assert rc == 0, err
    assert (tmp_path / "a1" / "chat_template.jinja").read_text(encoding="utf-8") == TEMPLATE
    # An adapter without it (written before runs kept it) resolves data.chat_template again; a run
    # stopped before its summary.json is judged by its data.train files.
    template.write_text(TEMPLATE, encoding="utf-8")
    (run_dir / "adapter" / "chat_template.jinja").unlink()
    (run_dir / "summary.json").unlink()
    rc, _, err = run_cli(capsys, "export", "--run", str(run_dir), "--merge", "--out", str(tmp_path / "m2"))
    assert rc == 0, err
    assert (tmp_path / "m2" / "chat_template.jinja").read_text(encoding="utf-8") == TEMPLATE


def test_lora_resume_is_bit_identical(tmp_path):
    cfg = _write(tmp_path, _lora_config(tmp_path / "unused", steps=6, checkpoint_every=2))
    full, cut = tmp_path / "full", tmp_path / "cut"
    r = run_proc(["run", str(cfg), f"output.dir={full}", "--quiet"], 180)
    assert r.returncode == 0, r.stderr
    r = run_proc(["run", str(cfg), f"output.dir={cut}", "--quiet"], 180, KDISTILL_TEST_KILL_AT="3")
    assert r.returncode != 0
    r = run_proc(["run", "--resume", str(cut), "--quiet"], 180)
    assert r.returncode == 0, r.stderr
    a, b = final_weights(full), final_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_resume_keeps_the_layer_map_projections(tmp_path, capsys):
    """kd.layer_map trains projections beside the adapters: the checkpoint holds them and their AdamW
    state, so the resumed run is the uninterrupted one bit for bit; the exported adapter leaves them out."""
    from safetensors.torch import load_file, save_file

    cfg = _lora_config(tmp_path / "unused", steps=4, checkpoint_every=2)
    cfg["kd"].update(layer_map=[[0, 0], [1, 1]], hidden_weight=0.5)  # widths 32 -> 64: projections
    path = _write(tmp_path, cfg)
    full, cut = tmp_path / "full", tmp_path / "cut"
    procs = [
        start_proc(["run", str(path), f"output.dir={full}", "--quiet"]),
        start_proc(["run", str(path), f"output.dir={cut}", "--quiet"], KDISTILL_TEST_KILL_AT="3"),
    ]
    for p in procs:
        p.communicate(timeout=180)
    assert procs[0].returncode == 0 and procs[1].returncode != 0
    saved = load_file(str(cut / "checkpoints" / "step-0000002" / "student.safetensors"))
    assert {k for k in saved if k.startswith("kd_")} == {"kd_layer_proj.0.weight", "kd_layer_proj.1.weight"}
    r = run_proc(["run", "--resume", str(cut), "--quiet"], 180)
    assert r.returncode == 0, r.stderr
    rows = [[json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (full, cut)]
    assert [row["step"] for row in rows[1]] == [1, 2, 3, 4]
    keys = ("loss", "ce", "kd", "grad_norm")
    for x, y in zip(*rows, strict=True):
        assert [y[k] for k in keys] == [x[k] for k in keys], x["step"]
    a, b = final_weights(full), final_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    exported = load_file(str(cut / "adapter" / "adapter_model.safetensors"))
    assert exported and not any("kd_" in k for k in exported)
    # A checkpoint of such a run without its projections (adapters only) is refused, not resumed with
    # fresh projections.
    step = sorted((full / "checkpoints").iterdir())[-1]
    tensors = step / "student.safetensors"
    save_file({k: v for k, v in load_file(str(tensors)).items() if not k.startswith("kd_")}, str(tensors))
    rc, _, err = run_cli(capsys, "run", "--resume", str(full), "--quiet")
    assert rc == 2 and one_error_line(err) == (
        f"{step}: checkpoint does not match this run (missing tensor 'kd_layer_proj.0.weight')"
    )


@pytest.mark.parametrize(
    "override, needle",
    [
        ("student.lora.targets=q_proj,qkv", "student.lora.targets has 'qkv'"),
        ("student.lora.rank=-1", "student.lora.rank is -1"),
        ("student.lora.dropout=1.5", "student.lora.dropout is 1.5"),
        ("student.lora.base_dtype=float16", "student.lora.base_dtype is 'float16'"),
        ("student.lora.targets=q_proj,q_proj", "lists a name twice"),
        ("student.init=random", "student.init is 'random' with student.lora"),
    ],
)
def test_lora_config_errors_are_one_line(tmp_path, capsys, override, needle):
    cfg = _write(tmp_path, _lora_config(tmp_path / "run"))
    rc, out, err = run_cli(capsys, "run", str(cfg), override, "--quiet")
    assert rc == 2
    assert needle in one_error_line(err)


def test_bf16_base_on_the_cpu_is_refused(tmp_path, capsys):
    cfg = _write(tmp_path, _lora_config(tmp_path / "run"))
    rc, out, err = run_cli(capsys, "run", str(cfg), "student.lora.base_dtype=bfloat16", "--quiet")
    assert rc == 2 and "needs a GPU run under autocast" in one_error_line(err)


def test_export_of_a_full_run_says_so(tmp_path, capsys):
    run_dir = tmp_path / "run"
    cfg = base_config(run_dir, steps=1)
    rc, out, err = run_cli(capsys, "run", str(_write(tmp_path, cfg)), "--quiet")
    assert rc == 0, err
    rc, out, err = run_cli(capsys, "export", "--run", str(run_dir), "--merge", "--out", str(tmp_path / "m"))
    assert rc == 2 and "not a LoRA run" in one_error_line(err)


def test_memory_and_kernel_plans_cover_lora():
    a = assets()
    teacher, student = load_spec(a.teacher), load_spec(a.student)
    full = RunConfig()
    lora = load_config(None, ["student.lora.rank=8", "student.lora.base_dtype=bfloat16"]).validate(
        need_paths=False
    )
    m_full, m_lora = estimate_memory(teacher, student, full), estimate_memory(teacher, student, lora)
    trainable = student.lora_params(8, lora.student.lora.targets)
    assert m_lora["optimizer_state"] == trainable * 8 < m_full["optimizer_state"]
    assert m_lora["lora_activations"] > 0 and m_lora["student_weights"] < m_full["student_weights"]

    keys = plan_mod.required_kernels(teacher, student, lora, "sm_90")
    n = lora.schedule.batch_size * lora.data.seq_len
    for t in lora.student.lora.targets:
        fan_in, fan_out = student.linear_shapes()[t]
        assert library.gemm_key("sm_90", m=n, n=8, k=fan_in, dtype="bf16", grad=True) in keys
        assert library.gemm_key("sm_90", m=n, n=fan_out, k=8, dtype="bf16", grad=True) in keys
    assert plan_mod.precision(lora, "sm_90").student_weights == "bf16"
    assert keys - plan_mod.required_kernels(teacher, student, full, "sm_90")


@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16"])
def test_lora_contract_launched_keys_are_planned(base_dtype):
    """A LoRA student's training and eval step on the reference path (bf16 autocast, as on a GPU)
    launches only planned keys."""
    from kdistill.kernels import contract, runtime
    from kdistill.kernels import seal as cache
    from kdistill.models.decoder import build_decoder
    from kdistill.train.step import compute_loss, heldout_eval
    from tests.test_contract import make_spec

    teacher_spec, student_spec = make_spec(hidden=48, vocab=40), make_spec(arch="llama", hidden=32, vocab=40)
    run = RunConfig()
    run.runtime.dtype, run.schedule.batch_size, run.data.seq_len, run.kd.chunk_size = "bfloat16", 2, 5, 4
    run.student.lora.rank, run.student.lora.base_dtype = 4, base_dtype
    run.student.lora.targets = ["q_proj", "o_proj", "up_proj"]
    prec = plan_mod.precision(run, "sm_90")
    teacher = build_decoder(teacher_spec, dtype=torch.bfloat16).eval().requires_grad_(False)
    student = build_decoder(student_spec, dtype=getattr(torch, base_dtype), seed=1)
    apply_lora(student, rank=4, alpha=8, dropout=0.1, targets=run.student.lora.targets)
    ids = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(0))
    labels = ids.flatten().clone()
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=prec.autocast)
    with runtime.using(mode="reference", arch="sm_90"), runtime.recording(deep=True) as rec:
        compute_loss(student, teacher, ids, labels, run, amp).loss.backward()
        heldout_eval(student, teacher, [(ids, labels)], run, torch.device("cpu"), amp, with_teacher_loss=True)
    plan = plan_mod.required_kernels(teacher_spec, student_spec, run, "sm_90")
    warm = cache.prewarm(plan, "cpu", dry=True)
    assert not warm.failed
    assert contract.check(rec.launches, plan, warm.specializations) == []
    merge_lora(student)
    assert not lora_modules(student)


def test_bf16_base_under_fsdp2_of_torch_before_2_8_is_refused(monkeypatch):
    """FSDP2 before torch 2.8 wants one dtype per unit: a bf16 base beside fp32 adapters is refused
    (one line, before anything loads); a fp32 base shards on any version."""
    from torch.torch_version import TorchVersion

    from kdistill.errors import UserError
    from kdistill.train import distributed as dist

    monkeypatch.setattr(torch, "__version__", TorchVersion("2.7.1"))
    dist.check_lora_sharding(torch.float32)
    with pytest.raises(UserError) as e:
        dist.check_lora_sharding(torch.bfloat16)
    assert str(e.value) == (
        "student.lora.base_dtype=bfloat16 under torchrun needs torch >= 2.8 (this is 2.7.1): the FSDP2 of "
        "earlier versions shards a decoder block only if all its parameters share one dtype, and the block "
        "holds the bfloat16 base and the float32 adapters; upgrade torch or use student.lora.base_dtype=float32"
    )
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.8.0"))
    dist.check_lora_sharding(torch.bfloat16)


def test_a_frozen_down_proj_recomputes_nothing_in_backward(monkeypatch):
    """The MLP's recomputing down_proj (`dispatch.swiglu_down`) under a frozen weight (a LoRA base):
    the same gradient for [gate, up] as with a trainable weight, no weight gradient, and the SwiGLU
    output computed once (forward), not again in backward, since only the weight gradient needs it."""
    from kdistill import dispatch

    calls = []
    real = dispatch.swiglu
    monkeypatch.setattr(dispatch, "swiglu", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(0)
    gu0, w0 = torch.randn(3, 5, 16, generator=g), torch.randn(6, 8, generator=g)
    dy = torch.randn(3, 5, 6, generator=g)
    grads = {}
    for frozen in (False, True):
        gu, w = gu0.clone().requires_grad_(), w0.clone().requires_grad_(not frozen)
        calls.clear()
        dispatch.swiglu_down(gu, w).backward(dy)
        grads[frozen] = gu.grad
        assert len(calls) == (1 if frozen else 2)
        assert (w.grad is None) == frozen
    torch.testing.assert_close(grads[True], grads[False], rtol=0, atol=0)
