"""`make gpu-check`'s --wheels (a GPU machine with no network that lacks a package the check needs, torchao for
bench_fp8): the wheels are installed into a fresh folder the parts import first, named in the report, and removed
after; a folder with no wheel is one line; bench_fp8 without torchao is skipped before it spends device time."""

import argparse
import base64
import contextlib
import glob
import hashlib
import importlib.metadata
import io
import json
import os
import subprocess
import sys
import tempfile
import zipfile

import pytest

from tests.gpu.check import cli, fp8_bench, workers
from tests.gpu.check.result import Result

PROBE = "mpzero_carried_probe"


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(folder) -> str:
    """A one-module pure-Python wheel, as a build backend writes it."""
    files = {f"{PROBE}.py": b"WHERE = __file__\n",
             f"{PROBE}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {PROBE}\nVersion: 1.0\n".encode(),
             f"{PROBE}-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                             b"Tag: py3-none-any\n"}
    record = f"{PROBE}-1.0.dist-info/RECORD"
    lines = [_record_line(name, data) for name, data in files.items()] + [f"{record},,"]
    path = os.path.join(folder, f"{PROBE}-1.0-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(record, "\n".join(lines) + "\n")
    return path


def test_carried_wheels_are_what_the_parts_import(tmp_path):
    wheels, site, logs = tmp_path / "wheels", tmp_path / "site", tmp_path / "logs"
    for folder in (wheels, site, logs):
        folder.mkdir()
    build_wheel(wheels)
    assert cli.wheel_files(str(wheels)) == [str(wheels / f"{PROBE}-1.0-py3-none-any.whl")]
    assert cli.install_wheels(sys.executable, str(wheels), str(site), str(logs)) is None
    probe = [sys.executable, "-c", f"import {PROBE}; print({PROBE}.WHERE)"]
    seen = subprocess.run(probe, env=cli.child_env(paths=(str(site),)), capture_output=True, text=True, timeout=60)
    assert seen.returncode == 0 and seen.stdout.strip().startswith(str(site)), seen.stderr
    unseen = subprocess.run(probe, env=cli.child_env(), capture_output=True, text=True, timeout=60)
    assert unseen.returncode != 0  # without the folder on the path the module is not there


def test_a_broken_wheel_fails_the_install_in_one_line(tmp_path):
    (tmp_path / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip file")
    why = cli.install_wheels(sys.executable, str(tmp_path), str(tmp_path / "site"), str(tmp_path))
    assert why is not None and "failed" in why and "wheels.log" in why and "\n" not in why


def test_the_check_without_cuda_names_the_carried_wheels_and_removes_them(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    build_wheel(wheels)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, even on a GPU machine
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "mpzero-gpu-check-site-*")))
    with contextlib.redirect_stdout(io.StringIO()) as said:
        assert cli.main(["--out", str(tmp_path / "out"), "--wheels", str(wheels)]) == 0
    assert said.getvalue().startswith("gpu-check: no CUDA here")
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["environment"]["wheels carried"] == f"{PROBE}-1.0-py3-none-any.whl"
    assert "torchao" in data["environment"]
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "mpzero-gpu-check-site-*"))) == before


def test_wheels_folder_without_a_wheel_is_one_line(tmp_path, capsys):
    for folder in (tmp_path, tmp_path / "absent"):
        with pytest.raises(SystemExit) as stop:
            cli.parse_args(["--wheels", str(folder)])
        assert stop.value.code == 2
        assert "no .whl file there" in capsys.readouterr().err


def test_bench_fp8_without_torchao_is_skipped_before_it_spends_device_time(tmp_path, monkeypatch):
    version = importlib.metadata.version

    def without_torchao(name):
        if name == "torchao":
            raise importlib.metadata.PackageNotFoundError(name)
        return version(name)
    monkeypatch.setattr(importlib.metadata, "version", without_torchao)
    result = Result(str(tmp_path / "fp8.json"), workers.COLUMNS["bench_fp8"])
    status = fp8_bench.bench_fp8(argparse.Namespace(limit=300), result)
    assert status.startswith("skipped: torchao is not installed") and "make gpu-wheels" in status
    assert result.data["rows"] == []
