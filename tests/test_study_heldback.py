"""Scaling-study commands on cases a user meets that the other study tests leave out: records
a run wrote for a product off its float64 check, or marked invalid, kept out of the model's
comparison and calibration as the report keeps them out. Real files, written fresh by each
test; the commands run in this process."""
from __future__ import annotations

import json

import numpy as np
import pytest

from distmm.cli import main

RUN = "20261207T000000Z"
BASE = {"benchmark": "scaling", "device": "AMD EPYC", "dtype": "float64", "relerr": 0.0,
        "commit": "abc", "date": "2026-12-07", "study": "s", "series": "strong", "host": "h",
        "relerr_ok": True}


def record(variant: str, m: int, n: int, k: int, seconds: float, run: str = RUN,
           **extra) -> dict:
    return {"run": run, "variant": variant, **BASE, "m": m, "n": n, "k": k,
            "seconds": seconds, "tflops": 2 * m * n * k / seconds / 1e12, **extra}


def write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_model_validate_leaves_out_a_run_off_its_check_and_an_invalid_one(tmp_path, capsys):
    """A later run whose product failed its float64 check (``relerr_ok`` false, as distmm
    bench writes it) or that is marked ``invalid`` measured no result: the comparison takes
    the run that did (before, it took the latest run, the wrong one, as the measurement)."""
    rng = np.random.default_rng()
    m, n, k = (int(x) for x in rng.integers(33, 97, 3) | 1)
    good = float(rng.uniform(1e-3, 2e-3))
    wrong = good / float(rng.uniform(50, 100))  # fast: its product was wrong
    recs = [record("distmm-mpi@2ranks", m, n, k, good, engine="mpi", ranks=2),
            record("distmm-mpi@2ranks", m, n, k, wrong, run="20261207T000001Z", engine="mpi",
                   ranks=2, relerr=0.9, relerr_ok=False),
            record("distmm-mpi@2ranks", m, n, k, wrong, run="20261207T000002Z", engine="mpi",
                   ranks=2, invalid="a kernel later found wrong")]
    path = write(tmp_path / "r.jsonl", recs)
    out = tmp_path / "v.jsonl"
    assert main(["model", "--validate", path, "--device", "cpu", "-o", str(out)]) == 0
    capsys.readouterr()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1, rows
    assert rows[0]["seconds"] == good, rows[0]


def test_calibrate_from_records_leaves_out_references_off_their_check_or_invalid(tmp_path,
                                                                                 capsys):
    """numpy references of a CPU: one marked invalid and one off its float64 check (a
    rate a thousand times the others) do not make the calibration's GEMM rate."""
    rng = np.random.default_rng()
    sizes = [int(s) for s in rng.integers(65, 255, 3) | 1]
    rate = float(rng.uniform(2e10, 4e10))  # flop/s on the record's threads
    good, bad, wrong = sizes
    recs = [record("numpy", good, good, good, 2.0 * good**3 / rate, threads=2,
                   engine="reference"),
            record("numpy", bad, bad, bad, 2.0 * bad**3 / rate / 1000, threads=2,
                   engine="reference", invalid="timer broken"),
            record("numpy", wrong, wrong, wrong, 2.0 * wrong**3 / rate / 1000, threads=2,
                   engine="reference", relerr=0.5, relerr_ok=False)]
    path = write(tmp_path / "r.jsonl", recs)
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--from-records", path, "-o", str(out)]) == 0
    capsys.readouterr()
    peak = json.loads(out.read_text())["gemm"]["cpu:float64"]["peak"]
    assert peak <= 1.1 * rate / 2, (peak, rate / 2)  # a core's share of the measured rate


