"""``distmm report``: plots and tables made from benchmark record files.

This module covers: reading benchmark records (JSON lines, ``docs/performance.md``
§ Records) and ``distmm-profile-1`` profiles (``.json``); the pure computations on them
(grouping, strong and weak scaling, shares of a same-run reference, timeline rows); and
writing ``report.md``, ``index.html`` and matplotlib PNGs into a new folder, staged in a
temporary folder beside it and renamed into place only when complete.
It does *not* cover: running benchmarks (``bench/``) or recording profiles
(``distmm.phases``).

The rules, in one place:

- **count**: the first of ``ranks``, ``gpus``, ``workers`` a record has (else 1).
- **family**: the variant with its count token removed (``mpirun-4-h5`` at 4 ranks is
  ``mpirun-h5``; ``distmm-dask@2gpu`` at 2 GPUs is ``distmm-dask``), so that one
  configuration measured at several counts forms one series.
- **strong scaling**: records of one ``run``, ``benchmark``, ``device``, ``dtype``, size
  and family at two or more counts. **Weak scaling**: the same without the size, where
  each count has one size and the size grows with the count; records with a ``per_device``
  (``distmm bench``'s weak series: C's side per device, ``k`` fixed) form one series per
  side and ``k``, and a prediction joins the series whose side and ``k`` its size fits.
  In both, a count's seconds are the median of its records; speedup is TFLOP/s over the
  smallest count's TFLOP/s (for strong scaling the time ratio) and efficiency is speedup *
  smallest count / count.
- **emulated nodes**: a record with ``emulated_nodes`` (a count, or ``"all-links"``) was
  measured on nodes emulated on one host (``distmm.emulate``); its family, its rows and
  its lines say so (``emulated_label``: ``[emulated nodes: 2]``).
- **reference**: a variant named ``cublas``, ``numpy``, ``dask.array``, ``read-cat`` or
  ``write-dd`` (the storage ceilings of ``mpi-batch``), alone or followed by ``-``, ``@`` or ``.`` (``cublas-incore``,
  ``dask.array-chunk8192@2gpu``). A record's share of a reference is reference seconds /
  its seconds (its TFLOP/s over the reference's; above 1 it was faster), for every
  reference of the same ``run``, ``benchmark``, ``device``, ``dtype``, ``m``, ``n``, ``k``
  (two machines that started a study in the same second share a ``run``); the report's
  notes count the records that have none.
- **model records**: a record with ``predicted_seconds`` feeds only the model section
  (``distmm.cli.report_model``); its measured ``seconds`` restate a record of another file
  (its ``source``), so it is kept out of the TFLOP/s, scaling and share figures. A prediction
  (``seconds`` null) joins the scaling series of its family at its count where that count was
  not measured, drawn hollow and labelled "predicted" in the figure and the table.
- **invalid records**: a record whose ``invalid`` says why its figure is not to be used (a
  kernel later found wrong, say) stays in its file for the history and is left out of every
  section; the report's notes count them. So is a record whose product failed its float64
  check (``relerr_ok`` false, as ``distmm bench`` writes it): its time is that of a wrong
  result.
- **a study's records** (``distmm bench``'s, with a ``study``): one whose count is not the
  one its variant names (``@2ranks`` without ``ranks: 2``), a configuration twice in one
  run, or one run on two ``host`` names is refused, naming its line: its times would be
  tabulated at another count or taken together with another machine's.
- **a cut last line**: a records file whose last line has no newline and is not JSON (a
  run killed mid-record) is read without it, with a warning and a note naming its line.
- **roofline**: one PNG per device with measured ceilings (``distmm.cli.report_roofline``;
  numpy's rate is a CPU's ceiling, never a GPU's); a device without them, and the runs of
  an arithmetic without a compute ceiling on their device (no roof), are named in the
  report's notes.
"""
from __future__ import annotations

import html
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from distmm.cli.records import REQUIRED, json_file, read_records
from distmm.cli.report_rules import (REFERENCES, arithmetic, count_of, emulated_label, family,
                                     is_reference)
from distmm.errors import OutputExists
from distmm.staging import remove_tree

__all__ = ["REFERENCES", "REQUIRED", "SECTIONS", "count_of", "emulated_label", "family",
           "is_reference", "scaling",
           "reference_shares", "timeline_rows", "read_inputs", "add_options", "run_report"]

#: what ``--only`` may name: the report's figures and tables, by kind
SECTIONS = ("tflops", "strong", "weak", "shares", "timeline", "roofline", "model")
INSTALL = 'distmm report needs matplotlib: pip install "distmm[bench]"'


# ---------------------------------------------------------------- pure computations


def _flops(record: dict) -> int:
    return 2 * int(record["m"]) * int(record["n"]) * int(record["k"])


