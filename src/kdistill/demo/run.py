"""The embedded default (`kdistill run` with no CONFIG): a KD student and a CE-only student, then a
held-out table.

    run_demo(["schedule.steps=50"])      # overrides apply to demo.yaml

Both students train with the same config (the baseline with kd.alpha=0, in RUN_DIR/baseline_ce) and
are compared on the held-out stdlib files: summary.json gains the comparison, comparison.png the curves,
and `draft_alpha`: each student's greedy acceptance rate as the teacher's draft model (its run's `draft`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kdistill.config import load_config
from kdistill.console import print_json
from kdistill.demo import DEMO_YAML
from kdistill.fileio import atomic_write_json
from kdistill.train.corpus import expand_data_paths
from kdistill.train.evidence import plot_comparison
from kdistill.train.preflight import resolve_device
from kdistill.train.recipe import train
from kdistill.train.rundir import prepare_output, print_config, start_run_dir


def run_demo(overrides: list[str], quiet: bool = False, as_json: bool = False) -> int:
    """The embedded default: KD student and CE-only student on the stdlib, then a held-out table."""
    cfg = load_config(DEMO_YAML, overrides).validate()
    run_dir = Path(cfg.output.dir)
    prepare_output(run_dir, overwrite=True, lock=False)  # the demo always starts afresh
    print_config(cfg, quiet)
    device, _ = resolve_device(cfg)
    start_run_dir(cfg, run_dir, str(device))
    kd_summary = train(cfg, run_dir, quiet=quiet, label="KD student")
    base_cfg = dataclasses.replace(
        cfg,
        kd=dataclasses.replace(cfg.kd, alpha=0.0),
        output=dataclasses.replace(cfg.output, dir=str(run_dir / "baseline_ce")),
    )
    base_dir = run_dir / "baseline_ce"
    prepare_output(base_dir, overwrite=True, lock=False)
    start_run_dir(base_cfg, base_dir, str(device))
    base_summary = train(base_cfg, base_dir, quiet=quiet, label="CE-only student")
    # The KD run's student_loss, teacher_loss and kl_to_teacher, plus the CE-only student's.
    heldout = kd_summary["heldout"]
    heldout["baseline_ce_loss"] = base_summary["heldout"]["student_loss"]
    heldout["baseline_ce_kl_to_teacher"] = base_summary["heldout"].get("kl_to_teacher")
    kd_summary["baseline_ce"] = {
        k: base_summary[k] for k in ("initial_loss", "final_loss", "steps", "smoke_passed")
    }
    kd_summary["kd_beats_baseline"] = heldout["student_loss"] < heldout["baseline_ce_loss"]
    # each student as the teacher's draft model: greedy acceptance (kdistill.acceptance.run_acceptance)
    kd_summary["draft_alpha"] = {
        name: (s.get("draft") or {}).get("alpha")
        for name, s in (("kd_student", kd_summary), ("baseline_ce", base_summary))
    }
    atomic_write_json(run_dir / "summary.json", kd_summary)
    plot_comparison(
        {"KD student": run_dir, "CE-only student": base_dir},
        run_dir / "comparison.png",
        "held-out loss on the stdlib: KD vs hard labels only",
    )
    if as_json:
        print_json(kd_summary)
    else:
        print()
        print(f"held-out loss (nats/token) on {len(expand_data_paths(cfg.data.heldout))} stdlib files:")
        print(f"  {'teacher':28s}{heldout['teacher_loss']:8.4f}")
        print(f"  {'KD student':28s}{heldout['student_loss']:8.4f}")
        print(f"  {'CE-only student (alpha=0)':28s}{heldout['baseline_ce_loss']:8.4f}")
        alpha = kd_summary["draft_alpha"]
        if all(v is not None for v in alpha.values()):
            k = kd_summary["draft"]["draft_tokens"]
            print(
                f"as the teacher's draft model (greedy, K = {k}), draft tokens accepted: KD student "
                f"{alpha['kd_student']:.3f}, CE-only student {alpha['baseline_ce']:.3f}"
            )
        verdict = "beats" if kd_summary["kd_beats_baseline"] else "does NOT beat"
        print(
            f"KD student {verdict} the CE-only student by {heldout['baseline_ce_loss'] - heldout['student_loss']:+.4f} nats; "
            f"run in {run_dir}/ (summary.json, loss.png, comparison.png, student/)"
        )
    return 0
