"""Files written whole, and only where asked: no write goes through a planted link, a target's
link, mode and kind are honoured, a bad destination is refused before any work."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from accel import phases
from accel.__main__ import main
from accel.errors import UsageError
from accel.files import check_writable, write_text_atomic
from accel.lab import bench


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_link_planted_at_a_temporary_name_is_not_followed(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    shared = tmp_path / "shared"
    shared.mkdir()
    target = shared / "report.html"
    for name in (f".{target.name}.tmp", f"{target.name}.tmp", f".{target.name}"):
        (shared / name).symlink_to(outside)
    write_text_atomic(target, "new")
    assert outside.read_text() == "keep me"
    assert target.read_text() == "new" and not target.is_symlink()


def test_a_linked_target_is_written_through_and_stays_a_link(tmp_path):
    real = tmp_path / "real" / "README.md"
    real.parent.mkdir()
    real.write_text("old")
    link = tmp_path / "README.md"
    link.symlink_to(real)
    write_text_atomic(link, "new")
    assert link.is_symlink() and real.read_text() == "new"


def test_a_read_only_target_is_refused_and_left_as_it_was(tmp_path):
    target = tmp_path / "README.md"
    target.write_text("old")
    target.chmod(0o444)
    with pytest.raises(UsageError, match=r"README\.md.*read-only.*0o444"):
        write_text_atomic(target, "new")
    assert target.read_text() == "old" and stat.S_IMODE(target.stat().st_mode) == 0o444
    assert _listing(tmp_path) == ["README.md"]


def test_a_rewritten_file_keeps_its_mode_and_a_new_one_gets_the_usual_one(tmp_path):
    kept = tmp_path / "kept.txt"
    kept.write_text("old")
    kept.chmod(0o640)
    write_text_atomic(kept, "new")
    assert stat.S_IMODE(kept.stat().st_mode) == 0o640
    fresh = tmp_path / "fresh.txt"
    write_text_atomic(fresh, "new")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask


def test_a_folder_as_target_is_refused_and_nothing_is_left(tmp_path):
    folder = tmp_path / "report.html"
    folder.mkdir()
    with pytest.raises(UsageError, match=r"report\.html: expected a file to write, found a folder"):
        write_text_atomic(folder, "new")
    assert _listing(tmp_path) == ["report.html"] and _listing(folder) == []


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(target, "half \udc80")  # a lone surrogate cannot be encoded
    assert _listing(tmp_path) == ["out.txt"] and target.read_text() == "old"


def test_a_target_in_a_missing_folder_is_refused_by_its_folder_and_nothing_is_made(tmp_path):
    with pytest.raises(UsageError, match=r"new/out\.txt: cannot write there, the folder .*new does "
                       r"not exist"):
        write_text_atomic(tmp_path / "new" / "out.txt", "text")
    assert _listing(tmp_path) == []


def test_a_destination_under_a_file_is_refused(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(UsageError, match=r"--out .*a-file/x/report\.html: .*a-file is a file"):
        check_writable(blocker / "x" / "report.html", "--out")


# the command line checks its destinations before it examines or measures anything


@pytest.fixture
def nothing_runs(monkeypatch):
    """Records any examination or bench phase that starts."""
    ran: list[str] = []
    monkeypatch.setattr("accel.doctor.examine", lambda *a, **k: ran.append("examine"))
    monkeypatch.setattr(
        "accel.doctor.cli.load_step", lambda target: ran.append("load") or (print, None, None)
    )
    monkeypatch.setattr(phases, "BENCH", (*phases.BENCH, "fake"))
    monkeypatch.setattr(bench, "phase_function", lambda name: lambda ctx: ran.append(name) or [])
    return ran


def _one_line_exit_2(capsys, code: int, *words: str) -> None:
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err


def test_doctor_refuses_a_folder_as_out_before_examining(tmp_path, nothing_runs, capsys):
    code = main(["doctor", "m:f", "--out", str(tmp_path)])
    _one_line_exit_2(capsys, code, "--out", "found a folder")
    assert nothing_runs == [] and _listing(tmp_path) == []


def test_doctor_refuses_a_new_folder_name_as_out_before_examining(tmp_path, nothing_runs, capsys):
    code = main(["doctor", "m:f", "--out", str(tmp_path / "reports") + os.sep])
    _one_line_exit_2(capsys, code, "--out", "expected a file to write, found a folder name")
    assert nothing_runs == [] and _listing(tmp_path) == []


def test_doctor_refuses_an_unwritable_out_before_examining(tmp_path, nothing_runs, capsys):
    (tmp_path / "a-file").write_text("")
    code = main(["doctor", "m:f", "--out", str(tmp_path / "a-file" / "report.html")])
    _one_line_exit_2(capsys, code, "--out", "is a file")
    assert nothing_runs == []


def test_doctor_refuses_a_pipe_as_out_and_leaves_it_a_pipe(tmp_path, nothing_runs, capsys):
    # a FIFO, or a device such as /dev/null: replaced by a regular file, it would be gone
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    code = main(["doctor", "m:f", "--out", str(fifo)])
    _one_line_exit_2(capsys, code, "--out", "expected a regular file")
    assert nothing_runs == [] and stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_doctor_refuses_a_folder_where_no_file_can_be_made_before_examining(nothing_runs, capsys):
    # /proc's permissions allow writing, yet no file can be made in it: found by trying
    code = main(["doctor", "m:f", "--out", "/proc/report.html"])
    _one_line_exit_2(capsys, code, "--out", "cannot write there")
    assert nothing_runs == []


def test_bench_refuses_a_read_only_results_file_before_any_phase(tmp_path, nothing_runs, capsys):
    from accel.measure.device import results_stem

    csv = tmp_path / f"{results_stem()}.csv"
    csv.write_text(",".join(bench.COLUMNS) + "\n")
    csv.chmod(0o444)
    code = main(["bench", "--phase", "fake", "--out", str(tmp_path)])
    _one_line_exit_2(capsys, code, "read-only")
    assert nothing_runs == []


def test_bench_refuses_a_folder_at_the_report_name_before_any_phase(tmp_path, nothing_runs, capsys):
    from accel.measure.device import results_stem

    (tmp_path / f"{results_stem()}.html").mkdir()
    code = main(["bench", "--phase", "fake", "--out", str(tmp_path)])
    _one_line_exit_2(capsys, code, "found a folder")
    assert nothing_runs == []


README = "# x\n<!-- results:start -->\nold\n<!-- results:end -->\n"


def test_table_writes_through_a_linked_readme(tmp_path):
    real = tmp_path / "repo" / "README.md"
    real.parent.mkdir()
    real.write_text(README)
    (tmp_path / "results").mkdir()
    link = tmp_path / "README.md"
    link.symlink_to(real)
    assert main(["table", "--readme", str(link), "--force"]) == 0
    assert link.is_symlink() and "No results recorded yet" in real.read_text()


def test_table_refuses_a_read_only_readme(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(README)
    readme.chmod(0o444)
    (tmp_path / "results").mkdir()
    code = main(["table", "--readme", str(readme), "--force"])
    _one_line_exit_2(capsys, code, "--readme", "read-only")
    assert readme.read_text() == README and stat.S_IMODE(readme.stat().st_mode) == 0o444