@dataclass(frozen=True)
class Point:
    """One count of a scaling series; ``size`` is ``(m, n, k)``."""
    count: int
    size: tuple[int, int, int]
    seconds: float
    speedup: float
    efficiency: float
    predicted: bool = False


@dataclass(frozen=True)
class Series:
    """A scaling series: ``kind`` is ``"strong"`` or ``"weak"``; points by count."""
    kind: str
    run: str
    benchmark: str
    device: str
    dtype: str
    family: str
    count_key: str
    points: tuple[Point, ...]

    @property
    def label(self) -> str:
        size = "x".join(map(str, self.points[0].size))
        return f"{self.family} {self.dtype} {'' if self.kind == 'strong' else 'weak from '}" \
               f"{size} run {self.run}"


def scaling(records: list[dict], kind: str) -> list[Series]:
    """The strong (``kind="strong"``) or weak (``"weak"``) scaling series in ``records``.

    Parameters
    ----------
    records : list of dict
        Benchmark records with the ``REQUIRED`` keys.
    kind : {"strong", "weak"}

    Returns
    -------
    list of Series
        Sorted by benchmark, device, dtype, family and run; each with two counts or more.

    Examples
    --------
    >>> recs = [dict(run="r", benchmark="b", variant=f"v-{p}", device="d", dtype="float64",
    ...              m=8, n=8, k=8, seconds=4.0 / p, ranks=p) for p in (1, 2)]
    >>> [p.speedup for p in scaling(recs, "strong")[0].points]
    [1.0, 2.0]
    """
    if kind not in ("strong", "weak"):
        raise ValueError(f"kind must be 'strong' or 'weak', got {kind!r}")
    from distmm.cli.report_model import is_prediction

    groups: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    forecasts: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        key, count = count_of(r)
        predicted = is_prediction(r)
        if _flops(r) == 0 or (not predicted and ("predicted_seconds" in r or not r["seconds"]
                                                 or r["seconds"] <= 0)):
            continue
        size = (int(r["m"]), int(r["n"]), int(r["k"]))
        group = (r["benchmark"], r["device"], arithmetic(r),
                 family(r["variant"], count) + emulated_label(r),
                 str(r["run"]), key)
        if predicted:  # a prediction joins the series of every run of its family
            group = group[:4] + (None, key)
        if kind == "strong":
            group += (size,)
        elif not predicted:  # a weak series of distmm bench: one per side and k
            side = r.get("per_device")
            group += (None if side is None else (int(side), size[2]),)
        (forecasts if predicted else groups)[group][count].append(r)
    out = []
    for group, measured in groups.items():
        loose = group[:4] + (None,) + group[5:(7 if kind == "strong" else 6)]
        by_count = {c: (rs, False) for c, rs in measured.items()}
        base = min(by_count)
        for c, rs in forecasts.get(loose, {}).items():
            if kind == "weak" and group[6] is not None:  # the predictions of its side and k
                side, k = group[6]
                rs = [r for r in rs if int(r["m"]) * int(r["n"]) == c * side * side
                      and int(r["k"]) == k]
            if rs and c > base and c not in by_count:
                by_count[c] = (rs, True)
        if len(by_count) < 2:
            continue
        counts = sorted(by_count)
        sizes = [{(int(r["m"]), int(r["n"]), int(r["k"])) for r in by_count[c][0]} for c in counts]
        if kind == "weak":
            flops = [2 * a * b * c for s in sizes for a, b, c in s]
            if any(len(s) != 1 for s in sizes) or any(x >= y for x, y in zip(flops, flops[1:])):
                continue
        sizes = [min(s) for s in sizes]
        seconds = [statistics.median(r["predicted_seconds"] if forecast else r["seconds"]
                                     for r in rs) for rs, forecast in (by_count[c] for c in counts)]
        rates = [2 * s[0] * s[1] * s[2] / t for s, t in zip(sizes, seconds)]
        points = tuple(Point(c, s, t, rate / rates[0], rate / rates[0] * counts[0] / c,
                             by_count[c][1])
                       for c, s, t, rate in zip(counts, sizes, seconds, rates))
        bench, device, dtype, fam, run, key = group[:6]
        out.append(Series(kind, run, bench, device, dtype, fam, key, points))
    return sorted(out, key=lambda s: (s.benchmark, s.device, s.dtype, s.family, s.run,
                                      s.points[0].size))


@dataclass(frozen=True)
class Share:
    """``record`` against ``reference`` of the same run and problem: ``share`` is
    reference seconds / record seconds."""
    record: dict
    reference: str
    reference_seconds: float
    share: float


