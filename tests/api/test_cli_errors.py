"""`python -m mxattn`'s command line: a missing file or an unknown argument is one line on stderr and exit status 2,
never a traceback or a silent success."""

import subprocess
import sys

import pytest

from mxattn.__main__ import main


@pytest.mark.parametrize("argv, message", [
    (["bench", "--plot-from", "/nonexistent.json"],
     "python -m mxattn bench: error: --plot-from /nonexistent.json: No such file or directory"),
    (["info", "--bogus"], "python -m mxattn info: error: unrecognized arguments: --bogus"),
    (["bench", "--bogus"], "python -m mxattn bench: error: unrecognized arguments: --bogus"),
    (["bench", "--iters", "5"], "python -m mxattn bench: error: --iters must be at least 20"),
    (["bogus"], "python -m mxattn: error: argument command: invalid choice: 'bogus'"),
])
def test_bad_command_lines_are_one_line_and_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith(message), captured.err
    assert captured.out == ""


def test_plot_from_a_file_that_is_not_results_json(tmp_path, capsys):
    for text in ("{not json", "[1, 2]"):
        path = tmp_path / "results.json"
        path.write_text(text)
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "--plot-from", str(path)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1 and "not a results.json" in err


def test_the_module_entry_point_exits_2_with_one_line():
    """The same through the interpreter: `python -m mxattn bench --plot-from /nonexistent.json`."""
    out = subprocess.run([sys.executable, "-m", "mxattn", "bench", "--plot-from", "/nonexistent.json"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert [line for line in out.stderr.splitlines() if line.startswith("python -m mxattn")] == [
        "python -m mxattn bench: error: --plot-from /nonexistent.json: No such file or directory"]
