"""`rzero check`: the alignment checklist C0-C10 (docs/checklist.md).

Invariant numerics: every check passes with a difference of exactly 0.0 (C8 "n/a" on a dense
model). Standard numerics is the negative control: the parity checks must fail with nonzero
differences, at least C3 (decode), C4 (batch size) and C6 (chunking / prefix cache).
Each full checklist run is done once per session and shared by the tests that read it.
"""

from __future__ import annotations

import json
import math

import pytest
import torch.nn.functional as F

from rzero import cli
from rzero.check.checklist import CHECKS, CheckResult, run_checks
from rzero.check.harness import max_abs_diff

IDS = [cid for cid, _ in CHECKS]


@pytest.fixture(scope="session")
def checklist(tiny_model_dirs):
    """checklist(preset, numerics, dtype, only=None) -> list[CheckResult], each combination run once."""
    cache: dict = {}

    def get(preset: str, numerics: str, dtype: str, only: tuple[str, ...] | None = None) -> list[CheckResult]:
        key = (preset, numerics, dtype, only)
        if key not in cache:
            cache[key] = run_checks(tiny_model_dirs[preset], numerics, dtype, seed=0, only=only)
        return cache[key]

    return get


def by_id(results: list[CheckResult]) -> dict[str, CheckResult]:
    return {r.id: r for r in results}


# ----------------------------------------------------------------------------- invariant mode


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset,dtype", [("tiny-dense", "fp32"), ("tiny-dense", "bf16"), ("tiny-moe", "bf16")]
)
def test_invariant_numerics_pass_every_check_with_zero_difference(checklist, preset, dtype):
    results = checklist(preset, "invariant", dtype)
    assert [r.id for r in results] == IDS
    failures = [f"{r.id} {r.name}: {r.max_abs_diff!r} ({r.detail})" for r in results if not r.passed]
    assert not failures, "\n".join(failures)
    for r in results:
        if r.id == "C8" and preset == "tiny-dense":
            assert r.max_abs_diff == "n/a"
        else:
            assert r.max_abs_diff == 0.0, f"{r.id}: {r.max_abs_diff!r}"
            assert isinstance(r.max_abs_diff, float)
        assert r.compared


@pytest.mark.slow
def test_checklist_passes_at_qwen3_head_dim_and_width(tmp_path):
    """One layer of a Qwen3-0.6B's shape (hidden 1024, 16 heads of 128, 8 KV heads, MLP 3072), bf16:
    the attention's score tile (8 rows at head_dim 128) and the prepacked decode linears (K = 1024)
    must keep every check at exactly 0. With 4-row score tiles C3, C4, C6, C7 and C10 failed here."""
    from rzero.model.io import save_model
    from rzero.model.qwen3 import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=1024, hidden_size=1024, intermediate_size=3072, num_hidden_layers=1,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config)
    model.init_weights(0)
    save_model(model, tmp_path / "wide", dtype="bf16")
    results = run_checks(tmp_path / "wide", "invariant", "bf16", seed=0)
    assert [r.max_abs_diff for r in results if r.id != "C8"] == [0.0] * (len(IDS) - 1), [
        (r.id, r.max_abs_diff) for r in results
    ]


@pytest.mark.slow
def test_moe_routing_is_compared_on_a_moe_model(checklist):
    c8 = by_id(checklist("tiny-moe", "invariant", "bf16"))["C8"]
    assert c8.passed and c8.max_abs_diff == 0.0
    assert "MoE layers" in c8.detail  # it really captured routes, not "n/a"


@pytest.mark.slow
def test_sanity_figures_show_the_checks_are_not_vacuous(checklist):
    r = by_id(checklist("tiny-dense", "invariant", "fp32"))
    assert "changed by the update" in r["C1"].detail and " 0 changed" not in r["C1"].detail
    assert "served from the prefix cache" in r["C6"].detail and "; 0 prompt positions" not in r["C6"].detail
    # C10: w is exactly 1 at the same version, and the update moved some logprob
    assert "w peak 1.0 median 1.0" in r["C10"].detail
    moved = float(r["C10"].detail.split("max |log w| ")[-1].split(";")[0])
    assert moved > 0


# --------------------------------------------------------------------- standard mode (control)


@pytest.mark.slow
def test_standard_numerics_fail_through_the_cli_with_nonzero_differences(tiny_dense_dir, capsys):
    code = cli.main(["check", "--model", str(tiny_dense_dir), "--numerics", "standard", "--dtype", "fp32", "--json"])
    out = capsys.readouterr().out
    report = json.loads(out)  # stdout is exactly one JSON object
    assert code == 1
    assert report["numerics"] == "standard" and report["dtype"] == "fp32" and report["model"] == str(tiny_dense_dir)
    checks = {c["id"]: c for c in report["checks"]}
    assert list(checks) == IDS
    for c in checks.values():
        assert set(c) >= {"id", "name", "compared", "max_abs_diff", "passed"}
    for cid in ("C0", "C3", "C4", "C6"):
        assert not checks[cid]["passed"], cid
        assert isinstance(checks[cid]["max_abs_diff"], float) and checks[cid]["max_abs_diff"] > 0, cid
    assert "standard." in checks["C0"]["detail"]
    assert checks["C8"]["max_abs_diff"] == "n/a" and checks["C8"]["passed"]