def reference_shares(records: list[dict]) -> list[Share]:
    """Every non-reference record against every reference of its run, device and problem.

    A reference measured several times in one run counts with its median seconds.
    Returns the shares in the order of ``records``, then by reference name.

    Examples
    --------
    >>> recs = [dict(run="r", benchmark="b", variant=v, dtype="float32", m=2, n=2, k=2,
    ...              seconds=s) for v, s in (("cublas", 1.0), ("distmm-mpi", 2.0))]
    >>> [(s.reference, s.share) for s in reference_shares(recs)]
    [('cublas', 0.5)]
    """
    def problem(r):
        return (str(r["run"]), r["benchmark"], r.get("device"), arithmetic(r), int(r["m"]),
                int(r["n"]), int(r["k"]))

    records = [r for r in records if "predicted_seconds" not in r]  # model records restate
    refs: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if is_reference(r["variant"]) and r["seconds"] and r["seconds"] > 0:
            refs[problem(r)][r["variant"]].append(r["seconds"])
    out = []
    for r in records:
        if is_reference(r["variant"]) or not r["seconds"] or r["seconds"] <= 0:
            continue
        for name, times in sorted(refs.get(problem(r), {}).items()):
            ref = statistics.median(times)
            out.append(Share(r, name, ref, ref / r["seconds"]))
    return out


def timeline_rows(profile: dict) -> list[tuple[int, list[tuple[str, float, float]]]]:
    """``(rank, [(phase, start, end), ...])`` per rank of a ``distmm-profile-1`` profile,
    by rank, spans by start."""
    rows = []
    for entry in profile["ranks"]:
        spans = sorted((s["phase"], float(s["start"]), float(s["end"])) for s in entry["spans"])
        rows.append((int(entry["rank"]), sorted(spans, key=lambda s: s[1])))
    return sorted(rows)


# ---------------------------------------------------------------- tables


def _tables(records, strong, weak, shares, roofs,
            model) -> list[tuple[str, list[str], list[list[str]]]]:
    """``(title, header, rows)`` of every table of the report."""
    from distmm.cli.report_model import model_table
    from distmm.cli.report_roofline import ceiling_rows, point_rows, roofline_points

    tables = []
    for title, series in (("Strong scaling", strong), ("Weak scaling", weak)):
        rows = [[s.benchmark, s.device, s.run, s.family, s.dtype, "x".join(map(str, p.size)),
                 f"{s.count_key} {p.count}",
                 f"{p.seconds:.4g}" + (" (predicted)" if p.predicted else ""),
                 f"{p.speedup:.2f}", f"{p.efficiency:.1%}"] for s in series for p in s.points]
        if rows:
            tables.append((title, ["benchmark", "device", "run", "family", "dtype", "m x n x k",
                                   "count", "seconds", "speedup", "efficiency"], rows))
    rows = [[s.record["benchmark"], s.record["device"], str(s.record["run"]),
             arithmetic(s.record),
             f'{s.record["m"]}x{s.record["n"]}x{s.record["k"]}',
             s.record["variant"] + emulated_label(s.record),
             "{} {}".format(*count_of(s.record)), f'{s.record["seconds"]:.4g}', s.reference,
             f"{s.reference_seconds:.4g}", f"{s.share:.2f}"] for s in shares]
    if rows:
        tables.append(("Share of the same-run reference (reference seconds / seconds)",
                       ["benchmark", "device", "run", "dtype", "m x n x k", "variant",
                        "count", "seconds",
                        "reference", "reference seconds", "share"], rows))
    rows = [row for device in sorted(roofs) for row in ceiling_rows(roofs[device])]
    if rows:
        tables.append(("Roofline ceilings (best measured per device)",
                       ["device", "ceiling", "value", "unit", "a GEMM's bytes across it",
                        "bounds", "record (variant, run)"], rows))
        rows = [row for device in sorted(roofs)
                for row in point_rows(roofline_points(records, roofs[device]), roofs[device])]
        tables.append(("Roofline points (one-device runs, largest size, median TFLOP/s)",
                       ["device", "benchmark", "variant", "dtype", "m x n x k", "TFLOP/s",
                        "FLOP/byte", "binding ceiling", "roof TFLOP/s", "of roof"], rows))
    if model:
        header, rows = model_table(model)
        tables.append(("Predicted against measured (error = (predicted - measured) / measured)",
                       header, rows))
    return tables


def _markdown(tables, images, sources, notes=()) -> str:
    lines = ["# distmm report", "", "Made by `distmm report` from " + ", ".join(
        f"`{s}`" for s in sources) + ".", ""]
    if notes:
        lines += ["## Notes", ""] + [f"- {note}" for note in notes] + [""]
    for title, header, rows in tables:
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |",
                  "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows] + [""]
    lines += ["## Figures", ""] + [f"![{name}]({name})" for name in images]
    return "\n".join(lines) + "\n"