@pytest.mark.slow
def test_a_product_with_nan_writes_a_record_every_reader_takes(tmp_path, capsys, monkeypatch):
    """A configuration whose product holds a NaN (a broken kernel) fails its check, and its
    record is still written: with relerr null and ``relerr_nonfinite`` (before, ``relerr:
    NaN``, which is no JSON, and every reader, the report and the next study appending to the
    file, refused the whole file)."""
    import distmm
    from distmm.cli.records import read_records

    real = distmm.matmul

    def broken(a, b, **kw):
        out = np.array(real(a, b, **kw))
        out[out.shape[0] // 2, 0] = np.nan
        return out

    monkeypatch.setattr(distmm, "matmul", broken)
    rng = np.random.default_rng()
    m, n, k = (int(x) for x in rng.integers(9, 40, 3) | 1)
    study = tmp_path / "s.toml"
    study.write_text(f'repeats = 1\ncheck_rows = 0\nreferences = ["numpy"]\n[[series]]\n'
                     f'kind = "strong"\nengines = ["local"]\ncounts = [1, 2]\n'
                     f'sizes = [[{m}, {n}, {k}]]\n')
    out = tmp_path / "r.jsonl"
    assert main(["bench", str(study), "-o", str(out)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert sum("relerr nan ABOVE BOUND" in line for line in lines) == 2, lines
    recs = [r for _, r in read_records(out)]
    assert [(r["variant"], r["relerr"], r.get("relerr_nonfinite"), r["relerr_ok"])
            for r in recs] == [("numpy", 0.0, None, True),
                               ("distmm-local@1workers", None, "nan", False),
                               ("distmm-local@2workers", None, "nan", False)]
    assert main(["report", str(out), "-o", str(tmp_path / "rep")]) == 0
    assert "2 records whose product failed its float64 check" in (
        tmp_path / "rep" / "report.md").read_text()
    monkeypatch.setattr(distmm, "matmul", real)  # the next run appends to the file
    assert main(["bench", str(study), "-o", str(out)]) == 0
    assert len(list(read_records(out))) == 6


@pytest.mark.parametrize("argv", [
    ["model", "64", "48", "32", "--gpus", "1,2", "-o", ""],
    ["model", "--validate", "{records}", "--device", "cpu", "-o", ""],
    ["model", "--validate", ""],
    ["model", "64", "48", "32", "--gpus", "1,2", "--calibration", ""],
    ["model", "64", "48", "32", "--gpus", "1,2", "-o", "{tmp}/p.jsonl", "--variant", ""],
    ["model", "64", "48", "32", "--gpus", "1,2", "-o", "{tmp}/p.jsonl",
     "--benchmark", ""],
    ["calibrate", "--from-records", "", "-o", "{tmp}/c.json"],
    ["calibrate", "--from-records", "{records}", "--machine", "", "-o", "{tmp}/c.json"],
    ["report", "", "-o", "{tmp}/rep"],
    ["report", "{records}", "-o", ""],
    ["bench", ""],
    ["bench", "{tmp}/s.toml", "-o", ""],
], ids=["model-o", "validate-o", "validate", "calibration", "variant", "benchmark",
        "from-records", "machine", "report-records", "report-o", "bench-study", "bench-o"])
def test_an_empty_path_or_name_is_refused_in_one_line(tmp_path, capsys, argv):
    """An empty value is refused in one line naming it as empty, status 2, nothing written
    (before, ``distmm model -o ''`` printed its table and wrote nothing with status 0, and
    ``--calibration ''``, ``--variant ''``, ``--benchmark ''`` took their defaults; the report
    and the study file named the current folder ``.``)."""
    m, n, k = 96, 80, 72
    records = write(tmp_path / "r.jsonl",
                    [record("distmm-mpi@1ranks", m, n, k, 2e-3, engine="mpi", ranks=1),
                     record("numpy", m, n, k, 1e-4, threads=2, engine="reference")])
    (tmp_path / "s.toml").write_text('[[series]]\nkind = "strong"\nengines = ["local"]\n'
                                     'counts = [1]\nsizes = [8]\n')
    before = sorted(p.name for p in tmp_path.iterdir())
    try:
        code = main([a.format(records=records, tmp=tmp_path) for a in argv])
    except SystemExit as exc:  # argparse's refusal
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"distmm {argv[0]}: error: "), err
    assert "empty" in err or "''" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("top, key", [
    ('name = "run\\u0000one"', "name"), ('name = "run\\tone"', "name"),
    ('benchmark = ""', "benchmark"), ('benchmark = "a\\nb"', "benchmark"),
], ids=["name-nul", "name-tab", "benchmark-empty", "benchmark-newline"])
def test_a_name_no_records_file_can_carry_is_refused_before_anything_runs(tmp_path, capsys,
                                                                         monkeypatch, top, key):
    """A study name with a control character, an empty or multi-line benchmark: one line
    naming the key, status 2, nothing measured or written (before, a NUL in the name
    measured the configuration and then failed its record's write, status 1; the others
    ran)."""
    monkeypatch.chdir(tmp_path)
    study = tmp_path / "s.toml"
    study.write_text(f'{top}\nrepeats = 1\n[[series]]\nkind = "strong"\nengines = ["local"]\n'
                     f'counts = [1]\nsizes = [9]\n')
    try:
        code = main(["bench", str(study)])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out)
    assert err.count("\n") == 1 and err.startswith(f"distmm bench: error: {study}: {key}: "), err
    assert [p.name for p in tmp_path.iterdir()] == ["s.toml"]


@pytest.mark.parametrize("fails", ["move-in", "remove-old"])
@pytest.mark.slow
def test_a_report_that_fails_at_its_swap_keeps_the_report_it_was_to_replace(
        tmp_path, capsys, monkeypatch, fails):
    """``--overwrite`` moves the old report aside, then the new one in: a failure there (a
    folder made there meanwhile, a signal) puts the old one back, and one while the old one
    is removed leaves no hidden folder (before, the old report was
    left in a hidden ``.rep.distmm-partial-...-old`` folder and ``-o`` was gone, or the
    hidden folder stayed)."""
    import pathlib
    import shutil

    rng = np.random.default_rng()
    m, n, k = (int(x) for x in rng.integers(9, 99, 3))
    records = write(tmp_path / "r.jsonl", [
        record(f"distmm-local@{p}workers", m, n, k, float(rng.uniform(1, 2)) / p,
               engine="local", workers=p) for p in (1, 2)])
    rep = tmp_path / "rep"
    assert main(["report", records, "-o", str(rep)]) == 0
    old = {p.name: p.read_bytes() for p in rep.iterdir()}
    (tmp_path / "r.jsonl").write_text((tmp_path / "r.jsonl").read_text().replace(
        '"date"', '"note": "second", "date"'))
    rename, rmtree = pathlib.Path.rename, shutil.rmtree

    def move(self, target):
        if fails == "move-in" and pathlib.Path(target) == rep and "-old" not in self.name:
            raise OSError(39, "Directory not empty", str(target))  # made there meanwhile
        return rename(self, target)

    def remove(path, *args, **kwargs):
        if fails == "remove-old" and str(path).endswith("-old"):
            monkeypatch.setattr(shutil, "rmtree", rmtree)
            raise OSError(13, "Permission denied", str(path))
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "rename", move)
    monkeypatch.setattr(shutil, "rmtree", remove)
    assert main(["report", records, "-o", str(rep), "--overwrite"]) != 0
    assert capsys.readouterr().err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl", "rep"]
    if fails == "move-in":
        assert {p.name: p.read_bytes() for p in rep.iterdir()} == old
    else:
        assert sorted(p.name for p in rep.iterdir()) == sorted(old)


