"""The run directory `meshrun train` and its ranks exchange files in (launch/rundir.py): the
variables that name it, the report file's records, written whole by ranks at once and read by
kind as they come."""

import json
import os
import subprocess
import sys

from meshrun.launch.rundir import CRASH, ERROR, INTERRUPT, PREEMPT, Report, ReportReader, RunDir


def test_the_ranks_find_the_directory_the_launcher_names(tmp_path):
    run_dir = RunDir(str(tmp_path), str(tmp_path / "out" / "logs"))
    assert RunDir.from_env(run_dir.env()) == run_dir
    assert RunDir(str(tmp_path)).log_dir == str(tmp_path / "logs")
    assert RunDir.from_env({}) is None


def test_records_are_read_by_kind_in_the_order_written(tmp_path):
    run_dir = RunDir(str(tmp_path))
    reader = ReportReader(run_dir)
    assert reader.first(CRASH) is None and not reader.any()
    run_dir.report(Report(CRASH, 1, "rank 1 failed: Broken pipe", echo=True))
    assert reader.records(CRASH)[0].echo and not reader.any()  # an echo alone says nothing of its own
    run_dir.report(Report(CRASH, 0, "rank 0: a collective waited", timed_out=True))
    run_dir.report(Report(ERROR, 0, "--data x: not found\nsecond line"))
    run_dir.report(Report(PREEMPT, 0, "preempted by SIGTERM at step 3"))
    assert reader.any()
    assert [(r.rank, r.echo, r.timed_out) for r in reader.records(CRASH)] == [(1, True, False), (0, False, True)]
    assert reader.first(ERROR).line == "--data x: not found"
    assert reader.first(PREEMPT).line == "preempted by SIGTERM at step 3"
    assert reader.first(INTERRUPT) is None
    lines = (tmp_path / "reports.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"kind": "crash", "rank": 1, "message": "rank 1 failed: Broken pipe", "echo": True}
    reader.clear()
    assert not os.path.exists(run_dir.reports) and reader.first(CRASH) is None


def test_a_line_still_being_written_is_read_once_it_ends(tmp_path):
    run_dir = RunDir(str(tmp_path))
    reader = ReportReader(run_dir)
    whole = Report(INTERRUPT, 0, "interrupted at step 4").to_json() + "\n"
    with open(run_dir.reports, "w") as f:
        f.write(whole[:10])
    assert reader.first(INTERRUPT) is None
    with open(run_dir.reports, "a") as f:
        f.write(whole[10:] + "not a record\n")
    assert reader.first(INTERRUPT).line == "interrupted at step 4"


def test_ranks_writing_at_once_leave_whole_lines(tmp_path):
    run_dir = RunDir(str(tmp_path))
    program = ("import sys; from meshrun.launch.rundir import CRASH, Report, RunDir; r = int(sys.argv[1]); "
               "d = RunDir(sys.argv[2]); [d.report(Report(CRASH, r, 'x' * 3000)) for _ in range(200)]")
    procs = [subprocess.Popen([sys.executable, "-c", program, str(rank), str(tmp_path)]) for rank in range(4)]
    assert [p.wait() for p in procs] == [0] * 4
    records = ReportReader(run_dir).records(CRASH)
    assert len(records) == 800 and all(r.message == "x" * 3000 for r in records)
    assert sorted({r.rank for r in records}) == [0, 1, 2, 3]


def test_ready_marks_are_the_ranks_past_their_rendezvous(tmp_path):
    run_dir = RunDir(str(tmp_path))
    for rank in (0, 3):
        open(run_dir.ready(rank), "w").close()
    (tmp_path / "ready.tmp").write_text("")
    assert run_dir.ready_ranks() == {0, 3}
    run_dir.clear_ready()
    assert run_dir.ready_ranks() == set() and (tmp_path / "ready.tmp").exists()