def _html(tables, images, sources, notes=()) -> str:
    e = html.escape
    parts = ["<!DOCTYPE html>", '<html><head><meta charset="utf-8"><title>distmm report</title>',
             "<style>table{border-collapse:collapse}td,th{border:1px solid #999;padding:2px 6px}"
             "img{max-width:100%}</style></head><body>", "<h1>distmm report</h1>",
             "<p>Made from " + ", ".join(f"<code>{e(s)}</code>" for s in sources) + ".</p>"]
    if notes:
        parts += ["<h2>Notes</h2>", "<ul>"] + [f"<li>{e(n)}</li>" for n in notes] + ["</ul>"]
    for title, header, rows in tables:
        parts += [f"<h2>{e(title)}</h2>", "<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header)
                  + "</tr>"] + ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows]
        parts.append("</table>")
    parts += ["<h2>Figures</h2>"] + [f'<p><img src="{e(n)}" alt="{e(n)}"></p>' for n in images]
    return "\n".join(parts + ["</body></html>"]) + "\n"


# ---------------------------------------------------------------- figures


def _slug(*parts) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", "-".join(map(str, parts)).lower()).strip("-")


def _figures(plt, records, strong, weak, profiles, roofs, model, folder: Path,
             sections=SECTIONS) -> list[str]:
    """Draw every figure into ``folder``; return the file names."""
    from distmm.cli.report_model import draw_predicted
    from distmm.cli.report_roofline import draw_roofline, roofline_points

    names = []

    def save(fig, name):
        fig.savefig(folder / name, bbox_inches="tight")
        plt.close(fig)
        names.append(name)

    by_bench = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in records if "tflops" in sections else ():
        if (isinstance(r.get("tflops"), (int, float)) and r["tflops"] > 0 and _flops(r) > 0
                and "predicted_seconds" not in r):
            size = (int(r["m"]) * int(r["n"]) * int(r["k"])) ** (1 / 3)
            by_bench[(r["benchmark"], r["device"])][(r["variant"] + emulated_label(r),
                                                     arithmetic(r))][size].append(r["tflops"])
    for (bench, device), lines in sorted(by_bench.items()):
        fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
        for (variant, dtype), points in sorted(lines.items()):
            xs = sorted(points)
            ax.plot(xs, [statistics.median(points[x]) for x in xs], "o-", label=f"{variant} {dtype}")
        ax.set(xscale="log", xlabel="size, (m n k)^(1/3)", ylabel="TFLOP/s (median over runs)",
               title=f"{bench} on {device}")
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1, 0.5))
        save(fig, f"tflops-{_slug(bench, device)}.png")
    for kind, series in (("strong", strong), ("weak", weak)):
        figs = defaultdict(list)
        for s in series:
            figs[(s.benchmark, s.device)].append(s)
        for (bench, device), group in sorted(figs.items()):
            fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), dpi=100)
            counts = sorted({p.count for s in group for p in s.points})
            for s in group:
                known = [p for p in s.points if not p.predicted]
                line, = left.plot([p.count for p in known], [p.speedup for p in known], "o-",
                                  label=s.label)
                right.plot([p.count for p in known], [p.efficiency for p in known], "o-",
                           label=s.label, color=line.get_color())
                for ax, value in ((left, "speedup"), (right, "efficiency")):
                    guessed = [p for p in s.points if p.predicted]
                    if guessed:  # dashed from the last measured count on
                        tail = [p for p in s.points if p.count >= known[-1].count]
                        ax.plot([p.count for p in tail], [getattr(p, value) for p in tail], "--",
                                color=line.get_color())
                    ax.scatter([p.count for p in guessed], [getattr(p, value) for p in guessed],
                               s=70, facecolor="white", edgecolor=line.get_color(), zorder=3)
                    for p in guessed:
                        ax.annotate("predicted", (p.count, getattr(p, value)), fontsize=7,
                                    xytext=(4, -10), textcoords="offset points",
                                    color=line.get_color())
            base = min(s.points[0].count for s in group)
            if kind == "strong":
                left.plot(counts, [c / base for c in counts], "k--", label="ideal")
            right.axhline(1.0, color="k", ls="--")
            what = " or ".join(sorted({s.count_key for s in group}))  # ranks or workers
            left.set(xlabel=what, ylabel="speedup" if kind == "strong" else "TFLOP/s over the smallest count",
                     title=f"{kind} scaling: {bench} on {device}")
            right.set(xlabel=what, ylabel="parallel efficiency", ylim=(0, None))
            left.legend(fontsize=6)
            save(fig, f"{kind}-{_slug(bench, device)}.png")
    for name, profile in profiles:
        rows = timeline_rows(profile)
        phases = sorted({p for _, spans in rows for p, _, _ in spans})
        palette = plt.get_cmap("tab10" if len(phases) <= 10 else "tab20")
        colours = {p: palette(i % palette.N) for i, p in enumerate(phases)}
        fig, ax = plt.subplots(figsize=(12, 1.5 + 0.5 * len(rows)), dpi=100)
        for y, (rank, spans) in enumerate(rows):
            for phase in phases:
                bars = [(s, e - s) for p, s, e in spans if p == phase]
                ax.broken_barh(bars, (y - 0.4, 0.8), color=colours[phase])
        ax.set(yticks=range(len(rows)), yticklabels=[f"rank {r}" for r, _ in rows],
               xlabel="seconds", title=f"{name}: phases per rank")
        ax.invert_yaxis()
        ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[p]) for p in phases],
                  labels=phases, fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
        save(fig, f"timeline-{_slug(name)}.png")
    for device, device_ceilings in sorted(roofs.items()):
        draw_roofline(plt, device, device_ceilings, roofline_points(records, device_ceilings),
                      folder / f"roofline-{_slug(device)}.png")
        names.append(f"roofline-{_slug(device)}.png")
    if any(row.measured is not None for row in model):
        draw_predicted(plt, model, folder / "predicted-vs-measured.png")
        names.append("predicted-vs-measured.png")
    return names