@pytest.mark.parametrize("command", [["report", "{}", "-o", "{out}"],
                                     ["calibrate", "--from-records", "{}", "-o", "{out}"]],
                         ids=["report", "calibrate"])
def test_a_time_whose_flop_rate_overflows_is_refused_in_one_line(tmp_path, capsys, command):
    """A record's seconds so small (a subnormal, 5e-324) that 2*m*n*k / seconds is infinite:
    refused naming its line and field (before, the report's strong-scaling table showed a
    speedup and an efficiency of nan, and calibrate failed with numpy's "SVD did not
    converge in Linear Least Squares")."""
    rng = np.random.default_rng()
    m, n, k = (int(x) for x in rng.integers(9, 99, 3))
    path = write(tmp_path / "r.jsonl", [
        {**record("numpy", m, n, k, 1.0, threads=1, engine="reference"), "seconds": 5e-324,
         "tflops": None},
        record("numpy", m + 2, n, k, 1e-3, threads=1, engine="reference"),
        {**record("distmm-local@1workers", m, n, k, 1.0, engine="local", workers=1),
         "seconds": 5e-324, "tflops": None},
        record("distmm-local@2workers", m, n, k, 1.0, engine="local", workers=2)])
    out = tmp_path / "out"
    assert main([a.format(path, out=out) for a in command]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}:1: field 'seconds'" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]


def test_model_validate_never_replaces_its_own_records(tmp_path, capsys):
    """``distmm model --validate r.jsonl -o r.jsonl`` (or the same file by a link): refused
    in one line before anything is printed, the records untouched (before, the comparison
    replaced the measurements it was made from, status 0)."""
    rng = np.random.default_rng()
    m, n, k = (int(x) for x in rng.integers(9, 99, 3))
    path = write(tmp_path / "r.jsonl", [
        record(f"distmm-mpi@{p}ranks", m, n, k, float(rng.uniform(1e-3, 2e-3)), engine="mpi",
               ranks=p) for p in (1, 2)])
    (tmp_path / "link.jsonl").symlink_to(path)
    before = (tmp_path / "r.jsonl").read_bytes()
    for out in (path, str(tmp_path / "link.jsonl")):
        assert main(["model", "--validate", path, "--device", "cpu", "-o", out]) == 2
        out_, err = capsys.readouterr()
        assert out_ == "" and err.count("\n") == 1, (out_, err)
        assert "is one of the records it compares" in err, err
    assert (tmp_path / "r.jsonl").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "r.jsonl"]


