"""The orchestrator: probe the machine, run each part in its own process group under a time limit, write the
report after every part (a check killed midway still leaves one), exit 1 when a part failed.

    PYTHONPATH=. python3 -m tests.gpu.check [--out gpu-report] [--budget 540] [--only PART ...] [--dry-run]
                                            [--wheels DIR]

--wheels: packages a GPU machine with no network lacks (torchao for bench_fp8; `make gpu-wheels` downloads it
elsewhere), installed with no index and no dependencies into a fresh temporary folder the parts import from.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

from tests.gpu.check import report
from tests.gpu.check.report import PART_NAMES, PARTS, Part

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
RESERVE_S = 10  # kept back from the budget for writing the report
MIN_PART_S = 20  # a part is not started with less time than this left
FUSED_TESTS = ["tests/fused/test_fused_gpu.py", "tests/fused/test_fused_layer_norm.py",
               "tests/fused/test_fused_rms_norm.py", "tests/fused/test_fused_softmax.py",
               "tests/fused/test_fused_adam.py"]
PYTEST_FILES = {
    "fused_kernels": FUSED_TESTS,
    "gpt_cuda_vs_cpu": ["tests/gpu/test_gpt_cuda.py", "tests/gpu/test_moe_cuda.py"],
    "zero_nccl": ["tests/gpu/test_zero_nccl.py"],
    "mixed_precision": ["tests/gpu/test_mixed_precision.py"],
    "checkpoint_resume": ["tests/gpu/test_checkpoint_resume.py"],
    "offload": ["tests/gpu/test_offload_cuda.py"],
}
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "TRITON_INTERPRET")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m tests.gpu.check", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu-report", help="directory for report.md, report.json and logs/")
    p.add_argument("--budget", type=float, default=540.0,
                   help="seconds for the whole check (default 540: under 10 minutes, one device command's limit, "
                        "with a killed part's grace and the report)")
    p.add_argument("--only", nargs="+", choices=PART_NAMES, default=None, help="run these parts, skip the rest")
    p.add_argument("--dry-run", action="store_true", help="build and validate the all-skipped report, run nothing")
    p.add_argument("--python", default=sys.executable, help="interpreter for the parts (default: this one)")
    p.add_argument("--wheels", metavar="DIR", default=None,
                   help="install the wheels in DIR (no index, no dependencies) for the parts: what a GPU machine "
                        "with no network lacks, e.g. torchao for bench_fp8 (`make gpu-wheels`)")
    args = p.parse_args(argv)
    if args.budget <= 0:
        p.error(f"--budget must be positive, got {args.budget}")
    if args.wheels is not None and not wheel_files(args.wheels):
        p.error(f"--wheels {args.wheels}: no .whl file there; run `make gpu-wheels` where pip reaches an index, "
                f"or drop --wheels")
    return args


def wheel_files(folder: str) -> list[str]:
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [os.path.join(folder, n) for n in names if n.endswith(".whl") and os.path.isfile(os.path.join(folder, n))]


def install_wheels(python: str, folder: str, site: str, logs: str) -> str | None:
    """Installs every wheel in `folder` into the empty folder `site`; None, or why it failed in one line."""
    cmd = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--disable-pip-version-check", "--target", site, *wheel_files(folder)]
    rc, _ = run_logged(cmd, os.path.join(logs, "wheels.log"), 120, child_env())
    return None if rc == 0 else f"installing the wheels in {folder} failed (exit code {rc}); see {logs}/wheels.log"


def child_env(extra: dict | None = None, paths: tuple[str, ...] = ()) -> dict:
    """This environment for a part: no launcher's variables; the repository, then `paths`, first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *paths] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                          if p])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_logged(cmd: list[str], log_path: str, limit_s: float, env: dict) -> tuple[int | None, float]:
    """(exit code or None on timeout, seconds). Output goes to log_path; on timeout the whole process group
    (torchrun's workers included) gets SIGTERM, then SIGKILL after 5 s."""
    start = time.monotonic()
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                    env=env, start_new_session=True)
        except OSError as error:
            log.write(f"could not start: {error}\n".encode())
            return 127, time.monotonic() - start
        try:
            return proc.wait(timeout=max(limit_s, 1)), time.monotonic() - start
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            log.write(f"\n[gpu-check] killed after the {limit_s:.0f} s limit\n".encode())
            return None, time.monotonic() - start


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def probe_environment(python: str, logs: str, paths: tuple[str, ...] = ()) -> dict:
    """What the machine has (torch, CUDA, GPUs...), from a child process so a broken driver cannot hang us."""
    path = os.path.join(logs, "environment.json")
    rc, _ = run_logged([python, "-m", "tests.gpu.check.workers", "environment", "--json", path],
                       os.path.join(logs, "environment.log"), 120, child_env(paths=paths))
    info = _read_json(path)
    if info is None:
        return {"torch": f"probe failed (exit code {rc}); see {logs}/environment.log", "cuda": False}
    return info


