"""benchmarks/plot_scaling.py: onpolicy_bench.py's JSON files drawn as weak scaling, the table it
prints, and its one-line refusals."""

from __future__ import annotations

import json

from benchmarks import plot_scaling


def _bench(path, rows):
    """An onpolicy_bench.py result holding kdistill rows {world: (tokens/s, update s per rank)}."""
    results = {
        str(w): {
            "completion_tokens_per_s": tps,
            "phase_s_per_rank": {"generate": [0.1] * w, "score": [0.02] * w, "update": [upd] * w},
        }
        for w, (tps, upd) in rows.items()
    }
    path.write_text(json.dumps({"results": {"kdistill": results}}))
    return path


def test_series_scale_against_their_one_gpu_run_and_the_picture_is_written(tmp_path, capsys):
    _bench(tmp_path / "a_1.json", {1: (1000.0, 0.1)})
    _bench(tmp_path / "a_2.json", {2: (1900.0, 0.12), 4: (3600.0, 0.15)})
    _bench(tmp_path / "b.json", {2: (1500.0, 0.2)})  # no one-GPU run: against the first series'
    out = tmp_path / "s.png"
    rc = plot_scaling.main([f"a={tmp_path}/a_*.json", f"b={tmp_path}/b.json", "--out", str(out)])
    assert rc == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary file left
    rows = plot_scaling.table(
        [plot_scaling.load_series(f"a={tmp_path}/a_*.json"), plot_scaling.load_series(f"b={tmp_path}/b.json")]
    )
    assert [(r["series"], r["gpus"], round(r["scaling"], 2)) for r in rows] == [
        ("a", 1, 1.0),
        ("a", 2, 1.9),
        ("a", 4, 3.6),
        ("b", 2, 1.5),
    ]
    assert rows[2]["update"] == 0.15 and rows[2]["generate"] == 0.1
    assert "3.60x" in capsys.readouterr().out


def test_bad_series_are_one_line_refusals(tmp_path, capsys):
    _bench(tmp_path / "x.json", {1: (1000.0, 0.1), 2: (1900.0, 0.1)})
    _bench(tmp_path / "y.json", {2: (1800.0, 0.1)})
    (tmp_path / "broken.json").write_text('{"results": ')
    cases = [
        ([f"{tmp_path}/x.json"], "expected LABEL=FILES"),
        ([f"a={tmp_path}/none_*.json"], "no file matches"),
        ([f"a={tmp_path}/broken.json"], "not an onpolicy_bench.py result"),
        ([f"a={tmp_path}/[xy].json"], "world size 2 is already in series 'a'"),
        ([f"a={tmp_path}/y.json"], "no one-GPU run to scale against"),
    ]
    for argv, message in cases:
        out = tmp_path / "never.png"
        assert plot_scaling.main([*argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("plot_scaling: ") and message in err[0], err
        assert not out.exists()
