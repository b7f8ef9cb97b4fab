"""Record files and the tuning cache as the command line reads and appends them: a bad record
refused in one line naming its file, line and field by every reader (``distmm report``,
``distmm model --validate``, ``distmm calibrate --from-records``), a record appended to a
file whose last line lacks its newline starting a line of its own, and ``distmm tune --show``
on a cache that is no cache. Real files, written fresh by each test."""
from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import time

import pytest

from distmm.cli import main
from distmm.cli.records import RecordWriter, append_record, load

RECORD = {"run": "r1", "benchmark": "scaling", "variant": "numpy", "device": "AMD EPYC",
          "dtype": "float64", "m": 512, "n": 512, "k": 512, "seconds": 0.01, "tflops": 0.0268,
          "relerr": 0.0, "commit": "abc", "date": "2026-01-01"}


def write_lines(path, *lines: bytes):
    path.write_bytes(b"".join(lines))
    return path


def good_line(**change) -> bytes:
    return (json.dumps({**RECORD, **change}) + "\n").encode()


@pytest.mark.parametrize("command", [
    ["calibrate", "--from-records", "{}", "-o", "{out}"],
    ["model", "--validate", "{}", "-o", "{out}"],
    ["report", "{}", "-o", "{out}"],
], ids=["calibrate", "model-validate", "report"])
@pytest.mark.parametrize("lines, expected", [
    ((b'{"foo": 1}\n',), "r.jsonl:1: the record lacks run, benchmark, variant, device, dtype"),
    ((good_line(), b"\xff\xfe\x00abc\n"), "r.jsonl:2: not UTF-8 text"),
    ((good_line(), good_line(seconds="abc")), "r.jsonl:2: field 'seconds' must be a positive "
                                             "finite number or null, got 'abc'"),
    ((good_line(m=-5),), "r.jsonl:1: field 'm' must be an integer from 0 to 2**63 - 1, got -5"),
    ((good_line(seconds=-1.0),), "r.jsonl:1: field 'seconds'"),
    ((good_line(dtype="foo"),), "r.jsonl:1: field 'dtype' must be a numeric dtype numpy knows"),
    ((good_line(variant={}),), "r.jsonl:1: field 'variant' must be a string, got {}"),
], ids=["not-a-record", "not-utf8", "seconds-text", "m-negative", "seconds-negative",
        "dtype-foo", "variant-object"])
def test_every_reader_refuses_a_bad_record_in_one_line(tmp_path, capsys, command, lines,
                                                       expected):
    path = write_lines(tmp_path / "r.jsonl", *lines)
    out = tmp_path / "out"
    argv = [a.format(path, out=out) for a in command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"distmm {command[0]}: error: {path}"), err
    assert expected in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]


