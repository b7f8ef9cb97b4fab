"""``distmm report``: the pure computations on known records, and the command end to end on
synthetic and committed records (real files, real PNGs)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from distmm.cli import main
from distmm.cli.report import (count_of, family, is_reference, read_inputs, reference_shares,
                               scaling, timeline_rows)
from distmm.cli.report_model import model_rows
from distmm.cli.report_roofline import ceilings, intensity, roofline_points

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
MODEL = RESULTS / "model-validation-2026-11-27.jsonl"
BATCH = RESULTS / "mpi-batch-nvidia-h200-2026-11-26.jsonl"
PROFILES = RESULTS / "mpi-batch-profiles-20261126T222450Z.json"
PNG = b"\x89PNG\r\n\x1a\n"


def record(variant, seconds, *, run="r1", m=1000, n=1001, k=999, dtype="float64", **extra):
    return dict(run=run, benchmark="scaling", variant=variant, device="test-cpu", dtype=dtype,
                m=m, n=n, k=k, seconds=seconds, tflops=2 * m * n * k / seconds / 1e12, **extra)


# 1, 2, 4 ranks at 8 s, 5 s, 4 s: speedup 1, 1.6, 2; efficiency 1, 0.8, 0.5
STRONG = [record(f"distmm-mpi-{p}", t, ranks=p) for p, t in ((1, 8.0), (2, 5.0), (4, 4.0))]
# sizes grow with the GPUs: per-GPU work 2*m^3/p constant at m = 1000 * p^(1/3)
WEAK = [record(f"distmm-dask@{g}gpu", t, m=m, n=m, k=m, gpus=g, run="w")
        for g, m, t in ((1, 1000, 2.0), (8, 2000, 2.5))]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_count_family_and_reference_rules():
    assert count_of({"ranks": 4, "gpus": 1}) == ("ranks", 4)
    assert count_of({"ranks": None, "gpus": 2, "workers": 1}) == ("gpus", 2)
    assert count_of({"workers": 3}) == ("workers", 3)
    assert count_of({}) == ("ranks", 1)
    assert family("mpirun-4-h5", 4) == "mpirun-h5"
    assert family("mpirun-4", 2) == "mpirun-4"
    assert family("distmm-dask@2gpu", 2) == "distmm-dask"
    assert family("batch-1", 1) == "batch"
    assert [v for v in ("cublas", "cublas-incore", "numpy", "dask.array-chunk8192@2gpu",
                        "read-cat", "write-dd-fsync", "distmm-mpi", "numpyish", "heat",
                        "distmm-raw-cublas") if is_reference(v)] == [
        "cublas", "cublas-incore", "numpy", "dask.array-chunk8192@2gpu", "read-cat",
        "write-dd-fsync"]


def test_strong_scaling_exact():
    noise = [record("cublas", 1.0, ranks=1), record("distmm-mpi-2", 9.0, ranks=2, run="other")]
    (series,) = scaling(STRONG + noise, "strong")
    assert (series.family, series.count_key, series.run) == ("distmm-mpi", "ranks", "r1")
    assert [p.count for p in series.points] == [1, 2, 4]
    assert [p.speedup for p in series.points] == pytest.approx([1.0, 1.6, 2.0], rel=1e-12)
    assert [p.efficiency for p in series.points] == pytest.approx([1.0, 0.8, 0.5], rel=1e-12)
    assert scaling(STRONG, "weak") == []  # one size at every count is not weak scaling


def test_strong_scaling_median_of_repeats_and_base_above_one():
    recs = [record("v-2", t, ranks=2) for t in (3.0, 4.0, 100.0)] + [record("v-8", 1.0, ranks=8)]
    (series,) = scaling(recs, "strong")
    assert [p.seconds for p in series.points] == [4.0, 1.0]
    assert [p.speedup for p in series.points] == pytest.approx([1.0, 4.0])
    assert [p.efficiency for p in series.points] == pytest.approx([1.0, 1.0])


def test_weak_scaling_exact():
    (series,) = scaling(WEAK, "weak")
    assert (series.family, series.count_key) == ("distmm-dask", "gpus")
    assert [p.size for p in series.points] == [(1000,) * 3, (2000,) * 3]
    # TFLOP/s ratio (8x the work in 1.25x the time) = 6.4; efficiency 6.4 / 8 = 0.8
    assert [p.speedup for p in series.points] == pytest.approx([1.0, 6.4], rel=1e-12)
    assert [p.efficiency for p in series.points] == pytest.approx([1.0, 0.8], rel=1e-12)
    assert scaling(WEAK, "strong") == []
    shrinking = [WEAK[0], dict(WEAK[1], m=500, n=500, k=500)]
    assert scaling(shrinking, "weak") == []
    with pytest.raises(ValueError, match="'strong' or 'weak'"):
        scaling(WEAK, "medium")


def test_weak_series_of_several_sides_per_device_are_one_series_each():
    """distmm bench's weak series with sizes_per_device = [40, 64]: each side is a series
    of its own (before, the two sizes at each count made the whole series no weak
    scaling at all, and the report had no weak section); a prediction joins the series
    whose side and k its size fits."""
    recs = [record(f"distmm-mpi-weak@{p}ranks", t, m=p * b, n=b, k=b, ranks=p, per_device=b)
            for b, times in ((40, (1.0, 2.5)), (64, (2.0, 2.5))) for p, t in zip((1, 2), times)]
    forecast = dict(record("distmm-mpi-weak@4ranks", 1.0, m=128, n=128, k=64, ranks=4,
                           run="model"), seconds=None, tflops=None, predicted_seconds=4.0)
    small, large = scaling(recs + [forecast], "weak")
    assert [(p.size, p.count, p.predicted) for p in small.points] == [
        ((40, 40, 40), 1, False), ((80, 40, 40), 2, False)]
    assert [(p.size, p.count, p.predicted) for p in large.points] == [
        ((64, 64, 64), 1, False), ((128, 64, 64), 2, False), ((128, 128, 64), 4, True)]
    assert [p.speedup for p in small.points] == pytest.approx([1.0, 0.8], rel=1e-12)
    assert [p.efficiency for p in small.points] == pytest.approx([1.0, 0.4], rel=1e-12)
    assert [p.speedup for p in large.points] == pytest.approx([1.0, 1.6, 2.0], rel=1e-12)
    assert [p.efficiency for p in large.points] == pytest.approx([1.0, 0.8, 0.5], rel=1e-12)
    assert [s.label for s in scaling(recs, "weak")] == [
        "distmm-mpi-weak float64 weak from 40x40x40 run r1",
        "distmm-mpi-weak float64 weak from 64x64x64 run r1"]


def test_reference_shares_pair_same_run_and_problem():
    recs = [record("cublas", 2.0), record("cublas", 4.0), record("cublas", 6.0),
            record("numpy", 10.0), record("distmm-raw", 5.0),
            record("distmm-raw", 5.0, run="r2"),               # no reference in its run
            record("distmm-raw", 5.0, dtype="float32"),        # nor of its dtype
            record("cublas", 1.0, m=7), record("distmm-raw", 0.5, m=7)]
    shares = reference_shares(recs)
    got = [(s.record["m"], s.record["run"], s.reference, s.reference_seconds, s.share) for s in shares]
    assert got == [(1000, "r1", "cublas", 4.0, pytest.approx(0.8)),
                   (1000, "r1", "numpy", 10.0, pytest.approx(2.0)),
                   (7, "r1", "cublas", 1.0, pytest.approx(2.0))]


def test_shares_stay_within_a_device_of_a_shared_run():
    """Two machines that started a study in the same second share its run id: each
    record's share is of its own device's reference (before, the references of both
    devices were pooled, their median taken)."""
    recs = [record("numpy", 1.0), record("distmm-mpi-2", 2.0, ranks=2),
            dict(record("numpy", 10.0), device="other-cpu"),
            dict(record("distmm-mpi-2", 5.0, ranks=2), device="other-cpu")]
    got = [(s.record["device"], s.reference_seconds, s.share) for s in reference_shares(recs)]
    assert got == [("test-cpu", 1.0, 0.5), ("other-cpu", 10.0, 2.0)]


def test_records_off_their_check_and_without_a_reference_are_noted(tmp_path):
    """distmm bench writes the record of a product off its float64 check with relerr_ok
    false: it is no point of the strong series (before, its 1 s made ranks 2 a speedup of
    8), and the notes say so; records that no same-run reference pairs with are counted."""
    wrong = dict(record("distmm-mpi-2", 1.0, ranks=2), relerr=0.5, relerr_ok=False)
    good = [dict(r, relerr_ok=True) for r in STRONG]
    out = tmp_path / "report"
    assert main(["report", str(write_jsonl(tmp_path / "r.jsonl", good + [wrong])), "-o",
                 str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "| ranks 2 | 5 | 1.60 | 80.0% |" in text and "| ranks 2 | 3 |" not in text
    assert ("- 1 records whose product failed its float64 check (`relerr_ok` false) were "
            "left out: distmm-mpi-2.") in text
    assert ("- No share of a reference for 3 records: no reference (cublas, numpy, dask.array, "
            "read-cat, write-dd) was measured in the same run on the same device for their "
            "dtype and size.") in text


def test_a_reduced_precision_is_its_own_series_and_reference():
    """TF32 records of the same variants and size (one run) beside float32 ones (another run,
    and in the same run): each series and each share stays within its arithmetic."""
    fp32 = [record(f"distmm-mpi@{p}gpu", t, gpus=p, dtype="float32") for p, t in ((2, 5.0), (4, 2.6))]
    tf32 = [record(f"distmm-mpi@{p}gpu", t, gpus=p, dtype="float32", precision="tf32", run="t")
            for p, t in ((2, 1.0), (4, 0.6))]
    refs = [record("cublas", 9.0, dtype="float32"),
            record("cublas", 1.8, dtype="float32", precision="tf32", run="t"),
            record("cublas", 100.0, dtype="float32", precision="bf16", run="t")]
    series = scaling(fp32 + tf32 + refs, "strong")
    assert sorted((s.dtype, s.run, [p.seconds for p in s.points]) for s in series) == [
        ("float32", "r1", [5.0, 2.6]), ("tf32", "t", [1.0, 0.6])]
    got = sorted((s.record["run"], s.record["gpus"], s.reference_seconds)
                 for s in reference_shares(fp32 + tf32 + refs))
    assert got == [("r1", 2, 9.0), ("r1", 4, 9.0), ("t", 2, 1.8), ("t", 4, 1.8)]


def profile(ranks=2):
    spans = [[{"phase": "read", "lane": "read", "start": 0.5 * r + 1.0, "end": 2.0},
              {"phase": "open", "lane": "open", "start": 0.0, "end": 0.5 * r + 1.0},
              {"phase": "gemm", "lane": "gemm", "start": 2.0, "end": 3.0 + r}] for r in range(ranks)]
    return {"format": "distmm-profile-1", "meta": {"ranks": ranks, "wall": 4.0},
            "ranks": [{"rank": r, "host": "h", "spans": spans[r]} for r in reversed(range(ranks))]}


def test_timeline_rows():
    rows = timeline_rows(profile(2))
    assert [r for r, _ in rows] == [0, 1]
    assert rows[1][1] == [("open", 0.0, 1.5), ("read", 1.5, 2.0), ("gemm", 2.0, 4.0)]


def check_folder(folder: Path, pngs: set[str]) -> str:
    names = {p.name for p in folder.iterdir()}
    assert names == pngs | {"report.md", "index.html"}
    for name in pngs:
        data = (folder / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 1000, name
    html = (folder / "index.html").read_text()
    for name in pngs:
        assert f'<img src="{name}"' in html
    assert not list(folder.parent.glob(f".{folder.name}.distmm-partial-*"))
    return (folder / "report.md").read_text()


def test_command_on_synthetic_records(tmp_path, capsys):
    recs = write_jsonl(tmp_path / "scaling.jsonl", STRONG + WEAK + [record("numpy", 4.0, ranks=1)])
    prof = tmp_path / "run.json"
    prof.write_text(json.dumps(profile(3)))
    out = tmp_path / "report"
    assert main(["report", str(recs), str(prof), "-o", str(out)]) == 0
    text = check_folder(out, {"tflops-scaling-test-cpu.png", "strong-scaling-test-cpu.png",
                              "weak-scaling-test-cpu.png", "timeline-run.png"})
    assert "| scaling | test-cpu | r1 | distmm-mpi | float64 | 1000x1001x999 | ranks 2 | 5 | 1.60 | 80.0% |" in text
    assert "| ranks 4 | 4 | 2.00 | 50.0% |" in text
    assert "| w | distmm-dask | float64 | 2000x2000x2000 | gpus 8 | 2.5 | 6.40 | 80.0% |" in text
    # distmm-mpi-4 (4 s) against numpy (4 s) of the same run and problem; -1 at 8 s: 0.50
    assert "| distmm-mpi-4 | ranks 4 | 4 | numpy | 4 | 1.00 |" in text
    assert "| distmm-mpi-1 | ranks 1 | 8 | numpy | 4 | 0.50 |" in text
    assert "wrote" in capsys.readouterr().out


@pytest.mark.slow
def test_command_on_committed_batch_records(tmp_path):
    out = tmp_path / "batch"
    assert main(["report", str(BATCH), str(PROFILES), "-o", str(out)]) == 0
    labels = ("batch-1-32768", "mpirun-2-32768", "mpirun-4-32768", "mpirun-4-zarr-32768",
              "mpirun-4-h5-32768")
    text = check_folder(out, {"tflops-mpi-batch-nvidia-h200.png", "roofline-nvidia-h200.png",
                              "strong-mpi-batch-nvidia-h200.png"}
                        | {f"timeline-mpi-batch-profiles-20261126t222450z-{x}.png" for x in labels})
    # run 20261126T220207Z: mpirun-1 5.9758 s, mpirun-2 8.1364 s, mpirun-4 8.3809 s
    assert "| 20261126T220207Z | mpirun | float32 | 32768x32768x32768 | ranks 2 | 8.136 | 0.73 | 36.7% |" in text
    assert "| 20261126T220207Z | mpirun | float32 | 32768x32768x32768 | ranks 4 | 8.381 | 0.71 | 17.8% |" in text
    # distmm-cli 5.4657 s against cublas-incore 1.3255 s in run 20261126T222450Z
    assert ("| 20261126T222450Z | float32 | 32768x32768x32768 | distmm-cli | ranks 1 | 5.466 | "
            "cublas-incore | 1.326 | 0.24 |") in text


def test_an_output_under_a_file_is_one_line_naming_that_file(tmp_path, capsys):
    """-o r.jsonl/out (and deeper): the file in the way is named, before anything is drawn
    (before, the line named the report's hidden staging folder)."""
    recs = write_jsonl(tmp_path / "r.jsonl", STRONG)
    for out in (recs / "out", recs / "a" / "b" / "out"):
        assert main(["report", str(recs), "-o", str(out)]) == 2
        assert capsys.readouterr().err == f"distmm report: error: Not a directory: {recs}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="writes under /proc")
@pytest.mark.parametrize("out", ["/proc/report", "/proc/new/deeper/report"])
def test_an_output_where_no_folder_can_be_made_is_refused_before_any_work(tmp_path, capsys,
                                                                          out):
    """-o under /proc, where root's permissions let a process write but nothing can be
    made: the records were read and the tables computed before making the staging folder
    failed ('No such file or directory: /proc'). A file is made and removed where the first
    folder goes now: one line naming -o, status 2."""
    recs = write_jsonl(tmp_path / "r.jsonl", STRONG)
    assert main(["report", str(recs), "-o", out]) == 2
    err = capsys.readouterr().err  # root: nothing made in /proc; others: no permission
    assert err in (f"distmm report: error: cannot write in /proc ({why}): {out}\n"
                   for why in ("No such file or directory", "Permission denied")), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]


