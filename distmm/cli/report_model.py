"""``distmm report``'s model section: predicted against measured time.

This module covers: the records that carry a prediction (``predicted_seconds``, as
``distmm model --validate -o`` writes them), their relative errors (``model_rows``), the table
of them and the log-log scatter of measured against predicted time with the y = x line and the
+/-15% band (``draw_predicted``).
It does *not* cover: the model itself (``distmm.plan_model``), making predictions
(``distmm model``), or reading the record files (``distmm.cli.report``).

The rules, in one place:

- A record with a numeric ``predicted_seconds`` and a positive ``seconds`` is a comparison:
  its error is ``(predicted_seconds - seconds) / seconds``, computed here from the two values
  (the record's own ``error`` key is not read).
- A record with ``predicted_seconds`` and ``seconds`` null is a **prediction**, never a
  measurement (it may say ``role: "predicted"``); the table shows it with no measured time and
  the word ``predicted``. ``distmm.cli.report`` draws such a point into a scaling series,
  labelled "predicted", where one exists.
- ``role`` says how a comparison was made (``fit``: the model's fixed costs were fitted on it;
  ``held-out``: it was not); a record without one is ``unlabelled``. Held-out points are drawn
  apart from fitted ones.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BAND", "ModelRow", "model_rows", "is_prediction", "model_table", "draw_predicted"]

#: the half-width of the band drawn around y = x (the model's target, issue 26)
BAND = 0.15


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_prediction(record: dict) -> bool:
    """Whether ``record`` is a prediction only: ``predicted_seconds`` and no measured
    ``seconds``."""
    return _number(record.get("predicted_seconds")) and record.get("seconds") is None


@dataclass(frozen=True)
class ModelRow:
    """One record with a prediction: ``measured`` and ``error`` are None for a prediction."""
    record: dict
    measured: float | None
    predicted: float
    error: float | None
    role: str

    @property
    def configuration(self) -> str:
        r = self.record
        return f"{r['variant']} on {r['device']}"


def model_rows(records: list[dict]) -> list[ModelRow]:
    """Every record with a prediction, comparisons first (by device, variant, dtype, size),
    then predictions.

    Examples
    --------
    >>> recs = [dict(variant="v", device="d", dtype="float32", m=2, n=2, k=2, seconds=2.0,
    ...              predicted_seconds=2.5, role="held-out"),
    ...         dict(variant="v@8gpu", device="d", dtype="float32", m=2, n=2, k=2,
    ...              seconds=None, predicted_seconds=0.5, role="predicted")]
    >>> [(r.error, r.role) for r in model_rows(recs)]
    [(0.25, 'held-out'), (None, 'predicted')]
    """
    rows = []
    for r in records:
        if not _number(r.get("predicted_seconds")) or r["predicted_seconds"] <= 0:
            continue
        predicted = float(r["predicted_seconds"])
        if is_prediction(r):
            rows.append(ModelRow(r, None, predicted, None, "predicted"))
        elif _number(r.get("seconds")) and r["seconds"] > 0:
            measured = float(r["seconds"])
            rows.append(ModelRow(r, measured, predicted, (predicted - measured) / measured,
                                 str(r.get("role") or "unlabelled")))

    def order(row):
        r = row.record
        return (row.measured is None, r["device"], r["variant"], r["dtype"], int(r["m"]),
                int(r["n"]), int(r["k"]))

    return sorted(rows, key=order)


def model_table(rows: list[ModelRow]) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)`` of the predicted-against-measured table."""
    header = ["configuration", "device", "dtype", "m x n x k", "measured s", "predicted s",
              "error", "role"]
    out = []
    for row in rows:
        r = row.record
        out.append([r["variant"], r["device"], r["dtype"], f'{r["m"]}x{r["n"]}x{r["k"]}',
                    "-" if row.measured is None else f"{row.measured:.4g}",
                    f"{row.predicted:.4g}" + (" (predicted)" if row.measured is None else ""),
                    "-" if row.error is None else f"{row.error:+.1%}", row.role])
    return header, out


_ROLE_STYLE = {"held-out": dict(marker="o", color="tab:blue"),
               "fit": dict(marker="s", color="tab:orange"),
               "unlabelled": dict(marker="^", color="tab:gray")}


def draw_predicted(plt, rows: list[ModelRow], path) -> None:
    """Measured against predicted seconds, log-log, one marker per role, the y = x line and
    the +/-``BAND`` band; the count within the band per role in the legend."""
    compared = [row for row in rows if row.measured is not None]
    fig, ax = plt.subplots(figsize=(7, 6), dpi=90)
    values = [v for row in compared for v in (row.measured, row.predicted)]
    lo, hi = min(values) / 2, max(values) * 2
    ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="measured = predicted")
    ax.fill_between([lo, hi], [lo * (1 - BAND), hi * (1 - BAND)],
                    [lo * (1 + BAND), hi * (1 + BAND)], color="0.85", label=f"within {BAND:.0%}")
    for role in sorted({row.role for row in compared}, key=lambda r: (r != "held-out", r)):
        group = [row for row in compared if row.role == role]
        inside = sum(abs(row.error) <= BAND for row in group)
        style = _ROLE_STYLE.get(role, dict(marker="D", color="tab:green"))
        ax.scatter([row.predicted for row in group], [row.measured for row in group], s=22,
                   zorder=3, edgecolor="black", linewidth=0.4,
                   label=f"{role}: {inside} of {len(group)} within {BAND:.0%}", **style)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi),
           xlabel="predicted seconds (distmm model)", ylabel="measured seconds",
           title="Performance model: measured against predicted")
    ax.grid(True, which="major", alpha=0.25)
    ax.legend(fontsize=8, loc="upper left")
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