def _rooflines(records) -> tuple[dict, list[str]]:
    """The devices with a roofline and their ceilings, and a note for every other device and
    for the runs of a roofline that have no roof (no compute ceiling of their arithmetic)."""
    from distmm.cli.report_roofline import (ceilings, gpu_devices, host_references, roof,
                                            roofline_points)

    found, gpus, host = ceilings(records), gpu_devices(records), host_references(records)

    def compute(device, dtypes=None):
        """What a compute ceiling of ``device`` (of ``dtypes``, default any) comes from, and
        why a numpy reference recorded under a GPU's name is none."""
        if device not in gpus:
            return "a cublas/numpy reference or an FMA probe"
        aside = host.get(device, set())
        if dtypes is not None:
            aside = aside & set(dtypes)
        return "a cublas reference or an FMA probe" + (
            "; its numpy reference ran on the host's CPU, not on this GPU" if aside else "")

    roofs, notes = {}, []
    for device in sorted({r["device"] for r in records}):
        kinds = {c.kind == "compute" for c in found.get(device, [])}
        if kinds == {True, False}:
            roofs[device] = found[device]
            bare = sorted({p.dtype for p in roofline_points(records, found[device])
                           if roof(p, found[device]) is None})
            if bare:
                notes.append(f"No roof for the {', '.join(bare)} runs of {device}: its records "
                             f"have no compute ceiling of {' or '.join(bare)} "
                             f"({compute(device, bare)}).")
            continue
        missing = " and ".join(what for what, there in (
            (f"compute ({compute(device)})", True in kinds),
            ("bandwidth (ceiling-copy, read-cat or write-dd)", False in kinds)) if not there)
        notes.append(f"No roofline for {device}: its records have no {missing} ceiling.")
    return roofs, notes


# ---------------------------------------------------------------- files