def environment_table(info: dict) -> dict:
    table = {k: v for k, v in info.items() if k not in ("cuda", "device_count")}
    table["GPUs"] = info.get("device_count", 0)
    table["date (UTC)"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    try:
        table["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                         text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        table["commit"] = "unknown"
    return table


def pytest_result(xml_path: str) -> tuple[dict[str, int], list[dict], list[str]]:
    """(counts, one row per test function, failure notes) from pytest's JUnit XML."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    by_function: dict[str, dict] = {}
    notes = []
    root = ET.parse(xml_path).getroot()
    for case in root.iter("testcase"):
        name = case.get("name", "?")
        function = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{name.split('[', 1)[0]}"
        row = by_function.setdefault(function, {"test": function, "passed": 0, "failed": 0, "skipped": 0,
                                                "seconds": 0.0})
        row["seconds"] += float(case.get("time", 0) or 0)
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        if failed is not None:
            outcome = "failed"
            message = (failed.get("message") or failed.text or "").strip().splitlines()
            notes.append(f"FAILED {function}[{name.split('[', 1)[1] if '[' in name else ''}: "
                         f"{(message[0] if message else '')[:300]}")
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        row[outcome] += 1
        counts[outcome] += 1
    for row in by_function.values():
        row["seconds"] = round(row["seconds"], 2)
    return counts, list(by_function.values()), notes


def run_pytest_part(part: Part, limit: float, python: str, logs: str, paths: tuple[str, ...] = ()) -> dict:
    xml_path = os.path.join(logs, f"{part.name}.xml")
    log_path = os.path.join(logs, f"{part.name}.log")
    extra = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if part.name == "checkpoint_resume" else {}
    cmd = [python, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", f"--junitxml={xml_path}",
           *PYTEST_FILES[part.name]]
    rc, seconds = run_logged(cmd, log_path, limit, child_env(extra, paths))
    result = {"seconds": seconds, "logs": [log_path, xml_path], "columns": ["test", "passed", "failed", "skipped",
                                                                           "seconds"], "rows": [], "notes": []}
    try:
        counts, rows, notes = pytest_result(xml_path)
        result.update(rows=rows, notes=[f"{counts['passed']} passed, {counts['failed']} failed, "
                                        f"{counts['skipped']} skipped"] + notes)
    except (OSError, ET.ParseError):
        counts = None
        result["logs"] = [log_path]
    if rc is None:
        status = f"timeout: killed after {limit:.0f} s"
    elif counts is None:
        status = f"error: pytest exit code {rc}, no results (see the log)"
    elif rc == 0 and counts["passed"] == 0:
        status = "skipped: every test skipped (see the log for why)"
    elif rc == 0:
        status = "pass"
    elif rc == 1:
        status = "fail"
    else:
        status = f"error: pytest exit code {rc}"
    return {**result, "status": status}


def run_worker_part(part: Part, limit: float, python: str, logs: str, paths: tuple[str, ...] = ()) -> dict:
    json_path = os.path.join(logs, f"{part.name}.json")
    log_path = os.path.join(logs, f"{part.name}.log")
    if part.name == "bench_kernels":
        cmd = [python, "bench/bench_fused_gpu.py", "--gpt2", "--json", json_path]
    else:
        cmd = [python, "-m", "tests.gpu.check.workers", part.name, "--json", json_path, "--limit", f"{limit:.0f}"]
    rc, seconds = run_logged(cmd, log_path, limit, child_env(paths=paths))
    data = _read_json(json_path) or {}
    result = {"seconds": seconds, "logs": [log_path] + ([json_path] if data else []),
              "columns": data.get("columns", []), "rows": data.get("rows", []), "notes": data.get("notes", [])}
    worker_status = str(data.get("status", ""))
    if rc is None:
        status = f"timeout: killed after {limit:.0f} s" + (" (rows so far kept)" if result["rows"] else "")
    elif rc == 0 and worker_status:
        status = worker_status
    elif worker_status.startswith(("fail", "skipped")):
        status = worker_status
    else:
        status = f"error: exit code {rc} (see the log)"
    try:
        report.status_kind(status)
    except ValueError:
        status = f"error: unknown status {status!r} from the worker"
    return {**result, "status": status}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.wheels is None or args.dry_run:
        return run_check(args, ())
    site = tempfile.mkdtemp(prefix="mpzero-gpu-check-site-")  # a fresh folder: nothing planted is imported
    try:
        return run_check(args, (site,))
    finally:
        shutil.rmtree(site, ignore_errors=True)


def run_check(args: argparse.Namespace, paths: tuple[str, ...]) -> int:
    """The check; `paths`: an empty folder to install --wheels into, then first on the parts' PYTHONPATH."""
    start = time.monotonic()
    out = args.out
    logs = os.path.join(out, "logs")
    os.makedirs(logs, exist_ok=True)
    if paths:
        failed = install_wheels(args.python, args.wheels, paths[0], logs)
        if failed:
            print(f"gpu-check: {failed}", file=sys.stderr)
            return 2
    info = ({"torch": "not probed (--dry-run)", "cuda": False} if args.dry_run else
            probe_environment(args.python, logs, paths))
    environment = environment_table(info)
    if paths:
        environment["wheels carried"] = ", ".join(os.path.basename(f) for f in wheel_files(args.wheels))
    if not info.get("cuda"):
        results = report.skipped_results("no CUDA")
        path = report.write(out, environment, results, time.monotonic() - start)
        print(f"gpu-check: no CUDA here (torch: {info.get('torch')}); nothing run: {path} built and validated, "
              f"all {len(results)} parts 'skipped: no CUDA'")
        return 0
    results = report.skipped_results("not run yet")
    for index, part in enumerate(PARTS):
        remaining = args.budget - (time.monotonic() - start) - RESERVE_S
        base = {"name": part.name, "limit_s": part.limit_s, "seconds": 0.0, "logs": [], "columns": [], "rows": [],
                "notes": []}
        if args.only and part.name not in args.only:
            results[index] = {**base, "status": "skipped: not selected (--only)"}
            continue
        if part.name == "multi_gpu" and int(info.get("device_count", 0)) < 2:
            results[index] = {**base, "status": f"skipped: {info.get('device_count', 0)} GPU (needs 2 or more)"}
            continue
        if remaining < MIN_PART_S:
            results[index] = {**base, "status": f"skipped: out of time (--budget {args.budget:.0f} s)"}
            continue
        limit = min(part.limit_s, remaining)
        print(f"gpu-check: {part.name} (limit {limit:.0f} s) ...", flush=True)
        try:
            runner = run_pytest_part if part.name in PYTEST_FILES else run_worker_part
            result = runner(part, limit, args.python, logs, paths)
        except Exception as error:  # noqa: BLE001 - one part's breakage is its row, not the end of the check
            result = {**base, "status": f"error: {type(error).__name__}: {str(error)[:200]}"}
        results[index] = {**base, **result, "name": part.name, "limit_s": round(limit)}
        print(f"gpu-check: {part.name}: {results[index]['status']} ({results[index]['seconds']:.0f} s)", flush=True)
        report.write(out, environment, results, time.monotonic() - start)
    path = report.write(out, environment, results, time.monotonic() - start)
    bad = [r["name"] for r in results if report.status_kind(r["status"]) in ("fail", "timeout", "error")]
    print(f"gpu-check: report {path}; " + (f"not passed: {', '.join(bad)}" if bad else "no failures"))
    return 1 if bad else 0
