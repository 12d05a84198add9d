"""Experiment trackers: TensorBoard, Weights & Biases and MLflow, behind one small object.

    trackers = open_trackers(["tensorboard", "wandb"], run_dir, config=resolved_config, run_name="run-1")
    trackers.log(step, {"train/loss": 2.31, "train/lr": 3e-4, "perf/tokens_per_s": 51200.0})
    trackers.log_text(step, "samples", [{"prompt": "Hi", "completion": "Hello!"}])
    trackers.close()

Where each writes:
- `tensorboard`: event files under `run_dir/tensorboard` (`tensorboard --logdir run_dir/tensorboard`);
  the config as HParams of that same run, generations as markdown tables in the Text tab.
- `wandb`: `wandb.init(dir=run_dir)`, so the run directory is `run_dir/wandb/<run>`; the mode comes from
  `WANDB_MODE` (`offline` writes locally, `wandb sync` uploads later), the project from `WANDB_PROJECT`
  (default `kdistill`); generations as a `wandb.Table`.
- `mlflow`: `MLFLOW_TRACKING_URI`, else the file store `run_dir/mlruns` (`mlflow ui --backend-store-uri
  run_dir/mlruns`); experiment `MLFLOW_EXPERIMENT_NAME` (default `kdistill`); generations as JSON
  artifacts `<key>/step_<step>.json`.

The resolved config is logged as hyperparameters with flattened `section.field` keys (W&B gets the
nested dict, which its UI shows under the same dotted names). Non-finite or non-numeric scalars are
skipped. A tracker that raises mid-run is reported once (a `TrackerWarning` and a log line) and
disabled: a tracker never ends a run. Asking for an unknown tracker, or one whose package is not
installed, is a one-line `UserError` naming the extra to install. Open trackers on one process only
(rank 0) in a distributed run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kdistill.config import TRACKERS
from kdistill.errors import UserError

log = logging.getLogger(__name__)

FIELD = "output.report_to"

Rows = Sequence[Mapping[str, Any]]


class TrackerWarning(UserWarning):
    """A tracker failed during the run and was disabled; the run goes on."""


# -- helpers shared by the backends -------------------------------------------------------------------


def jsonable(value: Any) -> Any:
    """A copy of `value` made of dicts, lists, str, int, float, bool and None (Paths and others as str)."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """Nested config to `section.field` keys; lists and None become their JSON text.

    >>> flatten_config({"kd": {"alpha": 0.5, "divergence": "fkl"}, "data": {"paths": ["a", "b"]}})
    {'kd.alpha': 0.5, 'kd.divergence': 'fkl', 'data.paths': '["a", "b"]'}
    """
    out: dict[str, str | int | float | bool] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten_config(v, key + "."))
        elif isinstance(v, bool | int | float | str):
            out[key] = v
        else:
            out[key] = json.dumps(jsonable(v))
    return out


def finite_scalars(scalars: Mapping[str, Any]) -> dict[str, float]:
    """The entries that are finite numbers, as floats (NaN, inf, strings and None are dropped)."""
    out: dict[str, float] = {}
    for k, v in scalars.items():
        try:
            x = float(v)
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of more than one element
            continue
        if math.isfinite(x):
            out[str(k)] = x
    return out


def table(rows: Rows) -> tuple[list[str], list[list[str]]]:
    """(columns, cell texts): columns in first-seen order over all rows, missing cells empty."""
    columns: list[str] = []
    for row in rows:
        columns += [str(c) for c in row if str(c) not in columns]
    data = [
        [_cell(row.get(c, "")) for c in columns] for row in ({str(k): v for k, v in r.items()} for r in rows)
    ]
    return columns, data


def _cell(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(jsonable(v))


def markdown_table(rows: Rows) -> str:
    """Rows as a markdown table (pipes escaped, newlines as <br>), for TensorBoard's Text tab."""
    columns, data = table(rows)
    if not columns:
        return "(no rows)"

    def esc(s: str) -> str:
        return s.replace("|", "\\|").replace("\r\n", "\n").replace("\n", "<br>")

    lines = ["| " + " | ".join(esc(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in data]
    return "\n".join(lines)


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")[:300]


def _missing(name: str, package: str) -> UserError:
    return UserError(
        f"{FIELD}: tracker '{name}' needs the {package} package, which is not installed: "
        f"pip install 'kdistill[{name}]'"
    )


# -- the backends -------------------------------------------------------------------------------------


class _TensorBoard:
    name = "tensorboard"

    @staticmethod
    def require() -> None:
        try:
            import tensorboard  # noqa: F401
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            raise _missing("tensorboard", "tensorboard") from None

    def __init__(self, run_dir: Path, config: dict[str, Any], run_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.where = str(run_dir / "tensorboard")
        self.writer = SummaryWriter(log_dir=self.where)
        # HParams of this very run (SummaryWriter.add_hparams would open a second, timestamped run).
        for summary in hparams(flatten_config(config), {}):
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("run_name", run_name, 0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)

    def log_text(self, step: int, key: str, rows: Rows) -> None:
        self.writer.add_text(key, markdown_table(rows), step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


class _WandB:
    name = "wandb"

    @staticmethod
    def require() -> None:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise _missing("wandb", "wandb") from None

    def __init__(self, run_dir: Path, config: dict[str, Any], run_name: str) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            dir=str(run_dir),
            project=os.environ.get("WANDB_PROJECT") or "kdistill",
            name=run_name,
            config=jsonable(config),
        )
        self.where = str(getattr(self.run, "dir", run_dir / "wandb"))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def log_text(self, step: int, key: str, rows: Rows) -> None:
        columns, data = table(rows)
        self.run.log({key: self.wandb.Table(columns=columns, data=data)}, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)
        # finish() can return before the service has written the run file; teardown waits for it.
        # Skipped while the process has another wandb run of its own.
        if getattr(self.wandb, "run", None) is None:
            self.wandb.teardown()


class _MLflow:
    name = "mlflow"
    _BAD_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")

    @staticmethod
    def require() -> None:
        try:
            import mlflow  # noqa: F401
        except ImportError:
            raise _missing("mlflow", "mlflow") from None

    def __init__(self, run_dir: Path, config: dict[str, Any], run_name: str) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 refuses the file store unless asked; a local run directory is what we want here.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "kdistill"
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        self.where = f"{uri} (run {self.run_id})"
        params = [Param(self.key(k), str(v)[:6000]) for k, v in flatten_config(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def key(self, k: str) -> str:
        return self._BAD_KEY.sub("_", k)[:250]

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(self.key(k), v, now, step) for k, v in scalars.items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def log_text(self, step: int, key: str, rows: Rows) -> None:
        columns, data = table(rows)
        text = json.dumps({"step": step, "columns": columns, "data": data}, ensure_ascii=False, indent=1)
        self.client.log_text(self.run_id, text, f"{self.key(key)}/step_{step:08d}.json")

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


_BACKENDS = {b.name: b for b in (_TensorBoard, _WandB, _MLflow)}


# -- the public object --------------------------------------------------------------------------------


class Trackers:
    """The open trackers of a run. Every method is safe to call with none open.

    Attributes:
        where: tracker name -> where it writes (a directory, or a tracking URI and run id).
    """

    def __init__(self, backends: Sequence[Any] = ()) -> None:
        self._active: list[Any] = list(backends)
        self.where: dict[str, str] = {b.name: str(b.where) for b in self._active}
        self._closed = False

    @property
    def names(self) -> list[str]:
        """The trackers still active (a failed one drops out)."""
        return [b.name for b in self._active]

    def log(self, step: int, scalars: Mapping[str, Any]) -> None:
        """Log the finite numeric scalars of `scalars` at `step` (others are skipped)."""
        values = finite_scalars(scalars)
        if values:
            self._each("log", int(step), values)

    def log_text(self, step: int, key: str, rows: Rows) -> None:
        """Log rows of text (e.g. sample generations: [{"prompt": ..., "completion": ...}]) as a table."""
        self._each("log_text", int(step), str(key), list(rows))

    def close(self, failed: bool = False) -> None:
        """Finish every tracker (idempotent); `failed` marks the run failed where the tracker can."""
        if self._closed:
            return
        self._closed = True
        backends, self._active = self._active, []
        for b in backends:
            try:
                b.close(failed)
            except Exception as exc:  # noqa: BLE001 - closing a tracker never ends a run either
                self._warn(b.name, "close", exc)

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(failed=exc_type is not None)

    def _each(self, method: str, *args: Any) -> None:
        for b in list(self._active):
            try:
                getattr(b, method)(*args)
            except Exception as exc:  # noqa: BLE001 - a tracker never ends a run
                self._active.remove(b)
                self._warn(b.name, method, exc)
                try:
                    b.close(True)
                except Exception:  # noqa: BLE001, S110 - already reported; the tracker is broken
                    pass

    @staticmethod
    def _warn(name: str, method: str, exc: BaseException) -> None:
        msg = (
            f"tracker {name} failed in {method} ({_first_line(exc)}); it is disabled for the rest of the run"
        )
        log.warning(msg)
        warnings.warn(msg, TrackerWarning, stacklevel=4)


def check_tracker_names(names: Sequence[str]) -> list[str]:
    """The tracker names, checked and without repeats (order kept); a bad name is a one-line UserError."""
    if isinstance(names, str):
        names = [names]
    out: list[str] = []
    for n in names:
        name = str(n).strip().lower()
        if name not in TRACKERS:
            raise UserError(f"{FIELD}: unknown tracker {n!r}, expected a list of {', '.join(TRACKERS)}")
        if name not in out:
            out.append(name)
    return out


def open_trackers(names: Sequence[str], run_dir: Path, config: Mapping[str, Any], run_name: str) -> Trackers:
    """Open the named trackers for a run.

    Args:
        names: tracker names from `output.report_to` (tensorboard, wandb, mlflow); empty for none.
        run_dir: the run directory; each tracker writes under it (see the module docstring).
        config: the resolved run config as a nested dict, logged as hyperparameters.
        run_name: the run's name in the trackers' UIs.

    Returns:
        Trackers: `.log(step, scalars)`, `.log_text(step, key, rows)`, `.close()`.

    Raises:
        UserError: (one line) an unknown name; a tracker whose package is not installed (naming the
            extra, e.g. `pip install 'kdistill[wandb]'`); a tracker that cannot start.
    """
    wanted = check_tracker_names(names)
    for name in wanted:  # every package first, so that nothing is half open when one is missing
        _BACKENDS[name].require()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    opened: list[Any] = []
    for name in wanted:
        try:
            opened.append(_BACKENDS[name](run_dir, dict(config), str(run_name)))
        except Exception as exc:
            Trackers(opened).close(failed=True)
            raise UserError(f"{FIELD}: tracker '{name}' could not start: {_first_line(exc)}") from exc
    return Trackers(opened)
