"""A run's own files, read tolerantly and written whole: metrics.jsonl and eval.jsonl
with damaged lines, summary.json from the start of a run to its end."""

import json

import pytest

from trainer.analysis import figures
from trainer.errors import UserError
from trainer.reporting import summary
from trainer.workdir import rows

GOOD = [{"step": 2, "loss": 5.0}, {"step": 4, "loss": 4.0, "eval/bleu": 1.5}]
DAMAGED = [
    b"",  # an empty line
    b"\xff\xfe not utf-8",
    b'{"step": "6", "loss": 3.0}',  # another tool's string step
    b'{"loss": 3.0}',  # no step
    b'{"step": true, "loss": 3.0}',
    b"[1, 2]",  # JSON, not an object
    b'{"step": 8, "lo',  # cut by a kill
]


def write(path, good=GOOD, damaged=DAMAGED):
    lines = [json.dumps(good[0]).encode(), *damaged[:3], json.dumps(good[1]).encode()]
    path.write_bytes(b"\n".join([*lines, *damaged[3:]]))


def test_damaged_lines_are_skipped_and_counted(tmp_path):
    write(tmp_path / "metrics.jsonl")
    assert rows.read(tmp_path / "metrics.jsonl") == (GOOD, len(DAMAGED))
    assert rows.read(tmp_path / "missing.jsonl") == ([], 0)
    assert rows.skipped_warning("f", 1).startswith("skipped 1 unreadable line of f (")


def test_a_resume_drops_later_rows_and_keeps_the_damaged_ones_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write(path)
    assert rows.drop_rows_after(tmp_path, 2) == (len(DAMAGED), tmp_path / rows.UNREADABLE)
    assert path.read_text() == json.dumps(GOOD[0]) + "\n"
    # The unreadable lines, byte for byte, in their order; no temporary file left.
    assert (tmp_path / rows.UNREADABLE).read_bytes() == b"".join(d + b"\n" for d in DAMAGED)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", rows.UNREADABLE]
    before = path.stat().st_mtime_ns
    assert rows.drop_rows_after(tmp_path, 2) == (0, None)  # nothing to drop: not rewritten
    assert path.stat().st_mtime_ns == before


def test_plot_reads_what_it_can_and_says_when_there_is_nothing(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="nothing to plot: no step of .*empty has been logged"):
        figures.plot_runs([str(tmp_path / "empty")], str(tmp_path / "a.png"))
    (tmp_path / "run").mkdir()
    write(tmp_path / "run" / "metrics.jsonl")
    (tmp_path / "run" / "eval.jsonl").write_bytes(b'{"eval/bleu": 2.0}\n')  # no step
    drawn = figures.plot_runs(
        [str(tmp_path / "run"), str(tmp_path / "empty")], str(tmp_path / "b.png")
    )
    assert drawn == ["loss", "eval/bleu"] and (tmp_path / "b.png").stat().st_size > 0
    warnings = capsys.readouterr().err.splitlines()
    assert warnings[0].startswith(f"warning: skipped 7 unreadable lines of {tmp_path}/run/metrics")
    assert warnings[1].startswith(f"warning: skipped 1 unreadable line of {tmp_path}/run/eval")
    assert (
        warnings[2] == f"warning: {tmp_path}/empty has no logged step yet: left out of the figure"
    )


def test_summary_is_running_until_the_run_rewrites_it(tmp_path):
    (tmp_path / "summary.json").write_text('{"status": "finished", "last_step": 600}')
    report = summary.RunReport(tmp_path)
    report.begin()
    marked = json.loads((tmp_path / "summary.json").read_text())
    assert marked["status"] == "running" and "last_step" not in marked
    report.first_step, report.last_step = 0, 4
    report.failed(OSError(28, "No space left on device"))
    failed = json.loads((tmp_path / "summary.json").read_text())
    assert failed == {
        "status": "failed",
        "error": "[Errno 28] No space left on device",
        "first_step": 0,
        "last_step": 4,
    }
    done = report.finish(global_batch_size=8, newest_checkpoint=None, commands=[])
    assert done["status"] == "finished"
    assert json.loads((tmp_path / "summary.json").read_text()) == done
    stopped = report.summary(
        global_batch_size=8, newest_checkpoint=None, commands=[], stopped_by="SIGTERM"
    )
    assert stopped["status"] == "stopped (SIGTERM)"


def test_plot_is_suggested_only_once_a_step_is_logged(tmp_path):
    assert not any("trainer.plot" in c for c in summary.commands(tmp_path))
    write(tmp_path / "metrics.jsonl")
    commands = summary.commands(tmp_path, evaluate_flags=" --cpu_devices 8")
    assert commands[1] == f"python -m trainer.plot {tmp_path} --out {tmp_path}/metrics.png"
    assert commands[2] == f"python -m trainer.evaluate --workdir {tmp_path} --cpu_devices 8"