def read_inputs(paths: list[str], cut: list | None = None
                ) -> tuple[list[dict], list[tuple[str, dict]]]:
    """Read record files (JSON lines) and profiles (files ending ``.json``).

    With a list ``cut``, a record file whose last line is cut short (no newline at its end,
    not JSON: a writer killed mid-line, or still writing it) is read without that line,
    and its ``FILE:LINE`` is appended to ``cut`` (``distmm.cli.records.json_lines``).

    A profile file is one ``distmm-profile-1`` object (named by the file's stem) or an
    object of named ones (``bench/mpi_batch.py``'s ``mpi-batch-profiles-*.json``). A SUMMA
    trace (``bench/research/summa_trace.py``'s ``summa-trace-*.json``, which the performance
    model calibrates NCCL's socket link from) is accepted and draws nothing here.

    Returns
    -------
    records, profiles : list of dict, list of (name, profile)

    Raises
    ------
    FileNotFoundError
        A path that does not exist.
    ValueError, TypeError
        A file given twice (under one name or two); a file that is not UTF-8 JSON; a
        record that ``distmm.cli.records.check_record`` refuses (a line that is not a JSON
        object with the ``REQUIRED`` keys, a field of the wrong type or out of range: named
        with its line number and field); a profile in
        another format or one whose ``ranks`` are not a non-empty list of objects, each
        with an integer ``rank`` and a list of ``spans`` that each have a string
        ``phase`` and finite ``start`` <= ``end`` (named with its file, profile and rank);
        a study's record the tables would show wrong (``_check_study_record``);
        or no records and no profiles at all.
    """
    from distmm.cli.model_records import is_summa_trace

    records, profiles = [], []
    seen: dict[tuple[int, int], int] = {}
    measured: dict[tuple, str] = {}
    for i, path in enumerate(paths):
        if not os.path.isfile(path):
            raise FileNotFoundError(2, "No such file or directory" if not os.path.exists(path)
                                    else "Not a file", path)
        st = os.stat(path)
        first = seen.setdefault((st.st_dev, st.st_ino), i)
        if first != i:
            raise ValueError(f"{path}: given twice (also as {paths[first]}): its records would "
                             f"count twice")
        if path.endswith(".json"):
            data = json_file(path)
            if is_summa_trace(data):
                continue
            named = [(Path(path).stem, data)] if isinstance(data, dict) and "format" in data else (
                [(f"{Path(path).stem} {k}", v) for k, v in data.items()] if isinstance(data, dict) else [])
            for name, profile in named:
                if not isinstance(profile, dict) or profile.get("format") != "distmm-profile-1":
                    raise ValueError(f"{path}: {name} is not a distmm-profile-1 profile")
                _check_profile(profile, f"{path}: profile {name}")
            if not named:
                raise ValueError(f"{path}: not a distmm-profile-1 profile or an object of them")
            profiles += named
            continue
        for number, record in read_records(path, cut):
            _check_study_record(record, f"{path}:{number}", measured)
            records.append(record)
    if not records and not profiles:
        raise ValueError(f"no benchmark records in {', '.join(paths)}")
    return records, profiles


#: the count token that ends a ``distmm bench`` variant (``distmm.cli.study.variant_name``)
_STUDY_COUNT = re.compile(r"@(\d+)(ranks|workers|gpu)$")


def _check_study_record(record: dict, where: str, measured: dict) -> None:
    """Refuse a ``distmm bench`` record (one with a ``study``) that the tables would show
    wrong, naming ``where`` (``FILE:LINE``): one whose count (``count_of``) is not the one
    its variant names (a count key missing or edited: it would be tabulated at another
    count), and a second record of one configuration (run, benchmark, device, variant,
    dtype, size) of one run, which a study measures once, or a run's records of two
    ``host`` names: the records of two machines that started a study in the same second,
    or of one file copied into another, whose times would be taken together (``measured``
    holds where each was first seen)."""
    if "study" not in record or "predicted_seconds" in record:
        return
    variant = record["variant"]
    token = _STUDY_COUNT.search(variant)
    key, count = count_of(record)
    if token and not any(record.get(k) is not None for k in ("ranks", "gpus", "workers")):
        raise ValueError(f"{where}: the record of {variant} lacks its count (ranks, gpus or "
                         f"workers)")
    if token and count != int(token.group(1)):
        raise ValueError(f"{where}: the record of {variant} counts {key} {count}, its variant "
                         f"names {token.group(1)}")
    run = str(record["run"])
    host = record.get("host")
    other, there = measured.setdefault(("host", run), (host, where))
    if host != other:
        raise ValueError(f"{where}: run {run} was measured on {host!r}, and on {other!r} "
                         f"({there}): two machines that started a study in the same second "
                         f"share a run id; report them apart")
    config = (run, record["benchmark"], record["device"], variant,
              arithmetic(record), record["dtype"], record["m"], record["n"], record["k"],
              str(record.get("emulated_nodes")))
    first = measured.setdefault(config, where)
    if first != where:
        raise ValueError(f"{where}: {variant} {record['dtype']} "
                         f"{record['m']}x{record['n']}x{record['k']} of run {record['run']} "
                         f"again (first at {first}): a study measures a configuration once, "
                         f"so these are two machines' records that share a run id (started "
                         f"in the same second) or records copied twice; report them apart")


def _check_profile(profile: dict, where: str) -> None:
    """Refuse a profile ``timeline_rows`` cannot draw (``read_inputs``' rules), naming
    ``where`` and what is wrong."""
    ranks = profile.get("ranks")
    if ranks is None:
        raise ValueError(f"{where} has no 'ranks' (the list of the ranks' records)")
    if not isinstance(ranks, list) or not ranks:
        raise ValueError(f"{where}: 'ranks' must be a non-empty list of the ranks' records, "
                         f"got {repr(ranks)[:40]}")
    for i, entry in enumerate(ranks):
        rank = entry.get("rank") if isinstance(entry, dict) else None
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"{where}: ranks[{i}] must be an object with a 'rank' number "
                             f"(0, 1, ...)")
        spans = entry.get("spans")
        if not isinstance(spans, list):
            raise ValueError(f"{where}: rank {rank} has no 'spans' list")
        for j, span in enumerate(spans):
            ok = (isinstance(span, dict) and isinstance(span.get("phase"), str)
                  and all(isinstance(span.get(key), (int, float))
                          and not isinstance(span.get(key), bool)
                          and math.isfinite(span[key]) for key in ("start", "end"))
                  and span["start"] <= span["end"])
            if not ok:
                raise ValueError(f"{where}: rank {rank} span {j} must have a string 'phase' "
                                 f"and numbers 'start' <= 'end', got {repr(span)[:80]}")