def _cores() -> int:
    from distmm.config import available_cpus

    return available_cpus()


def _refused(tmp_path, capsys, monkeypatch, study, key):
    """``distmm bench study``: one line naming ``key``, status 2, nothing measured or
    written (a study the check lets through fails here at once, never runs)."""
    import distmm.cli.bench as bench

    def ran(self):
        raise AssertionError("the study ran")

    monkeypatch.setattr(bench._Runner, "run", ran)
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    try:
        code = main(["bench", str(study)])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out, err)
    assert err.count("\n") == 1 and err.startswith(f"distmm bench: error: {study}: {key}: "), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    return err


@pytest.mark.parametrize("engine, unit", [("local", "threads"), ("dask", "workers")])
def test_cpu_counts_beyond_this_machines_cores_are_refused_before_anything_runs(
        tmp_path, capsys, monkeypatch, engine, unit):
    """Local threads or Dask workers beyond the usable cores of a CPU study: refused naming
    the series' counts, the count and the cores (before, 64 Dask workers on 2 cores were
    still starting after a minute, and 64 local threads ran)."""
    cores = _cores()
    count = cores + int(np.random.default_rng().integers(1, 64))
    study = tmp_path / "s.toml"
    study.write_text(f'repeats = 1\n[[series]]\nkind = "strong"\nengines = ["local"]\n'
                     f'counts = [1]\nsizes = [9]\n[[series]]\nkind = "strong"\n'
                     f'engines = ["{engine}"]\ncounts = [1, {count}]\nsizes = [9]\n')
    err = _refused(tmp_path, capsys, monkeypatch, study, "series[1].counts")
    assert f"{count} {engine} {unit}, more than this machine's {cores} usable cores" in err, err
    assert "oversubscribe = true" in err, err


def test_oversubscribe_runs_local_threads_beyond_the_cores(tmp_path, capsys, monkeypatch):
    """``oversubscribe = true``: the study opts in, and its threads beyond the cores run;
    a value that is not a bool is refused naming the key."""
    rng = np.random.default_rng()
    m, n, k = (int(x) for x in rng.integers(9, 40, 3) | 1)
    count = _cores() + 1
    study = tmp_path / "s.toml"
    body = (f'repeats = 1\ncheck_rows = 0\nreferences = []\n[[series]]\nkind = "strong"\n'
            f'engines = ["local"]\ncounts = [{count}]\nsizes = [[{m}, {n}, {k}]]\n')
    study.write_text("oversubscribe = 1\n" + body)
    _refused(tmp_path, capsys, monkeypatch, study, "oversubscribe")
    study.write_text('oversubscribe = true\ndevice = "gpu"\n' + body.replace("local", "mpi"))
    _refused(tmp_path, capsys, monkeypatch, study, "oversubscribe")
    monkeypatch.undo()
    study.write_text("oversubscribe = true\n" + body)
    out = tmp_path / "r.jsonl"
    assert main(["bench", str(study), "-o", str(out)]) == 0
    capsys.readouterr()
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["variant"], r["threads"], r["relerr_ok"]) for r in recs] == [
        (f"distmm-local@{count}workers", count, True)]


@pytest.mark.parametrize("top, key, says", [
    ("repeats = 99999999999999999999", "repeats", "99999999999999999999 warm calls of every "
                                                  "configuration is more than a study runs "
                                                  "(at most 1000)"),
    ("repeats = 1001", "repeats", "(at most 1000)"),
    ('name = "{long}"', "name", "bytes is longer than a study name takes (at most 197"),
    ('name = "{wide}"', "name", "198 bytes is longer than a study name takes"),
], ids=["repeats-huge", "repeats-1001", "name-long", "name-multibyte"])
def test_a_study_that_would_not_end_or_not_be_written_is_refused(tmp_path, capsys, monkeypatch,
                                                                 top, key, says):
    """``repeats`` beyond 1000 (before, 99999999999999999999 ran without end) and a name
    over 197 bytes, too long for the records' file name on some device (before, 240
    characters measured the study, then failed with "File name too long", status 1): one
    line naming the key, status 2, before anything runs."""
    rng = np.random.default_rng()
    long = "s" * int(rng.integers(198, 300))
    top = top.format(long=long, wide="\u00e9" * 99)  # 2 bytes each in UTF-8
    study = tmp_path / "s.toml"
    study.write_text(f'{top}\n[[series]]\nkind = "strong"\nengines = ["local"]\ncounts = [1]\n'
                     f'sizes = [9]\n')
    err = _refused(tmp_path, capsys, monkeypatch, study, key)
    assert says in err, err


