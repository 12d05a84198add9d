"""GPU end-to-end check: strict-mode runs of real-shaped teacher/student pairs (random weights).

    PYTHONPATH=src:. python3 scripts/gpu_e2e.py --pair qwen2.5-1.5b:qwen2.5-0.5b --seq-len 2048 \
        --batch 4 --steps 20 --out runs/gpu_e2e_qwen

For the pair it writes random-weight Hugging Face directories at the presets' real shapes (with a small
byte-level tokenizer: the data's token ids stay below its vocabulary, the logits still span the full
vocabulary), then runs `kdistill run` twice with runtime.strict_kernels=true: the first run compiles
the kernel plan in prewarm, the second must find everything in the cache. Each run's summary.json
(jit_after_prewarm, prewarm counts, tokens/s, measured vs planned peak memory) is collected into
OUT/results.json and printed as a table.

Scaling: `--nproc 1,2,4 --per-gpu-batch 8` runs the pair on 1, 2 and 4 GPUs in turn (torchrun for more
than one), each with 8 sequences per GPU (schedule.batch_size = 8 x nproc), `--runs` times each, and
adds each setting's steady tokens/s over the one-GPU setting's (the table's `speedup`):

    PYTHONPATH=src:. python3 scripts/gpu_e2e.py --pair qwen2.5-1.5b:qwen2.5-0.5b --seq-len 2048 \
        --per-gpu-batch 8 --nproc 1,2,4 --steps 30 --runs 1 --out runs/gpu_e2e_scaling
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch


def make_model_dir(preset: str, out: Path, tok_dir: Path, seed: int) -> Path:
    from kdistill.models.decoder import build_decoder
    from kdistill.models.hf_io import save_model
    from kdistill.models.spec import load_spec

    spec = load_spec(preset)
    model = build_decoder(spec, device="cuda", dtype=torch.bfloat16, seed=None)
    with torch.no_grad():
        g = torch.Generator(device="cuda").manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g)
    save_model(model.cpu(), out, source_dir=tok_dir)
    del model
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", required=True)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--work", default="/tmp/kd_e2e")
    ap.add_argument("--out", required=True)
    ap.add_argument("--extra", nargs="*", default=[])
    ap.add_argument(
        "--nproc", default="1", help="processes (GPUs) under torchrun, or a list like 1,2,4; 1: plain python"
    )
    ap.add_argument("--per-gpu-batch", type=int, default=0, help="sequences per GPU (overrides --batch)")
    ap.add_argument("--reuse", action="store_true", help="keep model dirs that --work already holds")
    ap.add_argument("--make-only", action="store_true", help="write the model dirs, run nothing")
    a = ap.parse_args()
    settings = [int(n) for n in str(a.nproc).split(",")]
    from tests.tiny import make_tokenizer

    work, out = Path(a.work), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = work / "tok"
    tok_dir.mkdir(parents=True, exist_ok=True)
    make_tokenizer(tok_dir, vocab_size=512)
    teacher, student = a.pair.split(":")
    t0 = time.time()
    made = {}
    for role, preset, seed in (("teacher", teacher, 1), ("student", student, 2)):
        path = work / role
        if a.reuse and (path / "config.json").exists():  # save_model writes a directory atomically
            made[role] = path
        else:
            made[role] = make_model_dir(preset, path, tok_dir, seed)
    t_dir, s_dir = made["teacher"], made["student"]
    if a.make_only:
        print(f"model dirs in {work} after {time.time() - t0:.0f} s", flush=True)
        return
    print(f"random-weight model dirs written in {time.time() - t0:.0f} s", flush=True)
    results = []
    for i, nproc in enumerate(n for n in settings for _ in range(a.runs)):
        batch = a.per_gpu_batch * nproc if a.per_gpu_batch else a.batch
        run_dir = work / f"run{i}"
        launcher = [sys.executable, "-m", "kdistill"]
        if nproc > 1:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={nproc}", "-m", "kdistill"]  # fmt: skip
        cmd = [
            *launcher,
            "run",
            "--overwrite",
            "--quiet",
            f"teacher.path={t_dir}",
            f"student.path={s_dir}",
            "student.init=pretrained",
            "data.train=stdlib:train",
            "data.heldout=stdlib:heldout",
            f"data.seq_len={a.seq_len}",
            f"schedule.batch_size={batch}",
            f"schedule.steps={a.steps}",
            "schedule.eval_every=0",
            "schedule.eval_batches=2",
            "schedule.checkpoint_every=0",
            "runtime.strict_kernels=true",
            f"output.dir={run_dir}",
            *a.extra,
        ]
        # The GPU hosts this check runs on keep NVLink multicast (NVLS) off; NCCL would otherwise try it.
        env = {**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
        t0 = time.time()
        log_path = out / f"run{i}.log"
        with open(log_path, "w") as log:  # streamed, so a killed call still leaves the log
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        wall = time.time() - t0
        text = log_path.read_text()
        print(f"run {i} ({nproc} GPU, batch {batch}): exit {proc.returncode} in {wall:.0f} s", flush=True)
        if proc.returncode != 0:
            print(text[-3000:])
            results.append({"run": i, "nproc": nproc, "exit": proc.returncode})
            continue
        summary = json.loads((run_dir / "summary.json").read_text())
        summary["run"] = i
        summary["nproc"] = nproc
        summary["batch"] = batch
        summary["command"] = " ".join(["python3", *cmd[1:]])  # the interpreter by name, not by path
        summary["wall_s"] = wall
        results.append(summary)
        for f in sorted((run_dir / "profile").glob("rank*.*")):  # runtime.profile_steps: kept beside the logs
            (out / f"run{i}_profile_{f.name}").write_bytes(f.read_bytes())
        pw = summary.get("kernels", {}).get("prewarm", {})
        pw.pop("cache_dir", None)  # a path of the machine that ran it, not a result
        print(
            f"  prewarm: {pw.get('compiled', 0)} compiled, {pw.get('from_cache', 0)} cached, "
            f"{pw.get('from_pack', 0)} from a pack, {pw.get('library', 0)} library, {pw.get('seconds', 0)} s"
        )
    (out / "results.json").write_text(
        json.dumps(
            {
                "pair": a.pair,
                "device": torch.cuda.get_device_name(),
                "seq_len": a.seq_len,
                "batch": a.batch,
                "per_gpu_batch": a.per_gpu_batch,
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d"),
                "results": results,
            },
            indent=2,
        )
    )
    one = [r.get("tokens_per_s_steady") or 0 for r in results if r.get("nproc") == 1 and "status" in r]
    base = max(one) if one else 0
    print(
        f"{'run':>4} {'gpus':>4} {'speedup':>7} {'jit_after':>9} {'compiled':>8} {'cached':>6} {'prewarm_s':>9} {'tok/s':>9} {'steady':>9} "
        f"{'peak_GiB':>8} {'plan_GiB':>8} {'loss0':>7} {'lossN':>7}"
    )
    for r in results:
        if "status" not in r:
            continue
        pw = r.get("kernels", {}).get("prewarm", {})
        steady = r.get("tokens_per_s_steady") or 0
        speedup = f"{steady / base:.2f}" if base else "-"
        print(
            f"{r['run']:>4} {r['nproc']:>4} {speedup:>7} {r['jit_after_prewarm']:>9} {pw.get('compiled', '-'):>8} {pw.get('from_cache', '-'):>6} "
            f"{pw.get('seconds', 0):>9.1f} {r['tokens_per_s']:>9.0f} {r.get('tokens_per_s_steady') or 0:>9.0f} "
            f"{r.get('peak_memory_gib', 0):>8.2f} "
            f"{r.get('planned_memory_gib', 0):>8.2f} {r['initial_loss']:>7.3f} {r['final_loss']:>7.3f}"
        )


if __name__ == "__main__":
    main()
