"""The alignment checklist C0-C10 (docs/checklist.md): `rzero check`, or `run_checks(...)` from Python."""

from rzero.check.checklist import CHECKS, CheckResult, run_checks

__all__ = ["CHECKS", "CheckResult", "run_checks"]