@pytest.mark.parametrize("command", [
    ["calibrate", "--from-records", "{}", "-o", "{out}"],
    ["model", "--validate", "{}", "-o", "{out}"],
    ["report", "{}", "-o", "{out}"],
], ids=["calibrate", "model-validate", "report"])
@pytest.mark.parametrize("content", [
    good_line() + good_line(), good_line(), json.dumps([RECORD, RECORD]).encode(),
], ids=["json-lines", "one-record", "list-of-records"])
def test_every_reader_says_records_in_a_json_file_belong_in_a_jsonl(tmp_path, capsys, command,
                                                                    content):
    """A ``.json`` name means a profile or a trace to every reader: records in one are
    refused in one line that says records files are ``.jsonl``."""
    path = write_lines(tmp_path / "recs.json", content)
    argv = [a.format(path, out=tmp_path / "out") for a in command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"distmm {command[0]}: error: {path}: looks like benchmark records, and "
                   f"records files are JSON lines named .jsonl (one record per line); a .json "
                   f"file is read as a profile or a trace\n"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recs.json"]


def test_committed_records_pass_the_checks():
    from conftest import ROOT

    files = sorted((ROOT / "bench" / "results").glob("*.jsonl"))
    assert len(load(files)) > 4000


def test_append_starts_a_line_when_the_last_lacks_its_newline(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(good_line().rstrip(b"\n"))
    append_record(path, {**RECORD, "run": "r2"})
    writer = RecordWriter("scaling", "AMD EPYC", path=path)
    writer.add("numpy", "float64", 512, 512, 512, 0.02, None)
    assert [r["run"] for r in load([path])] == ["r1", "r2", writer.run]
    assert path.read_bytes().endswith(b"\n") and path.read_bytes().count(b"\n") == 3
    empty = tmp_path / "new.jsonl"
    append_record(empty, RECORD)
    assert empty.read_bytes() == good_line()


def test_append_to_a_file_that_is_not_a_regular_one(tmp_path):
    """``distmm bench -o /dev/null`` (or a pipe) takes the records: fsync, which such a file
    refuses with EINVAL, is left out there (before, every configuration failed after it was
    measured)."""
    append_record(os.devnull, RECORD)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        append_record(fifo, RECORD)
        assert os.read(reader, 4096) == good_line()
    finally:
        os.close(reader)


def _at_a_second_start() -> None:
    """Sleep until 0.05 s into the next second, so that what follows starts in one second."""
    time.sleep(1.05 - time.time() % 1.0)


def test_run_ids_of_one_process_are_unique_and_sortable_by_time(tmp_path, monkeypatch):
    """Two runs started in the same second (here two writers of one process) get two ids of
    the shape the records have always had, the later one after the first (before, both got
    the second they started in, and distmm report merged their records into one run)."""
    monkeypatch.setenv("DISTMM_COMMIT", "abc")
    _at_a_second_start()
    first = RecordWriter("scaling", "AMD EPYC", path=tmp_path / "r.jsonl")
    second = RecordWriter("scaling", "AMD EPYC", path=tmp_path / "r.jsonl")
    assert first.run < second.run and re.fullmatch(r"\d{8}T\d{6}Z", second.run), (first.run,
                                                                                   second.run)
    assert second.run <= time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


@pytest.mark.slow
def test_run_ids_of_processes_started_at_once_are_unique(tmp_path):
    """Three processes that each start a run in the same second (the same instant as far as
    they can): three ids, one per second (before, one id for the three)."""
    code = ("import sys, time; from distmm.cli.records import RecordWriter; "
            "time.sleep(max(0.0, float(sys.argv[1]) - time.time())); "
            "print(RecordWriter('scaling', 'AMD EPYC', path=sys.argv[2]).run)")
    start = str(int(time.time()) + 3 + 0.05)
    procs = [subprocess.Popen([sys.executable, "-c", code, start, str(tmp_path / "r.jsonl")],
                              stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, DISTMM_COMMIT="abc")) for _ in range(3)]
    ids = [proc.communicate(timeout=60)[0].strip() for proc in procs]
    assert len(set(ids)) == 3 and all(re.fullmatch(r"\d{8}T\d{6}Z", i) for i in ids), ids
    assert min(ids) == time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(float(start)))


