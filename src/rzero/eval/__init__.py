"""`rzero eval`: pass@1 and pass@k of a model on a suite of benchmarks (docs/eval.md).

suite.py reads and validates the suite file, run.py samples every benchmark on one engine,
metrics.py turns samples into pass@k, report.py prints the table and writes the result files.
"""