def _make_parents(folder: Path) -> list[Path]:
    """Make ``folder`` and its missing parents; return those made, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for i, path in enumerate(reversed(missing)):
        try:
            path.mkdir(exist_ok=True)
        except BaseException:
            _remove_folders(missing[len(missing) - i:])
            raise
    return missing


def _remove_folders(folders: list[Path]) -> None:
    """Remove the folders a failed run made (deepest first), unless something else is in them."""
    for path in folders:
        try:
            path.rmdir()
        except OSError:
            return


def _is_report_file(path: Path) -> bool:
    """Whether ``path`` is a file a report writes into its folder."""
    return (path.is_file() and not path.is_symlink()
            and (path.name in ("report.md", "index.html") or path.suffix == ".png"))


def _check_output(folder: Path, overwrite: bool, inputs=()) -> None:
    """Refuse an output folder that is a file or under one, a non-empty folder without
    ``overwrite``, one that holds anything but a report's files (``report.md``,
    ``index.html``, PNGs) even with it, or one whose replacement would take away the
    current folder or an input (``inputs``). A symbolic link is replaced, not followed, and
    only with ``overwrite``. A folder in which nothing can be made where the report's first
    folder goes (the nearest that exists above it: read-only, or ``/proc``, where root's
    permissions do not stop a write) is refused as not writable (``PermissionError``)."""
    from distmm.cli.outputs import check_folder

    above = folder.absolute().parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():  # the folder would go under a file
        raise NotADirectoryError(20, "Not a directory", str(above))
    # as the staging folder (or the first folder made above it) is made
    check_folder(above / f".{folder.name}.distmm-partial-{os.getpid()}", folder)
    if folder.is_symlink():
        if not overwrite:
            raise OutputExists(f"{folder} exists (a symbolic link): pass --overwrite to "
                               f"replace it")
        return
    if folder.exists() and not folder.is_dir():
        raise OutputExists(f"{folder} exists and is not a folder")
    if folder.is_dir():
        here = folder.resolve()
        if here == Path.cwd().resolve() or here in Path.cwd().resolve().parents:
            raise ValueError(f"-o {folder} is the current folder or holds it: the report "
                             f"replaces its folder; name a folder of its own")
        inside = [p for p in inputs if here in Path(p).resolve().parents]
        if inside:
            raise ValueError(f"-o {folder} holds the input {inside[0]}: the report replaces "
                             f"its folder; name another folder")
    if folder.is_dir() and any(folder.iterdir()) and not overwrite:
        raise OutputExists(f"{folder} exists and is not empty: pass --overwrite to replace it")
    others = sorted(p.name for p in folder.iterdir() if not _is_report_file(p)) \
        if folder.is_dir() else []
    if others:
        raise OutputExists(f"{folder} holds {others[0]}, which no report writes: --overwrite "
                           f"replaces only a report's folder (report.md, index.html, PNGs); "
                           f"name another folder")


def _sections(text: str) -> tuple[str, ...]:
    import argparse

    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown section {', '.join(map(repr, unknown)) or repr(text)}: choose from "
            f"{', '.join(SECTIONS)}")
    return names


def add_options(parser) -> None:
    """``distmm report``'s options beyond the records and ``-o`` (called by ``build_parser``)."""
    parser.add_argument("--only", type=_sections, default=None, metavar="SECTION,...",
                        help="draw and tabulate only these: " + ", ".join(SECTIONS)
                             + " (default: all)")
    parser.add_argument("--no-html", action="store_true",
                        help="write report.md and the figures, not index.html")