@pytest.mark.slow  # ~2-5 s: a child process, and 1 s held
def test_appenders_take_turns_under_the_files_lock(tmp_path):
    """A writer appending while another's line is still being written waits for it (the
    file's flock) and appends its record after that whole line. Before, it took the unfinished
    line for one cut short and wrote a newline and its record into the middle of it."""
    path = tmp_path / "r.jsonl"
    line = good_line()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, line[:40])  # a writer mid-line, as a write of several pages is seen
        code = ("import json, sys; from distmm.cli.records import append_record; "
                "print('appending', flush=True); "
                "append_record(sys.argv[1], {**json.loads(sys.argv[2]), 'run': 'r2'})")
        proc = subprocess.Popen([sys.executable, "-c", code, str(path), json.dumps(RECORD)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "appending\n"
        time.sleep(1.0)  # long enough for the other append, were it not waiting
        os.write(fd, line[40:])
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    assert proc.wait(timeout=60) == 0
    proc.stdout.close()
    assert path.read_bytes() == line + good_line(run="r2")


def test_model_output_onto_a_file_without_its_last_newline(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    path.write_bytes(good_line().rstrip(b"\n"))
    assert main(["model", "--gpus", "1", "512", "512", "512", "-o", str(path)]) == 0
    recs = load([path])
    assert len(recs) == 2 and recs[0] == RECORD and recs[1]["predicted_seconds"] > 0
    assert main(["report", str(path), "-o", str(tmp_path / "rep")]) == 0


@pytest.mark.parametrize("content, expected", [
    (b'{"gpus": ', "t.json:1: not JSON"),
    (b"[1, 2]", "t.json: not a distmm tuning cache"),
    (b'{"version": 2, "gpus": {}}', "t.json: tuning cache version 2; this distmm reads version 1"),
    (b'{"version": 1, "gpus": []}', "t.json: the tuning cache's 'gpus' must map each GPU"),
    (b'{"version": 1, "gpus": {"H200": {"float32": 5}}}', "'gpus' must map each GPU"),
    (b'\xff{}', "t.json: not UTF-8 text"),
], ids=["cut-short", "list", "version", "gpus-list", "entry-number", "not-utf8"])
def test_tune_show_refuses_a_broken_cache(tmp_path, capsys, content, expected):
    cache = write_lines(tmp_path / "t.json", content)
    assert main(["tune", "--cache", str(cache), "--show"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"distmm tune: error: {tmp_path}") and expected in captured.err
    assert cache.read_bytes() == content


def test_tune_show_of_a_good_a_missing_and_the_default_cache(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "t.json"
    entries = {"version": 1, "gpus": {"NVIDIA H200": {"float32": {"backend": "raw"}}}}
    cache.write_text(json.dumps(entries))
    assert main(["tune", "--cache", str(cache), "--show"]) == 0
    assert json.loads(capsys.readouterr().out) == entries
    assert main(["tune", "--cache", str(tmp_path / "none.json"), "--show"]) == 2
    assert capsys.readouterr().err == (f"distmm tune: error: No such file or directory: "
                                       f"{tmp_path / 'none.json'}\n")
    monkeypatch.setenv("DISTMM_CACHE_DIR", str(tmp_path / "cache"))  # none yet: empty
    assert main(["tune", "--show"]) == 0
    assert json.loads(capsys.readouterr().out) == {"version": 1, "gpus": {}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


@pytest.mark.parametrize("content, expected", [
    (b"my notes\nline two", "notes.txt:1: not a JSON line (Expecting value)"),
    (good_line() + good_line(m=-5), "notes.txt:2: field 'm' must be an integer from 0 to "
                                    "2**63 - 1, got -5"),
    (good_line() + good_line()[:40], "notes.txt:2: not a JSON line (Unterminated string "
                                     "starting at); the file's last line, cut short (no "
                                     "newline at its end)"),
], ids=["text", "a-bad-record", "a-cut-last-line"])
def test_a_study_never_appends_to_a_file_that_is_not_records(tmp_path, capsys, content,
                                                              expected):
    """distmm bench -o a file that holds no records (or a record no reader takes, or a last
    line cut short, which the report leaves out but which the records appended after it would
    bury inside the file): refused in one line before anything is measured, the file
    unchanged (before, the study appended its records to it, into a file that distmm report
    then refused)."""
    study = tmp_path / "one.toml"
    study.write_text('[[series]]\nkind = "strong"\nengines = ["local"]\ncounts = [1]\n'
                     'sizes = [32]\n')
    notes = write_lines(tmp_path / "notes.txt", content)
    assert main(["bench", str(study), "-o", str(notes)]) == 2
    err = capsys.readouterr().err
    assert err == (f"distmm bench: error: {notes.parent}/{expected}; records are appended to "
                   f"a file of records only\n")
    assert notes.read_bytes() == content
    with pytest.raises(ValueError, match="records are appended to a file of records only"):
        RecordWriter("scaling", "AMD EPYC", path=notes)
    assert notes.read_bytes() == content