@pytest.mark.slow
def test_standard_numerics_bf16_show_decode_batch_and_chunk_differences(checklist):
    results = by_id(checklist("tiny-dense", "standard", "bf16", only=("C3", "C4", "C6")))
    assert list(results) == ["C3", "C4", "C6"]
    for r in results.values():
        assert not r.passed and r.max_abs_diff > 0, f"{r.id}: {r.max_abs_diff!r} ({r.detail})"


# ------------------------------------------------------------------------------- C0 detection


def test_numerics_audit_finds_a_stock_kernel_leaking_into_the_forward(tiny_dense_dir, monkeypatch):
    """Invariant mode, but the projections call F.linear directly: C0 must name the leak."""
    import rzero.model.qwen3 as qwen3

    monkeypatch.setattr(qwen3.Linear, "forward", lambda self, x, nx: F.linear(x, self.weight))
    [c0] = run_checks(tiny_dense_dir, "invariant", "fp32", only=("C0",))
    assert not c0.passed and c0.max_abs_diff > 0
    assert "aten.linear" in c0.detail or "aten.mm" in c0.detail or "aten.addmm" in c0.detail


# --------------------------------------------------------- the checklist tests the shipping trainer


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_ulp_in_the_trainers_scoring_fails_the_checklist(tiny_dense_dir, monkeypatch, dtype):
    """`rzero check` runs `Trainer.token_logprobs` itself, not a copy: nudge one token's logprob
    by one ulp in the autograd pass (what training computes) and C9 fails with exactly that ulp."""
    import torch

    from rzero.train.trainer import Trainer

    real = Trainer.token_logprobs

    def one_ulp_off(model, rollouts, share_prompts=True):
        out = real(model, rollouts, share_prompts)
        if torch.is_grad_enabled() and out:  # the training forward; the no-grad pass is untouched
            lp = out[0]
            out[0] = torch.cat([torch.nextafter(lp[:1], torch.tensor(float("inf"))), lp[1:]])
        return out

    monkeypatch.setattr(Trainer, "token_logprobs", staticmethod(one_ulp_off))
    results = by_id(run_checks(tiny_dense_dir, "invariant", dtype, only=("C9",)))
    c9 = results["C9"]
    assert not c9.passed
    assert 0 < c9.max_abs_diff < 1e-5, c9.detail  # one fp32 ulp of a logprob


# ------------------------------------------------------------------------------ CLI and helpers


def test_table_output_and_exit_code(tiny_dense_dir, capsys, monkeypatch):
    """The rich table lists every check; exit 0 iff all pass (C8 alone on a dense model passes)."""
    import rzero.check.checklist as checklist_mod

    real = checklist_mod.run_checks
    monkeypatch.setattr(checklist_mod, "run_checks", lambda *a, **kw: real(*a, **kw, only=("C8",)))
    code = cli.main(["check", "--model", str(tiny_dense_dir)])
    out = capsys.readouterr().out
    assert code == 0
    for header in ("check", "name", "compared", "max |Δ|", "result"):
        assert header in out
    assert "C8" in out and "n/a" in out and "PASS" in out


def test_bad_model_dir_is_a_clear_error(tmp_path, capsys):
    code = cli.main(["check", "--model", str(tmp_path / "missing"), "--json"])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    assert "no config.json" in captured.err


def test_unknown_check_id_is_rejected(tiny_dense_dir):
    with pytest.raises(ValueError, match="unknown check"):
        run_checks(tiny_dense_dir, only=("C11",))


def test_max_abs_diff_is_exact():
    assert max_abs_diff([1.0, -2.5], [1.0, -2.5]) == 0.0
    assert max_abs_diff([0.1], [0.1 + 2**-55]) > 0  # one ulp of float64 is a difference
    assert max_abs_diff([float("-inf")], [float("-inf")]) == 0.0
    assert max_abs_diff([float("-inf")], [-3.0]) == math.inf
    assert max_abs_diff([float("nan")], [float("nan")]) == math.inf  # a missing value never matches
    assert max_abs_diff([1.0, 2.0], [1.0]) == math.inf
    assert max_abs_diff([], []) == 0.0


def test_json_report_is_strict_json():
    r = CheckResult("C3", "decode parity", "x", math.inf, False)
    assert r.to_json()["max_abs_diff"] == "inf"
    json.dumps(r.to_json(), allow_nan=False)