def run_report(paths: list[str], output: str, *, overwrite: bool = False,
               only: tuple[str, ...] | None = None, html: bool = True) -> int:
    """Write the report of ``paths`` into the folder ``output``; return the exit status.

    ``only`` names the sections (``SECTIONS``) to draw and tabulate, default all; ``html``
    False leaves out ``index.html``.

    Inputs and the output folder are checked before anything is drawn; everything is
    written to a temporary folder beside ``output`` that replaces it at the end, so a
    failure leaves ``output`` as it was, and removes the folders above it that it made.
    Without matplotlib it prints one line and returns 2.
    """
    if not output:  # Path("") is the current folder
        raise ValueError("-o '' names no folder (it would be the current folder, which the "
                         "report replaces): name a folder of its own")
    if not all(paths):
        raise ValueError("an empty path among the records files")
    folder = Path(output)
    _check_output(folder, overwrite, paths)
    cut: list[str] = []
    records, profiles = read_inputs(paths, cut)
    invalid = [r for r in records if r.get("invalid")]
    # a product off its float64 check (distmm bench's relerr_ok): its time is no result's
    wrong = [r for r in records if not r.get("invalid") and r.get("relerr_ok") is False]
    records = [r for r in records if not r.get("invalid") and r.get("relerr_ok") is not False]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"distmm report: error: {INSTALL}", file=sys.stderr)
        return 2
    from distmm.cli.report_model import model_rows

    sections = set(only or SECTIONS)
    strong = scaling(records, "strong") if "strong" in sections else []
    weak = scaling(records, "weak") if "weak" in sections else []
    profiles = profiles if "timeline" in sections else []
    roofs, notes = {}, []
    for where in cut:  # what a run killed mid-record left: its whole records are read
        print(f"distmm report: warning: {where}: the file's last line, cut short (no newline "
              f"at its end, not JSON), is left out", file=sys.stderr, flush=True)
    if cut:
        notes.append(f"{len(cut)} last line{'s' * (len(cut) > 1)} cut short (no newline at "
                     f"the end, not JSON: a run killed mid-record) left out: "
                     + ", ".join(f"`{where}`" for where in cut) + ".")
    dirty = sum(bool(r.get("commit_dirty")) for r in records)
    if dirty:
        notes.append(f"{dirty} records were measured on a tree with uncommitted changes "
                     "(`commit_dirty`): their commit does not name all the code that ran.")
    if invalid:
        notes.append(f"{len(invalid)} records marked invalid were left out (each record's "
                     "`invalid` says why).")
    if wrong:
        notes.append(f"{len(wrong)} records whose product failed its float64 check "
                     "(`relerr_ok` false) were left out: "
                     + ", ".join(sorted({r["variant"] for r in wrong})) + ".")
    if "roofline" in sections:
        roofs, roof_notes = _rooflines([r for r in records if "predicted_seconds" not in r])
        notes += roof_notes
    model = model_rows(records) if "model" in sections else []
    if "model" in sections and not model:
        notes.append("No predicted against measured figure: no record has predicted_seconds.")
    elif model and not any(row.measured is not None for row in model):
        notes.append("No predicted against measured figure: every record with "
                     "predicted_seconds is a prediction (seconds null).")
    shares = reference_shares(records) if "shares" in sections else []
    if "shares" in sections:
        paired = {id(s.record) for s in shares}
        alone = [r for r in records if "predicted_seconds" not in r and r["seconds"]
                 and not is_reference(r["variant"]) and id(r) not in paired]
        if alone:
            notes.append(f"No share of a reference for {len(alone)} records: no reference "
                         f"({', '.join(REFERENCES)}) was measured in the same run on the "
                         "same device for their dtype and size.")
    made = _make_parents(folder.absolute().parent)
    try:
        staged = Path(tempfile.mkdtemp(prefix=f".{folder.name}.distmm-partial-",
                                       dir=folder.absolute().parent))
    except BaseException as exc:
        _remove_folders(made)
        if isinstance(exc, OSError) and exc.errno:  # named as -o, not the staging folder
            raise OSError(exc.errno, exc.strerror, str(folder.absolute().parent)) from None
        raise
    staged.chmod(0o755)  # mkdtemp's 0700 would make the renamed folder private
    old = None
    try:
        images = _figures(plt, records, strong, weak, profiles, roofs, model, staged, sections)
        tables = _tables(records, strong, weak, shares, roofs, model)
        (staged / "report.md").write_text(_markdown(tables, images, paths, notes))
        if html:
            (staged / "index.html").write_text(_html(tables, images, paths, notes))
        if folder.exists() or folder.is_symlink():
            old = staged.with_name(staged.name + "-old")
            folder.rename(old)
        staged.rename(folder)
        if old is not None and old.is_symlink():  # a link is replaced, not followed
            old.unlink()
        elif old is not None:
            shutil.rmtree(old)
    except BaseException:
        if old is not None and (old.is_symlink() or old.exists()):
            if not staged.exists():  # the new report is in place: the old one goes
                old.unlink() if old.is_symlink() else remove_tree(old)
            elif not (folder.exists() or folder.is_symlink()):
                old.rename(folder)  # the report it was to replace goes back in place
        remove_tree(staged)
        _remove_folders(made)
        raise
    print(f"wrote {folder}: report.md, {'index.html, ' if html else ''}{len(images)} figures from "
          f"{len(records)} records and {len(profiles)} profiles")
    return 0
