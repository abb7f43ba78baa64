import json
import subprocess
import sys
from pathlib import Path

import nbformat

from tfedu.course import cli, nbtools

ROOT = Path(__file__).resolve().parents[1]


def test_doctor_exits_zero_and_prints_the_device(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "device " in out and "torch " in out and "corpus " in out


def test_doctor_fails_clearly_when_a_required_package_is_missing(monkeypatch, capsys):
    real = cli.package_version
    monkeypatch.setattr(cli, "package_version", lambda d: None if d == "einops" else real(d))
    assert cli.main(["doctor"]) == 1
    captured = capsys.readouterr()
    assert "einops     " in captured.out and "MISSING" in captured.out
    assert "einops is not installed" in captured.err


def test_doctor_runs_the_triton_kernel_where_triton_is_installed():
    status = cli.triton_status()
    if cli.package_version("triton") is None:
        assert status.startswith("not installed"), status
    else:  # on the GPU, or in the CPU interpreter that tfedu.kernels switches on without one
        assert "flash_attention agrees with SDPA" in status, status


def test_doctor_says_when_triton_is_missing(monkeypatch):
    real = cli.package_version
    monkeypatch.setattr(cli, "package_version", lambda d: None if d == "triton" else real(d))
    assert cli.triton_status().startswith("not installed (optional")


def test_doctor_names_every_package_that_differs_from_the_pins(tmp_path, monkeypatch, capsys):
    from importlib import metadata

    numpy, pytest_version = metadata.version("numpy"), metadata.version("pytest")
    pins = tmp_path / "constraints.txt"
    pins.write_text(f"# a comment\nnumpy=={numpy}\nPyTest==0.0.1\ntorch=={metadata.version('torch').split('+')[0]}\n"
                    "no-such-package-tfedu==1.0\n")
    differ, missing, count = cli.pin_differences(pins)
    assert differ == [f"pytest {pytest_version} (pinned 0.0.1)"] and missing == ["no-such-package-tfedu"] and count == 4
    monkeypatch.setattr(cli, "CONSTRAINTS", pins)
    assert cli.main(["doctor"]) == 0  # a difference is reported, not fatal
    out = capsys.readouterr().out
    assert f"1 differ from constraints.txt: pytest {pytest_version} (pinned 0.0.1)" in out
    assert "1 pinned but not installed: no-such-package-tfedu" in out


def test_doctor_pins_line_when_all_match_or_no_file(tmp_path):
    from importlib import metadata

    pins = tmp_path / "constraints.txt"
    pins.write_text(f"numpy=={metadata.version('numpy')}\n")
    assert cli.pin_report(pins).startswith("all 1 packages of constraints.txt installed at its versions")
    assert cli.pin_report(tmp_path / "absent.txt").startswith("no constraints.txt here")
    pins.write_text("numpy>=1\n")
    assert "expected name==version lines" in cli.pin_report(pins)


def test_console_script_is_installed():
    result = subprocess.run([sys.executable, "-m", "tfedu.course.cli", "doctor"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "device" in result.stdout


def dirty_copy(tmp_path):
    nb = nbtools.read(ROOT / "notebooks" / "00_start_here.ipynb")
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="hello\n")]
    nb.cells[1].execution_count = 3
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    path = tmp_path / "00_start_here.ipynb"
    nbtools.write(nb, path)
    return path


def test_clean_strips_outputs_counts_and_widget_state(tmp_path):
    path = dirty_copy(tmp_path)
    assert cli.main(["clean", "--check", str(path)]) == 1
    assert cli.main(["clean", str(path)]) == 0
    nb = json.loads(path.read_text())
    assert "widgets" not in nb["metadata"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb["cells"] if c["cell_type"] == "code")
    assert cli.main(["clean", "--check", str(path)]) == 0
    assert nbtools.hygiene_problems(nbtools.read(path), path.name) == []


def test_clean_rejects_a_non_notebook(tmp_path, capsys):
    other = tmp_path / "notes.txt"
    other.write_text("x")
    assert cli.main(["clean", str(other)]) == 2
    assert "not an .ipynb file" in capsys.readouterr().err