def test_a_file_stem_too_long_for_a_name_is_refused_naming_the_key(tmp_path, capsys,
                                                                  monkeypatch):
    """The default name is the file's stem: one that long is refused the same way, saying
    so (the study file's own name is shorter than the records' would be)."""
    study = tmp_path / ("t" * 200 + ".toml")
    study.write_text('[[series]]\nkind = "strong"\nengines = ["local"]\ncounts = [1]\n'
                     'sizes = [9]\n')
    err = _refused(tmp_path, capsys, monkeypatch, study, "name")
    assert "200 bytes" in err and "the file's stem" in err, err


def test_the_largest_repeats_and_name_are_taken():
    from distmm.cli.study import parse_study

    series = [{"kind": "strong", "engines": ["local"], "counts": [1], "sizes": [9]}]
    for name in ("n" * 197, "\u00e9" * 98):
        study = parse_study({"repeats": 1000, "name": name, "series": series})
        assert (study.repeats, study.name) == (1000, name)


REACHED = "the run was reached"


def _mpi_study(path, ranks: int, threads, top: str = "") -> None:
    """A CPU study of one MPI series at ``ranks``, ``threads_per_rank = threads``, launched
    by this Python (never launched: ``_no_launch``)."""
    import sys

    path.write_text(f'{top}repeats = 1\nreferences = []\nthreads_per_rank = {threads}\n'
                    f'mpiexec = ["{sys.executable}"]\n[[series]]\nkind = "strong"\n'
                    f'engines = ["mpi"]\ncounts = [{ranks}]\nsizes = [9]\n')


def _no_launch(monkeypatch):
    """The launch check passes without launching; the run stops the study at once, in one
    line: ``REACHED``."""
    import distmm.cli.bench as bench

    def ran(self):
        raise ValueError(REACHED)

    monkeypatch.setattr(bench, "_check_launches", lambda study, configs: None)
    monkeypatch.setattr(bench._Runner, "run", ran)


def test_mpi_threads_times_ranks_beyond_the_cores_are_refused_before_anything_runs(
        tmp_path, capsys, monkeypatch):
    """``threads_per_rank`` x ranks beyond the usable cores of a CPU study was neither
    refused nor warned (local threads and Dask workers were): one line naming the key, the
    configuration and the product, before anything runs, unless ``oversubscribe = true``."""
    rng = np.random.default_rng()
    cores = _cores()
    ranks = int(rng.integers(1, cores + 1))
    threads = cores // ranks + int(rng.integers(1, 8))  # at least 2, product beyond the cores
    study = tmp_path / "s.toml"
    _mpi_study(study, ranks, threads)
    _no_launch(monkeypatch)
    err = _refused(tmp_path, capsys, monkeypatch, study, "threads_per_rank")
    assert f"distmm-mpi@{ranks}ranks float64 9x9x9 (strong)" in err, err
    assert (f"{threads} threads x {ranks} ranks = {threads * ranks}, more than this machine's "
            f"{cores} usable cores" in err), err
    assert "oversubscribe = true" in err, err


@pytest.mark.parametrize("beyond, threads, top", [
    (0, '"share"', ""), (1, "1", ""), (1, '"share"', ""), (0, "2", "oversubscribe = true\n")],
    ids=["shared", "one-thread-ranks-beyond", "shared-ranks-beyond", "oversubscribe"])
@pytest.mark.slow
def test_mpi_ranks_alone_or_an_opted_in_product_reach_the_run(tmp_path, capsys, monkeypatch,
                                                              beyond, threads, top):
    """Ranks of one thread each beyond the cores stay with the launcher's slots, the shared
    threads never exceed the cores, and ``oversubscribe = true`` lets the product through:
    the study gets past its checks to its run."""
    study = tmp_path / "s.toml"
    _mpi_study(study, _cores() + beyond, threads, top)
    _no_launch(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", str(study)]) == 2
    out, err = capsys.readouterr()
    assert err == f"distmm bench: error: {REACHED}\n", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]
