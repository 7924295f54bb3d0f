"""`make gpu-check`: every CUDA-only check and benchmark of mpzero in one run on one GPU machine, written as a
Markdown report (report.md) with its raw logs. Each part runs in its own process under its own time limit, so
a hang or a crash is one failed row, never the end of the check. Without CUDA it builds and validates a
report with every part skipped, so the machinery is tested on CPU. Stdlib only here (no torch at import):
the orchestrator must run, and say why, where torch itself is missing.

    PYTHONPATH=. python3 -m tests.gpu.check --out gpu-report
"""