def test_overwrite_replaces_and_refusal_keeps(tmp_path, capsys):
    recs = write_jsonl(tmp_path / "r.jsonl", STRONG)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["report", str(recs), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"distmm report: error: {out} exists and is not empty: pass --overwrite to replace it"
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    # --overwrite replaces a report's folder only, as the CLI never removes another folder
    # (before, it took keep.txt away with the folder)
    (out / "report.md").write_text("an old report")
    assert main(["report", str(recs), "-o", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"distmm report: error: {out} holds keep.txt, which no report writes: "
                   f"--overwrite replaces only a report's folder (report.md, index.html, "
                   f"PNGs); name another folder")
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt", "report.md"]
    (out / "keep.txt").unlink()
    (out / "old.png").write_bytes(PNG)
    assert main(["report", str(recs), "-o", str(out), "--overwrite"]) == 0
    assert not (out / "old.png").exists() and "an old" not in (out / "report.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "r.jsonl"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(recs), "-o", str(empty)]) == 0


def test_a_symbolic_link_as_the_folder_is_replaced_not_followed(tmp_path, capsys):
    """-o a link to a report's folder: with --overwrite the link is replaced by the new
    folder, its target untouched (before: status 1, "Cannot call rmtree on a symbolic
    link", the link left beside as a hidden .out.distmm-partial-*-old); without, refused."""
    recs = write_jsonl(tmp_path / "r.jsonl", STRONG)
    fast = ["--only", "shares", "--no-html"]  # no figure to draw
    target = tmp_path / "target"
    assert main(["report", str(recs), "-o", str(target), *fast]) == 0
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    for link, to in ((tmp_path / "out", target), (tmp_path / "gone", tmp_path / "nowhere")):
        link.symlink_to(to)
        assert main(["report", str(recs), "-o", str(link), *fast]) == 2
        assert capsys.readouterr().err.strip() == (
            f"distmm report: error: {link} exists (a symbolic link): pass --overwrite to "
            f"replace it")
        assert link.is_symlink()
        assert main(["report", str(recs), "-o", str(link), "--overwrite", *fast]) == 0
        assert not link.is_symlink() and (link / "report.md").is_file()
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gone", "out", "r.jsonl", "target"]


@pytest.mark.slow
def test_overwrite_never_replaces_a_folder_holding_an_input_or_the_current_folder(tmp_path):
    # the records kept in the report's folder were deleted by --overwrite
    out = tmp_path / "out"
    out.mkdir()
    recs = write_jsonl(out / "r.jsonl", STRONG)
    before = recs.read_bytes()
    done = subprocess.run([sys.executable, "-m", "distmm", "report", str(recs), "-o", str(out),
                           "--overwrite"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and f"holds the input {recs}" in done.stderr
    assert recs.read_bytes() == before and [p.name for p in out.iterdir()] == ["r.jsonl"]
    for target in (".", "", str(tmp_path)):
        done = subprocess.run([sys.executable, "-m", "distmm", "report", str(recs), "-o", target,
                               "--overwrite"], capture_output=True, text=True, timeout=300,
                              cwd=out)
        assert done.returncode == 2, (target, done.stderr)
        assert done.stderr.count("\n") == 1 and "current folder" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in out.iterdir()] == ["r.jsonl"]


@pytest.mark.parametrize("content, expected", [
    ('{"run": 1}\nnot json\n', "bad.jsonl:1: the record lacks benchmark, variant, device"),
    (json.dumps(STRONG[0]) + "\n\n{oops\n", "bad.jsonl:3: not a JSON line"),
    (json.dumps(STRONG[0]) + "\n[1, 2]\n", "bad.jsonl:2: a record is a JSON object, got list"),
    ("\n\n", "no benchmark records in"),
    (json.dumps(STRONG[0]) + "\n" + json.dumps(STRONG[1])[:40] + "\n" + json.dumps(STRONG[2])
     + "\n", "bad.jsonl:2: not a JSON line (Invalid control character at)\n"),
], ids=["missing-keys", "bad-json-line-3", "not-an-object", "empty", "cut-line-inside"])
def test_bad_records_fail_in_one_line_before_output(tmp_path, capsys, content, expected):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    assert main(["report", str(bad), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("distmm report: error: ") and expected in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_a_cut_last_line_is_left_out_with_a_warning_naming_it(tmp_path, capsys):
    """A run killed mid-record (SIGKILL during a write of several pages) leaves its last
    line cut short, without its newline: the report reads every whole record before it and
    names the line in a warning and a note (before, it refused the whole file). A file cut
    short in the middle of a UTF-8 character is read the same way."""
    whole = "".join(json.dumps(r) + "\n" for r in STRONG)
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(whole.encode() + json.dumps(record("numpy", 1.0, note="é"))
                    .encode()[:-10])
    utf8 = tmp_path / "utf8.jsonl"
    utf8.write_bytes(whole.encode() + '{"run": "r1", "variant": "é'.encode()[:-1])
    out = tmp_path / "out"
    assert main(["report", str(cut), str(utf8), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "".join(
        f"distmm report: warning: {f}:4: the file's last line, cut short (no newline at its "
        f"end, not JSON), is left out\n" for f in (cut, utf8))
    assert "from 6 records" in captured.out
    md = (out / "report.md").read_text()
    assert (f"- 2 last lines cut short (no newline at the end, not JSON: a run killed "
            f"mid-record) left out: `{cut}:4`, `{utf8}:4`.") in md
    assert md.count("| distmm-mpi |") == 3  # one strong series of 3 counts (one run, 2 files)
    with pytest.raises(ValueError, match="cut.jsonl:4: not a JSON line .*; the file's last "
                                         "line, cut short"):
        read_inputs([str(cut)])  # a reader that asks for no cut line refuses it


def test_a_file_given_twice_is_refused_before_output(tmp_path, capsys):
    """A glob that names a file twice, or a link beside it: before, its records counted
    twice (every share row twice, the notes' counts doubled)."""
    recs = write_jsonl(tmp_path / "r.jsonl", STRONG)
    (tmp_path / "link.jsonl").symlink_to(recs)
    for again in (recs, tmp_path / "link.jsonl"):
        assert main(["report", str(recs), str(again), "-o", str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err == (f"distmm report: error: {again}: given twice (also "
                                           f"as {recs}): its records would count twice\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "r.jsonl"]


def study_record(variant, seconds, **extra):
    """A record as ``distmm bench`` writes it (its ``study``, ``host`` and count keys)."""
    return record(variant, seconds, run="20261206T195446Z", study="s", host="node-a", **extra)


#: a strong MPI series of one study run: 1 and 2 ranks, 301x257x283
STUDY = [study_record(f"distmm-mpi@{p}ranks", t, ranks=p, m=301, n=257, k=283)
         for p, t in ((1, 0.08), (2, 0.05))]


@pytest.mark.parametrize("change, expected", [
    (lambda recs: recs[1].pop("ranks"),
     "s.jsonl:2: the record of distmm-mpi@2ranks lacks its count (ranks, gpus or workers)"),
    (lambda recs: recs[1].update(ranks=1),
     "s.jsonl:2: the record of distmm-mpi@2ranks counts ranks 1, its variant names 2"),
    (lambda recs: recs.append(dict(recs[1], seconds=0.15)),
     "s.jsonl:3: distmm-mpi@2ranks float64 301x257x283 of run 20261206T195446Z again (first at "
     "{d}/s.jsonl:2): a study measures a configuration once"),
    (lambda recs: recs[1].update(host="node-b"),
     "s.jsonl:2: run 20261206T195446Z was measured on 'node-b', and on 'node-a' ({d}/s.jsonl:1): "
     "two machines"),
], ids=["count-missing", "count-edited", "twice-in-a-run", "two-hosts"])
@pytest.mark.slow
def test_study_records_a_table_would_show_wrong_are_refused(tmp_path, capsys, change, expected):
    """A study's record without its count was tabulated at 1 (``ranks 1`` beside
    ``distmm-mpi@2ranks``, its series gone); a configuration twice in one run (two
    machines that started a study in the same second, the same CPU model, or a file copied
    twice) had its times averaged with the other's: each is refused in one line naming
    its line, before any output."""
    recs = [dict(r) for r in STUDY]
    write_jsonl(tmp_path / "ok.jsonl", recs)
    assert main(["report", str(tmp_path / "ok.jsonl"), "-o", str(tmp_path / "ok")]) == 0
    capsys.readouterr()
    change(recs)
    bad = write_jsonl(tmp_path / "s.jsonl", recs)
    assert main(["report", str(bad), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("distmm report: error: ")
    assert expected.format(d=tmp_path) in err, err
    assert not (tmp_path / "out").exists()


def test_study_records_of_two_runs_or_two_devices_are_apart(tmp_path, capsys):
    """The same configuration in two runs (a study re-run into its file), or in one run
    on two devices: separate series and no refusal; a record without a study (another
    benchmark's) may repeat a configuration in its run. A record of a tree with uncommitted
    changes is noted."""
    again = [dict(r, run="20261206T200000Z", host="node-b", seconds=r["seconds"] * 2)
             for r in STUDY]
    other = [dict(r, device="other-cpu") for r in STUDY]
    plain = [record("distmm-x@2ranks", s, ranks=2) for s in (1.0, 3.0)]
    again[0]["commit_dirty"] = True
    recs = write_jsonl(tmp_path / "r.jsonl", STUDY + again + other + plain)
    assert main(["report", str(recs), "-o", str(tmp_path / "out")]) == 0
    assert ("- 1 records were measured on a tree with uncommitted changes (`commit_dirty`)"
            in (tmp_path / "out" / "report.md").read_text())
    (series,) = [s for s in scaling(read_inputs([str(recs)])[0], "strong")
                 if s.run == "20261206T200000Z"]
    assert [p.seconds for p in series.points] == [0.16, 0.1]
    assert len(scaling(read_inputs([str(recs)])[0], "strong")) == 3


def test_a_figure_of_ranks_and_workers_series_names_both(tmp_path, monkeypatch):
    """An MPI series over ranks and a Dask one over workers in one figure: its x axis says
    "ranks or workers" (it said the first series' unit alone: "workers" under the ranks)."""
    import matplotlib.axes

    labels = []
    original = matplotlib.axes.Axes.set

    def spy(self, **kwargs):
        labels.append(kwargs.get("xlabel"))
        return original(self, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "set", spy)
    dask = [study_record(f"distmm-dask@{w}workers", t, workers=w, m=301, n=257, k=283)
            for w, t in ((1, 0.09), (2, 0.06))]
    recs = write_jsonl(tmp_path / "r.jsonl", STUDY + dask)
    assert main(["report", str(recs), "-o", str(tmp_path / "out"), "--only", "strong"]) == 0
    assert labels.count("ranks or workers") == 2, labels  # speedup and efficiency


def test_missing_file_and_bad_profile(tmp_path, capsys):
    recs = write_jsonl(tmp_path / "r.jsonl", STRONG)
    assert main(["report", str(recs), str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (f"distmm report: error: No such file or directory: "
                                       f"{tmp_path / 'nope.jsonl'}\n")
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"x": {"format": "other"}}))
    assert main(["report", str(prof), "-o", str(tmp_path / "o")]) == 2
    assert "p.json: p x is not a distmm-profile-1 profile" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="no benchmark records"):
        read_inputs([str(write_jsonl(tmp_path / "e.jsonl", []))])


@pytest.mark.parametrize("profile_data, expected", [
    ({"format": "distmm-profile-1"}, "p.json: profile p has no 'ranks'"),
    ({"format": "distmm-profile-1", "ranks": []}, "'ranks' must be a non-empty list"),
    ({"format": "distmm-profile-1", "ranks": [{}]}, "ranks[0] must be an object with a 'rank'"),
    ({"format": "distmm-profile-1", "ranks": [{"rank": 0}]}, "rank 0 has no 'spans' list"),
    ({"format": "distmm-profile-1", "ranks": [{"rank": 0, "spans": [
        {"phase": "read", "start": 2, "end": 1}]}]}, "rank 0 span 0 must have a string 'phase'"),
    ({"run-4": {"format": "distmm-profile-1", "ranks": [{"rank": 1, "spans": [
        {"phase": "read", "start": "0", "end": 1}]}]}}, "profile p run-4: rank 1 span 0"),
], ids=["no-ranks", "empty-ranks", "rank-without-number", "no-spans", "end-before-start",
        "named-start-text"])
def test_malformed_profile_one_line_exit_2_and_no_folders(tmp_path, capsys, profile_data,
                                                         expected):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(profile_data))
    out = tmp_path / "parent" / "sub" / "out"
    assert main(["report", str(prof), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"distmm report: error: {prof}") and expected in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


def test_a_failed_report_removes_the_folders_it_made(tmp_path, monkeypatch):
    """Drawing fails after the staging folder exists: the output's parents that the run
    made go again, a parent that was there stays."""
    import distmm.cli.report as report

    recs = write_jsonl(tmp_path / "r.jsonl", STRONG)
    (tmp_path / "kept").mkdir()

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "_figures", broken)
    assert main(["report", str(recs), "-o", str(tmp_path / "kept" / "a" / "b" / "out")]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "r.jsonl"]
    assert list((tmp_path / "kept").iterdir()) == []


@pytest.mark.parametrize("change, expected", [
    ({"seconds": "abc"}, "field 'seconds' must be a positive finite number or null, got 'abc'"),
    ({"seconds": -1.0}, "field 'seconds' must be a positive finite number or null, got -1.0"),
    ({"seconds": 0}, "field 'seconds'"),
    ({"m": "x"}, "field 'm' must be an integer, got 'x'"),
    ({"n": -5}, "field 'n' must be an integer from 0 to 2**63 - 1, got -5"),
    ({"k": 2048.5}, "field 'k' must be an integer"),
    ({"m": True}, "field 'm' must be an integer"),
    ({"variant": {}}, "field 'variant' must be a string, got {}"),
    ({"device": None}, "field 'device' must be a string"),
    ({"run": [1]}, "field 'run' must be a string or an integer"),
    ({"dtype": "foo"}, "field 'dtype' must be a numeric dtype numpy knows"),
    ({"dtype": "U8"}, "field 'dtype' must be a numeric dtype numpy knows"),
    ({"tflops": "x"}, "field 'tflops' must be a finite number"),
    ({"ranks": "2"}, "field 'ranks' must be an integer or null"),
    ({"ranks": 0}, "field 'ranks' must be at least 1"),
    ({"emulated_nodes": 0}, "field 'emulated_nodes'"),
    ({"all_seconds": "x"}, "field 'all_seconds'"),
], ids=["seconds-text", "seconds-negative", "seconds-zero", "m-text", "n-negative", "k-float",
        "m-bool", "variant-object", "device-null", "run-list", "dtype-foo", "dtype-text",
        "tflops-text", "ranks-text", "ranks-zero", "emulated-nodes-zero", "all-seconds-text"])
def test_record_fields_of_the_wrong_type_or_range(tmp_path, capsys, change, expected):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(STRONG[0]) + "\n" + json.dumps({**STRONG[1], **change}) + "\n")
    assert main(["report", str(bad), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"distmm report: error: {bad}:2: "), err
    assert expected in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_not_utf8_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(json.dumps(STRONG[0]).encode() + b"\n\xff\xfe\x00abc\n")
    prof = tmp_path / "bad.json"
    prof.write_bytes(b'{"format": "\xff"}')
    for path, where in ((bad, f"{bad}:2"), (prof, f"{prof}")):
        assert main(["report", str(path), "-o", str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err == f"distmm report: error: {where}: not UTF-8 text\n"
    assert not (tmp_path / "out").exists()


def test_without_matplotlib_one_line_exit_2(tmp_path, capsys, monkeypatch):
    recs = write_jsonl(tmp_path / "r.jsonl", STRONG)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["report", str(recs), "-o", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == ('distmm report: error: distmm report needs matplotlib: '
                                       'pip install "distmm[bench]"\n')
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- roofline


def gpu_record(variant, seconds=None, *, benchmark="kernels", m=1024, n=1024, k=1024,
               dtype="float32", **extra):
    tflops = 2 * m * n * k / seconds / 1e12 if seconds else None
    return dict(run=extra.pop("run", "g1"), benchmark=benchmark, variant=variant,
                device="test-gpu", dtype=dtype, m=m, n=n, k=k, seconds=seconds, tflops=tflops,
                gpus=extra.pop("gpus", 1), **extra)


# two cuBLAS runs per dtype (the best counts), two copy probes, file read and write of
# mpi-batch, and distmm runs: one on one GPU per benchmark, one on two GPUs (not a point)
ROOF = [gpu_record("cublas", 0.0001, run="a"), gpu_record("cublas", 0.00008, run="b"),
        gpu_record("cublas", 0.0002, dtype="float64"),
        dict(gpu_record("ceiling-copy", 0.001, m=2**28, n=1, k=1), tflops=None, gbps=2500.0),
        dict(gpu_record("ceiling-copy", 0.001, m=2**28, n=1, k=1, run="b"), tflops=None,
             gbps=3100.0),
        gpu_record("read-cat", 0.004, benchmark="mpi-batch", m=2048, n=2048, k=2048),
        gpu_record("write-dd-fsync", 0.008, benchmark="mpi-batch", m=2048, n=2048, k=2048),
        gpu_record("distmm-raw-warptile", 0.0001), gpu_record("distmm-raw-warptile", 0.0004, m=512),
        gpu_record("distmm-mpi@2ranks", 0.00006, ranks=2, gpus=2),
        gpu_record("batch-1", 0.05, benchmark="mpi-batch", m=2048, n=2048, k=2048, ranks=1)]


def test_ceilings_are_the_best_measured_per_device_and_kind():
    (device, found), = ceilings(ROOF + STRONG).items()  # test-cpu has no ceiling at all
    assert device == "test-gpu"
    got = {c.name: (c.kind, c.dtype, c.value, c.scope, c.run) for c in found}
    a_b, c_bytes, gemm = 2 * 2048 * 2048 * 4, 2048 * 2048 * 4, 2 * 1024**3
    approx = pytest.approx
    assert got == {
        "cuBLAS float32": ("compute", "float32", approx(gemm / 0.00008 / 1e12), None, "b"),
        "cuBLAS float64": ("compute", "float64", approx(gemm / 0.0002 / 1e12), None, "g1"),
        "device memory (copy)": ("memory", None, 3100.0, None, "b"),
        "file read (cat A B)": ("file-read", None, approx(a_b / 0.004 / 1e9), "mpi-batch", "g1"),
        "file write (dd, fsync)": ("file-write", None, approx(c_bytes / 0.008 / 1e9), "mpi-batch",
                                   "g1"),
    }
    memory, read, write = (c for c in found if c.kind != "compute")
    square = dict(m=1024, n=1024, k=1024, dtype="float32")
    assert intensity(square, memory) == 2 * 1024**3 / (3 * 1024**2 * 4)
    assert intensity(square, read) == 2 * 1024**3 / (2 * 1024**2 * 4)
    assert intensity(square, write) == 2 * 1024**3 / (1024**2 * 4)
    # a resumed run's seconds finish part of a product: no throughput, no point
    resumed = gpu_record("resumed-1", 0.00001, benchmark="mpi-resume", ranks=1)
    points = roofline_points(ROOF + [resumed], found)
    # the largest size of warptile, not its 512 run; batch-1 bound by the slow write, not memory
    assert [(p.benchmark, p.variant, p.size, p.ceiling.kind) for p in points] == [
        ("kernels", "distmm-raw-warptile", (1024,) * 3, "memory"),
        ("mpi-batch", "batch-1", (2048,) * 3, "file-write")]
    assert points[0].tflops == pytest.approx(2 * 1024**3 / 0.0001 / 1e12)
    assert points[1].intensity == pytest.approx(2 * 2048**3 / c_bytes)


def test_reduced_precisions_have_their_own_ceilings_and_points():
    """A bf16 cuBLAS record (dtype float32, precision bf16) is no float32 ceiling; a bf16
    kernel sits under the bf16 ceiling, at the intensity of 2-byte operands."""
    from distmm.cli.report_roofline import roof

    records = ROOF + [gpu_record("cublas-bf16", 0.00001, precision="bf16"),
                      gpu_record("distmm-raw-mma_bf16", 0.00004, precision="bf16")]
    (_, found), = ceilings(records).items()
    compute = {c.name: c.value for c in found if c.kind == "compute"}
    gemm = 2 * 1024**3
    assert compute["cuBLAS float32"] == pytest.approx(gemm / 0.00008 / 1e12)
    assert compute["cuBLAS bf16"] == pytest.approx(gemm / 0.00001 / 1e12)
    (point,) = [p for p in roofline_points(records, found) if p.variant.endswith("mma_bf16")]
    assert point.dtype == "bf16"
    assert point.intensity == pytest.approx(gemm / (3 * 1024**2 * 2))
    assert roof(point, found) == pytest.approx(min(gemm / 0.00001 / 1e12,
                                                   3100.0 * point.intensity / 1e3))


@pytest.mark.slow
def test_command_draws_the_roofline_with_the_records_ceilings(tmp_path):
    recs = write_jsonl(tmp_path / "roof.jsonl", ROOF + STRONG + [record("numpy", 4.0, ranks=1)])
    out = tmp_path / "report"
    assert main(["report", str(recs), "-o", str(out)]) == 0
    png = (out / "roofline-test-gpu.png").read_bytes()
    assert png.startswith(PNG) and len(png) > 10_000
    text = (out / "report.md").read_text()
    assert "![roofline-test-gpu.png](roofline-test-gpu.png)" in text
    found = {c.name: c for c in ceilings(ROOF)["test-gpu"]}
    for name, unit, rule, scope in (("cuBLAS float32", "TFLOP/s", "-", "every run"),
                                    ("device memory (copy)", "GB/s", "A+B+C once", "every run"),
                                    ("file read (cat A B)", "GB/s", "A+B", "mpi-batch runs"),
                                    ("file write (dd, fsync)", "GB/s", "C", "mpi-batch runs")):
        c = found[name]
        assert (f"| test-gpu | {name} | {c.value:.4g} | {unit} | {rule} | {scope} | "
                f"{c.variant}, run {c.run} |") in text
    # batch-1: 2*2048^3 / 0.05 s = 0.3436 TFLOP/s at 2*2048^3 / (2048^2 * 4) = 1024 FLOP per
    # byte of C; its roof is the write ceiling (2.097 GB/s x 1024 = 2.147 TFLOP/s: 16%), below
    # the read's (8.389 GB/s x 512), device memory's and cuBLAS float32's 26.84 TFLOP/s
    write = found["file write (dd, fsync)"].value
    assert write * 1024 / 1e3 < found["file read (cat A B)"].value * 512 / 1e3
    rate = 2 * 2048**3 / 0.05 / 1e12
    assert (f"| test-gpu | mpi-batch | batch-1 | float32 | 2048x2048x2048 | {rate:.4g} | 1024 | "
            f"file write (dd, fsync) | {write * 1024 / 1e3:.4g} | "
            f"{rate / (write * 1024 / 1e3):.0%} |") in text
    assert "| file write (dd, fsync) | 2.147 | 16% |" in text
    # test-cpu has a numpy reference but no bandwidth ceiling: no figure, a note
    assert not (out / "roofline-test-cpu.png").exists()
    assert ("- No roofline for test-cpu: its records have no bandwidth (ceiling-copy, read-cat "
            "or write-dd) ceiling.") in text


def host_numpy(seconds, **extra):
    """A GPU study's numpy reference as ``distmm bench`` writes it: run on the host's CPU
    (threads, no ``gpus``) yet named after the study's device, the GPU."""
    r = gpu_record("numpy", seconds, benchmark="study", engine="reference", threads=16, **extra)
    del r["gpus"]
    return r


# a GPU study (distmm bench, device "gpu") with numpy among its references and no cuBLAS, on a
# GPU whose device copy bench/kernels.py measured: numpy at 10.74 TFLOP/s is the host CPU's
# rate, distmm's local engine on the GPU runs 42.95 TFLOP/s
COPY = dict(gpu_record("ceiling-copy", 0.001, m=2**28, n=1, k=1), tflops=None, gbps=3100.0)
GPU_STUDY = [COPY, host_numpy(0.0002), host_numpy(0.0004, dtype="float64"),
             gpu_record("distmm-local", 0.00005, benchmark="study", engine="local"),
             gpu_record("distmm-local", 0.0001, benchmark="study", engine="local",
                        dtype="float64")]


def test_numpy_is_a_ceiling_of_a_cpu_never_of_a_gpu():
    from distmm.cli.report_roofline import roof

    gemm = 2 * 1024**3
    # no cuBLAS: the GPU has no compute ceiling at all (was numpy's, the roof of its runs)
    assert [c.name for c in ceilings(GPU_STUDY)["test-gpu"]] == ["device memory (copy)"]
    # with cuBLAS float32: the float32 roof is cuBLAS's; float64 has none (was numpy's 5.4)
    cublas = gpu_record("cublas", 0.00004, benchmark="study", engine="reference")
    found = ceilings(GPU_STUDY + [cublas])["test-gpu"]
    assert [c.name for c in found] == ["cuBLAS float32", "device memory (copy)"]
    roofs = {p.dtype: roof(p, found) for p in roofline_points(GPU_STUDY, found)}
    assert roofs == {"float32": pytest.approx(gemm / 0.00004 / 1e12), "float64": None}
    # a CPU study's records (no gpus): numpy's rate is the CPU's ceiling and its runs' roof
    cpu = [{**{k: v for k, v in r.items() if k != "gpus"}, "device": "test-cpu"}
           for r in GPU_STUDY[:3] + [
               gpu_record("distmm-local", 0.0004, benchmark="study", engine="local"),
               gpu_record("distmm-local", 0.0016, benchmark="study", engine="local",
                          dtype="float64")]]
    found = ceilings(cpu)["test-cpu"]
    assert [(c.name, c.value) for c in found] == [
        ("numpy float32", pytest.approx(gemm / 0.0002 / 1e12)),
        ("numpy float64", pytest.approx(gemm / 0.0004 / 1e12)), ("device memory (copy)", 3100.0)]
    assert [(p.dtype, p.tflops / roof(p, found)) for p in roofline_points(cpu, found)] == [
        ("float32", pytest.approx(0.5)), ("float64", pytest.approx(0.25))]


def test_report_gives_no_gpu_a_roof_from_numpy(tmp_path):
    """No "of roof" above 100%: a GPU without cuBLAS gets no roofline, one with cuBLAS float32
    only no float64 roof, each with a note saying why."""
    cublas = dict(gpu_record("cublas", 0.00004, benchmark="study", engine="reference"),
                  device="other-gpu")
    records = GPU_STUDY + [dict(r, device="other-gpu") for r in GPU_STUDY] + [cublas]
    out = tmp_path / "report"
    assert main(["report", str(write_jsonl(tmp_path / "r.jsonl", records)), "-o", str(out),
                 "--only", "roofline", "--no-html"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "roofline-other-gpu.png"]
    text = (out / "report.md").read_text()
    assert ("- No roofline for test-gpu: its records have no compute (a cublas reference or an "
            "FMA probe; its numpy reference ran on the host's CPU, not on this GPU) ceiling."
            ) in text
    assert ("- No roof for the float64 runs of other-gpu: its records have no compute ceiling "
            "of float64 (a cublas reference or an FMA probe; its numpy reference ran on the "
            "host's CPU, not on this GPU).") in text
    assert "| numpy" not in text  # no numpy ceiling in the table
    rows = {tuple(line.split(" | ")[:4]): line.split(" | ")[-2:] for line in text.splitlines()
            if "| study | distmm-local |" in line}
    # distmm-local float32 on other-gpu: 42.95 of cuBLAS's 53.69 TFLOP/s (was numpy's 10.74:
    # 400%); float64: no roof (was numpy's 5.369: 400%)
    assert rows == {("| other-gpu", "study", "distmm-local", "float32"): ["53.69", "80% |"],
                    ("| other-gpu", "study", "distmm-local", "float64"): ["-", "- |"]}


# ---------------------------------------------------------------- predicted against measured


def test_model_errors_are_computed_from_the_committed_records():
    lines = [json.loads(line) for line in MODEL.read_text().splitlines() if line.strip()]
    rows = model_rows(lines)
    assert len(rows) == len(lines) == 221
    for row in rows:
        r = row.record
        assert row.error == (r["predicted_seconds"] - r["seconds"]) / r["seconds"]
        assert row.error == pytest.approx(r["error"], rel=1e-12)
        assert row.role == r["role"]
    assert sum(abs(r.error) <= 0.15 for r in rows if r.role == "held-out") == 160


def test_command_on_committed_model_records(tmp_path):
    out = tmp_path / "model"
    assert main(["report", str(MODEL), "-o", str(out)]) == 0
    text = check_folder(out, {"predicted-vs-measured.png"})  # model records feed no other figure
    # (17.66 - 19.04) / 19.04 = -7.3%; (0.1681 - 0.547) / 0.547 = -69.3%
    assert ("| batch mpirun-4 (batch) | NVIDIA H200 | float32 | 65536x65536x65536 | 19.04 | "
            "17.66 | -7.3% | held-out |") in text
    assert ("| mpi gpu 1 rank(s) on 1 GPU(s) (mpi) | NVIDIA H200 | float32 | 16384x16384x16384 | "
            "0.547 | 0.1681 | -69.3% | fit |") in text
    for r in map(json.loads, MODEL.read_text().splitlines()):
        error = (r["predicted_seconds"] - r["seconds"]) / r["seconds"]
        cells = f'{r["seconds"]:.4g} | {r["predicted_seconds"]:.4g} | {error:+.1%} | {r["role"]}'
        assert f" | {cells} |" in text


def test_prediction_extends_a_series_labelled_predicted(tmp_path):
    forecast = dict(record("distmm-mpi-8", 1.0, ranks=8, run="model"), seconds=None,
                    tflops=None, predicted_seconds=2.5, role="predicted")
    compared = record("distmm-mpi-2", 5.0, ranks=2, run="v", predicted_seconds=5.5, role="held-out")
    recs = STRONG + [forecast, compared]
    (series,) = scaling(recs, "strong")  # the compared record restates a measurement: not a point
    assert [(p.count, p.seconds, p.predicted) for p in series.points] == [
        (1, 8.0, False), (2, 5.0, False), (4, 4.0, False), (8, 2.5, True)]
    assert series.points[-1].speedup == pytest.approx(3.2)
    assert [(r.role, r.measured, r.predicted, r.error) for r in model_rows(recs)] == [
        ("held-out", 5.0, 5.5, pytest.approx(0.1)), ("predicted", None, 2.5, None)]
    out = tmp_path / "report"
    assert main(["report", str(write_jsonl(tmp_path / "r.jsonl", recs)), "-o", str(out)]) == 0
    text = check_folder(out, {"tflops-scaling-test-cpu.png", "strong-scaling-test-cpu.png",
                              "predicted-vs-measured.png"})
    assert "| ranks 8 | 2.5 (predicted) | 3.20 | 40.0% |" in text
    assert ("| distmm-mpi-8 | test-cpu | float64 | 1000x1001x999 | - | 2.5 (predicted) | - | "
            "predicted |") in text
    assert ("| distmm-mpi-2 | test-cpu | float64 | 1000x1001x999 | 5 | 5.5 | +10.0% | held-out |"
            in text)


def test_no_ceilings_and_no_predictions_give_notes_not_figures(tmp_path):
    out = tmp_path / "report"
    assert main(["report", str(write_jsonl(tmp_path / "r.jsonl", STRONG)), "-o", str(out)]) == 0
    text = check_folder(out, {"tflops-scaling-test-cpu.png", "strong-scaling-test-cpu.png"})
    assert ("- No roofline for test-cpu: its records have no compute (a cublas/numpy reference or "
            "an FMA probe) and bandwidth (ceiling-copy, read-cat or write-dd) ceiling.") in text
    assert "- No predicted against measured figure: no record has predicted_seconds." in text
    assert "Roofline ceilings" not in text and "Predicted against measured" not in text


def test_invalid_records_are_left_out_and_counted(tmp_path):
    """A record marked ``invalid`` (kept in its file for the history) is in no table: here
    a distmm-mpi figure twice as fast as its own run's, which would change the strong row."""
    bad = dict(record("distmm-mpi", 1.0, ranks=2), invalid="the kernel was wrong")
    out = tmp_path / "report"
    assert main(["report", str(write_jsonl(tmp_path / "r.jsonl", STRONG + [bad])), "-o",
                 str(out)]) == 0
    text = check_folder(out, {"tflops-scaling-test-cpu.png", "strong-scaling-test-cpu.png"})
    assert "| ranks 2 | 5 | 1.60 | 80.0% |" in text
    assert "- 1 records marked invalid were left out (each record's `invalid` says why)." in text


def test_only_and_no_html_and_a_bad_section(tmp_path, capsys):
    recs = write_jsonl(tmp_path / "r.jsonl", ROOF + STRONG)
    out = tmp_path / "report"
    assert main(["report", str(recs), "-o", str(out), "--only", "roofline", "--no-html"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "roofline-test-gpu.png"]
    text = (out / "report.md").read_text()
    assert "Roofline ceilings" in text and "Strong scaling" not in text
    assert "predicted_seconds" not in text  # the model section was not asked for
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(recs), "-o", str(tmp_path / "o"), "--only", "roofline,tflopz"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown section 'tflopz': choose from tflops, strong" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_docs_figures_are_the_report_of_the_committed_records(tmp_path, monkeypatch):
    """docs/figures is what the command at the top of docs/performance.md makes today."""
    root = RESULTS.parent.parent
    monkeypatch.chdir(root)
    doc = (root / "docs" / "performance.md").read_text()
    command = ("distmm report bench/results/*.jsonl -o docs/figures --only roofline,model "
               "--no-html --overwrite")
    assert command in doc
    out = tmp_path / "figures"
    paths = sorted(str(p.relative_to(root)) for p in RESULTS.glob("*.jsonl"))
    assert main(["report", *paths, "-o", str(out), "--only", "roofline,model", "--no-html"]) == 0
    committed = root / "docs" / "figures"
    assert sorted(p.name for p in committed.iterdir()) == sorted(p.name for p in out.iterdir())
    body = lambda text: text.split("\n", 3)[3]  # after the line naming the inputs
    rendered = body((committed / "report.md").read_text())
    assert rendered == body((out / "report.md").read_text()), f"stale: run {command}"
    copied = [line for line in doc.splitlines() if line.startswith("| NVIDIA ")]
    assert len(copied) == 12 and all(f"\n{line}\n" in rendered for line in copied)
    for png in committed.glob("*.png"):
        assert f"figures/{png.name}" in doc, png.name
    assert sum(p.stat().st_size for p in committed.iterdir()) < 400 * 1024
