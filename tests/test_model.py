"""rzero.model: agreement with transformers, checkpoint IO, load errors, model-level invariance, CLI."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from rzero import ops
from rzero.model.io import load_model, read_config, read_tokenizer_files, save_model
from rzero.model.presets import PRESETS
from rzero.model.qwen3 import Qwen3Config, Qwen3ForCausalLM
from rzero.ops import AttentionMeta

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def random_seqs(gen: torch.Generator, lengths: list[int], vocab: int) -> list[torch.Tensor]:
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def rzero_logits(model: Qwen3ForCausalLM, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 logits of every position of every sequence, all packed into one forward."""
    meta, _ = AttentionMeta.for_sequences([len(s) for s in seqs], row_tile=model.numerics.row_tile)
    logits = model.logits(model(torch.cat(seqs), meta))
    return list(logits.split([len(s) for s in seqs]))


def rzero_logprobs(model: Qwen3ForCausalLM, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Full-vocabulary logprobs of every position (model-level rows; the trainer's scoring of
    sampled tokens is Trainer.token_logprobs)."""
    meta, _ = AttentionMeta.for_sequences([len(s) for s in seqs], row_tile=model.numerics.row_tile)
    logprobs = model.numerics.log_softmax(model.logits(model(torch.cat(seqs), meta)))
    return list(logprobs.split([len(s) for s in seqs]))


def hf_logits(hf_model, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """transformers logits for a right-padded batch with an attention mask."""
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    with torch.no_grad():
        out = hf_model(input_ids=ids, attention_mask=mask).logits.float()
    return [out[i, : len(s)] for i, s in enumerate(seqs)]


def load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def assert_matches_transformers(model_dir: Path, hf_model=None, seed: int = 0) -> None:
    hf_model = hf_model or load_hf(model_dir)
    vocab = read_config(model_dir)["vocab_size"]
    seqs = random_seqs(torch.Generator().manual_seed(seed), [1, 6, 17, 33, 50], vocab)
    expected = hf_logits(hf_model, seqs)
    for mode in ops.NUMERICS_MODES:
        model = load_model(model_dir, "fp32", numerics=mode)
        with torch.no_grad():
            got = rzero_logits(model, seqs)
        assert all(g.dtype == torch.float32 and g.shape == e.shape for g, e in zip(got, expected))
        diff = max_diff(got, expected)
        assert diff <= 1e-4, f"{model_dir.name} {mode}: max |rzero - transformers| = {diff}"


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


# ---------------------------------------------------------------------------------------------
# 6. transformers cross-check
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_logits_match_transformers(preset, tiny_model_dirs):
    from transformers import Qwen3ForCausalLM as HFQwen3, Qwen3MoeForCausalLM as HFQwen3Moe

    hf_model = load_hf(tiny_model_dirs[preset])
    assert isinstance(hf_model, HFQwen3Moe if preset == "tiny-moe" else HFQwen3)
    assert_matches_transformers(tiny_model_dirs[preset], hf_model)


def small_config(**overrides) -> Qwen3Config:
    base = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=10_000.0,
    )
    return Qwen3Config(**{**base, **overrides})


def test_untied_embeddings_match_transformers(tmp_path):
    model = Qwen3ForCausalLM(small_config(tie_word_embeddings=False))
    model.init_weights(seed=3)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    save_model(model, tmp_path / "untied")
    saved = load_file(str(tmp_path / "untied" / "model.safetensors"))
    assert "lm_head.weight" in saved and not torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])
    assert read_config(tmp_path / "untied")["tie_word_embeddings"] is False

    loaded = load_model(tmp_path / "untied")
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    assert_same_params(model, loaded)
    hf_model = load_hf(tmp_path / "untied")
    assert not torch.equal(hf_model.lm_head.weight, hf_model.model.embed_tokens.weight)
    assert_matches_transformers(tmp_path / "untied", hf_model, seed=1)


def test_tied_embeddings_saved_once(tiny_dense_dir):
    saved = load_file(str(tiny_dense_dir / "model.safetensors"))
    assert "lm_head.weight" not in saved
    model = load_model(tiny_dense_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_sharded_save_loads_in_rzero_and_transformers(tmp_path, tiny_moe_dir):
    model = load_model(tiny_moe_dir)
    out = tmp_path / "sharded"
    save_model(model, out, max_shard_bytes=400_000, extra_files=read_tokenizer_files(tiny_moe_dir))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    assert set(index["weight_map"]) == set(state(model))
    assert index["metadata"]["total_size"] == sum(p.numel() * p.element_size() for p in model.parameters())
    for shard in shards:  # each shard respects the limit unless it holds a single bigger tensor
        tensors = load_file(str(out / shard))
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 400_000
    assert (out / "tokenizer.json").is_file()
    assert_same_params(model, load_model(out))
    assert_matches_transformers(out, seed=2)


# ---------------------------------------------------------------------------------------------
# 7. save / load round trip
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_round_trip_fp32(preset, tiny_model_dirs, tmp_path):
    model = load_model(tiny_model_dirs[preset])
    save_model(model, tmp_path / "copy")
    again = load_model(tmp_path / "copy")
    assert type(again) is type(model) and again.config == model.config
    assert_same_params(model, again)
    a = load_file(str(tiny_model_dirs[preset] / "model.safetensors"))
    b = load_file(str(tmp_path / "copy" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    raw = read_config(tmp_path / "copy")
    assert raw["torch_dtype"] == "float32"
    assert raw == read_config(tiny_model_dirs[preset])
    # Saving over an existing model directory needs overwrite=True and leaves no temporaries behind.
    with pytest.raises(ValueError, match="already holds a model"):
        save_model(again, tmp_path / "copy")
    save_model(again, tmp_path / "copy", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]
    assert_same_params(model, load_model(tmp_path / "copy"))


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_round_trip_bf16(preset, tiny_model_dirs, tmp_path):
    model = load_model(tiny_model_dirs[preset])
    save_model(model, tmp_path / "bf16", dtype="bf16")
    assert read_config(tmp_path / "bf16")["torch_dtype"] == "bfloat16"
    saved = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}

    as_bf16 = load_model(tmp_path / "bf16", "bf16")
    as_fp32 = load_model(tmp_path / "bf16", "fp32")
    assert as_bf16.dtype == torch.bfloat16 and as_fp32.dtype == torch.float32
    fp32_params, bf16_params, up_params = state(model), state(as_bf16), state(as_fp32)
    assert fp32_params.keys() == bf16_params.keys() == up_params.keys()
    for name, p in fp32_params.items():
        assert torch.equal(p.to(torch.bfloat16), bf16_params[name]), name  # one cast, at save time
        assert torch.equal(bf16_params[name].float(), up_params[name]), name  # the upcast is exact
    # A bf16 model saves in its own dtype by default and reloads bit for bit.
    save_model(as_bf16, tmp_path / "bf16-again")
    assert_same_params(as_bf16, load_model(tmp_path / "bf16-again", torch.bfloat16))


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_transformers_saved_checkpoint_round_trip(preset, tiny_model_dirs, tmp_path):
    """A directory written by transformers' save_pretrained (bf16) loads into rzero; re-saved in fp32
    it declares fp32 in config.json, so transformers' default (dtype from the config) loads fp32."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dirs[preset]), dtype=torch.bfloat16)
    hf_model.save_pretrained(str(tmp_path / "hf"))
    from_hf = load_model(tmp_path / "hf", "fp32")
    original = load_model(tiny_model_dirs[preset], "fp32")
    for name, p in state(original).items():
        assert torch.equal(p.to(torch.bfloat16).float(), state(from_hf)[name]), name
    save_model(from_hf, tmp_path / "rz")
    raw = read_config(tmp_path / "rz")
    assert raw["torch_dtype"] == "float32" and raw.get("dtype", "float32") == "float32"
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "rz")).dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# 8. bad model directories
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def model_copy(tmp_path, tiny_dense_dir) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny_dense_dir, dst)
    return dst


def edit_config(model_dir: Path, **changes) -> None:
    raw = read_config(model_dir)
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (model_dir / "config.json").write_text(json.dumps(raw))


def edit_weights(model_dir: Path, fn) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_error_no_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path / "does-not-exist")


def test_error_config_not_json(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(model_copy)


def test_error_unknown_architecture(model_copy):
    edit_config(model_copy, architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(ValueError, match=r"unsupported architecture \['LlamaForCausalLM'\].*Qwen3ForCausalLM"):
        load_model(model_copy)


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_hidden_layers", "intermediate_size"])
def test_error_missing_config_field(model_copy, field):
    edit_config(model_copy, **{field: None})
    with pytest.raises(ValueError, match=f"missing required fields: {field}"):
        load_model(model_copy)


@pytest.mark.parametrize(
    "changes, match",
    [
        (
            dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None),
            "rope type 'yarn' is not supported",
        ),
        (dict(attention_bias=True), "attention_bias=true is not supported"),
        (dict(use_sliding_window=True), "use_sliding_window=true is not supported"),
        (dict(num_key_value_heads=3), r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    ],
)
def test_error_unsupported_config(model_copy, changes, match):
    edit_config(model_copy, **changes)
    with pytest.raises(ValueError, match=match):
        load_model(model_copy)


def test_error_missing_tensor(model_copy):
    edit_weights(model_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(model_copy)


def test_error_wrong_shape(model_copy):
    def shrink(t):
        t["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 128)

    edit_weights(model_copy, shrink)
    with pytest.raises(
        ValueError,
        match=r"wrong shapes: model\.layers\.0\.self_attn\.q_proj\.weight: "
        r"checkpoint \(64, 128\), config expects \(128, 128\)",
    ):
        load_model(model_copy)


def test_error_unexpected_tensor(model_copy):
    def add(t):
        t["model.layers.9.mlp.gate_proj.weight"] = torch.zeros(512, 128)

    edit_weights(model_copy, add)
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.9\.mlp\.gate_proj\.weight"):
        load_model(model_copy)


def test_error_missing_shard(tmp_path, tiny_dense_dir):
    out = tmp_path / "sharded"
    save_model(load_model(tiny_dense_dir), out, max_shard_bytes=300_000)
    shards = sorted(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values()))
    (out / shards[1]).unlink()
    with pytest.raises(FileNotFoundError, match=f"weight shard {shards[1]} listed in the index is missing"):
        load_model(out)


def test_error_no_weights(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        load_model(model_copy)


def test_error_forward_input_mismatch(tiny_dense_dir):
    model = load_model(tiny_dense_dir)
    meta, _ = AttentionMeta.for_sequences([4], row_tile=model.numerics.row_tile)
    with pytest.raises(ValueError, match="5 input ids for an AttentionMeta of 4 tokens"):
        model(torch.zeros(5, dtype=torch.long), meta)
    wrong_tile, _ = AttentionMeta.for_sequences([4], row_tile=1)  # built for standard numerics
    with pytest.raises(ValueError, match="invariant numerics pads to a multiple of 16"):
        model(torch.zeros(4, dtype=torch.long), wrong_tile)
    too_long = model.config.max_position_embeddings + 1
    meta, _ = AttentionMeta.for_sequences([too_long], row_tile=model.numerics.row_tile)
    with pytest.raises(ValueError, match="beyond max_position_embeddings"):
        model(torch.zeros(too_long, dtype=torch.long), meta)


# ---------------------------------------------------------------------------------------------
# 9. model-level invariance
# ---------------------------------------------------------------------------------------------

_models: dict[tuple[str, str], Qwen3ForCausalLM] = {}


@pytest.fixture
def get_model(tiny_model_dirs):
    def get(preset: str, dtype: str) -> Qwen3ForCausalLM:
        if (preset, dtype) not in _models:
            _models[preset, dtype] = load_model(tiny_model_dirs[preset], dtype)
        return _models[preset, dtype]

    return get


MODEL_CASES = [(p, d) for p in ("tiny-dense", "tiny-moe") for d in ("fp32", "bf16")]


@pytest.mark.parametrize("preset, dtype", MODEL_CASES)
@settings(
    max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=st.data())
def test_logprobs_invariant_to_batch_composition(get_model, preset, dtype, data):
    """C4/C5 at model level: one sequence scored alone == packed with 0..7 random neighbours at any
    position (bitwise, full-vocab rows); and C9: autograd forward == no-grad forward."""
    model = get_model(preset, dtype)
    vocab = model.config.vocab_size
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    gen = torch.Generator().manual_seed(seed)
    target = random_seqs(gen, [data.draw(st.integers(1, 40), label="target length")], vocab)[0]
    other_lens = data.draw(st.lists(st.integers(1, 40), min_size=0, max_size=7), label="others")
    others = random_seqs(gen, other_lens, vocab)
    pos = data.draw(st.integers(0, len(others)), label="position")
    batch = others[:pos] + [target] + others[pos:]
    with torch.no_grad():
        alone = rzero_logprobs(model, [target])[0]
        packed = rzero_logprobs(model, batch)
    assert all(p.requires_grad for p in model.parameters())
    with torch.enable_grad():
        trained = rzero_logprobs(model, batch)
    assert alone.dtype == torch.float32 and alone.shape == (len(target), vocab)
    assert torch.equal(alone, packed[pos]), f"packed vs alone: {(alone - packed[pos]).abs().max().item()}"
    assert trained[pos].requires_grad
    for i in range(len(batch)):
        assert torch.equal(trained[i].detach(), packed[i]), f"autograd vs no-grad, sequence {i}"


@pytest.mark.parametrize("preset, dtype", MODEL_CASES)
@settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=st.data())
def test_shared_prompts_give_the_same_logprobs_and_gradients(get_model, preset, dtype, data):
    """The trainer runs a group's prompt once (`share_prompts`): every logprob has the bits of
    scoring each sample whole, at prompt lengths across block boundaries (16, 32), with empty and
    masked completions; the gradients agree up to rounding."""
    from rzero.rollout.record import Rollout
    from rzero.train.trainer import Trainer

    model = get_model(preset, dtype)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    rollouts = []
    for prompt_len in data.draw(st.lists(st.sampled_from([1, 4, 15, 16, 17, 33]), min_size=1, max_size=3), label="prompts"):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        for n in data.draw(st.lists(st.integers(0, 20), min_size=1, max_size=5), label="completions"):
            completion = torch.randint(0, vocab, (n,), generator=gen).tolist()
            mask = [int(i % 3 != 1) for i in range(n)] if n > 2 and n % 2 else None  # some tool-response tokens
            rollouts.append(Rollout(prompt, completion, [0.0] * n, [0] * n, 0.0, mask=mask))
    results = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        lps = Trainer.token_logprobs(model, rollouts, share_prompts=share)
        torch.cat(lps).sum().backward()
        results[share] = [x.detach() for x in lps], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    (whole, whole_grads), (shared, shared_grads) = results[False], results[True]
    assert [len(x) for x in shared] == [len(r.policy_positions()) for r in rollouts]
    assert all(torch.equal(a, b) for a, b in zip(whole, shared)), "shared-prompt logprobs differ from whole sequences"
    tol = 1e-4 if dtype == "fp32" else 3e-2
    for name, p in model.named_parameters():
        # No gradient = zero: an MoE expert that only padding rows were routed to gets zeros in
        # one layout and none in the other (the two pad different row counts).
        g = whole_grads.get(name, torch.zeros_like(p))
        got = shared_grads.get(name, torch.zeros_like(p))
        torch.testing.assert_close(got, g, rtol=tol, atol=tol * max(1.0, g.abs().max().item()), msg=name)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_autograd_forward_backward(get_model, preset):
    """The training forward is differentiable end to end and its logprobs equal the no-grad ones."""
    model = get_model(preset, "fp32")
    gen = torch.Generator().manual_seed(9)
    seqs = random_seqs(gen, [12, 30, 5], model.config.vocab_size)
    with torch.no_grad():
        ref = rzero_logprobs(model, seqs)
    model.zero_grad(set_to_none=True)
    lp = rzero_logprobs(model, seqs)
    chosen = torch.cat([l[:-1].gather(-1, s[1:, None]) for l, s in zip(lp, seqs)])
    (-chosen.mean()).backward()
    assert all(torch.equal(a.detach(), b) for a, b in zip(lp, ref))
    grads = {n: p.grad for n, p in model.named_parameters()}
    # Every parameter gets a gradient, except MoE experts that no token was routed to.
    assert all(g is not None for n, g in grads.items() if ".experts." not in n)
    assert any(g is not None for n, g in grads.items() if ".experts." in n) or preset != "tiny-moe"
    assert all(torch.isfinite(g).all() for g in grads.values() if g is not None)
    assert grads["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_standard_logprobs_depend_on_batch_composition(get_model, preset):
    """Negative control: in standard numerics the same sequence packed with others gets different
    fp32 logprobs than scored alone (and the values still agree to ~1e-5).

    On this CPU the stock fp32 GEMM gives a row the same bits for every M >= 4, so the target is a
    short sequence (3 tokens: M = 3 alone, M >= 4 packed), like a decode step or a short prompt;
    a long dense sequence scored alone and packed can agree bit for bit even in standard mode.
    """
    model = copy.deepcopy(get_model(preset, "fp32"))  # the shared model stays invariant
    model.numerics = ops.STANDARD
    gen = torch.Generator().manual_seed(0)
    target = random_seqs(gen, [3], model.config.vocab_size)[0]
    diffs = []
    with torch.no_grad():
        alone = rzero_logprobs(model, [target])[0]
        for lens, pos in [([7], 1), ([3, 40, 9], 2), ([1, 1, 1], 0)]:
            others = random_seqs(gen, lens, model.config.vocab_size)
            batch = others[:pos] + [target] + others[pos:]
            packed = rzero_logprobs(model, batch)[pos]
            torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)
            diffs.append((packed - alone).abs().max().item())
    assert max(diffs) > 0, f"standard numerics happened to be batch-invariant: {diffs}"


# ---------------------------------------------------------------------------------------------
# 10. `rzero init-model` and the presets
# ---------------------------------------------------------------------------------------------


def test_cli_init_model_subprocess_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "cli-dense"
    proc = subprocess.run(
        [sys.executable, "-m", "rzero.cli", "init-model", "--preset", "tiny-dense", "--out", str(out), "--seed", "5"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"wrote tiny-dense model to {out}" in proc.stdout
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli-dense"]  # no temporaries left behind
    hf_model = AutoModelForCausalLM.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert type(hf_model).__name__ == "Qwen3ForCausalLM"
    assert len(tok) == hf_model.config.vocab_size == 1024
    ids = tok("What is 2 + 3?")["input_ids"]
    assert tok.decode(ids) == "What is 2 + 3?"
    assert 1_000_000 <= hf_model.num_parameters() <= 5_000_000


def test_cli_init_model_moe_in_process(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rzero.cli import main

    out = tmp_path / "cli-moe"
    assert main(["init-model", "--preset", "tiny-moe", "--out", str(out), "--dtype", "bf16"]) == 0
    assert "wrote tiny-moe" in capsys.readouterr().out
    raw = read_config(out)
    assert raw["architectures"] == ["Qwen3MoeForCausalLM"] and raw["torch_dtype"] == "bfloat16"
    assert raw["num_experts"] >= 8 and raw["num_experts_per_tok"] == 2
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    hf_model = AutoModelForCausalLM.from_pretrained(str(out))
    assert type(hf_model).__name__ == "Qwen3MoeForCausalLM"
    assert hf_model.config.num_experts >= 8 and hf_model.config.num_experts_per_tok == 2
    assert len(AutoTokenizer.from_pretrained(str(out))) == raw["vocab_size"]
    assert 1_000_000 <= hf_model.num_parameters() <= 5_000_000


def test_cli_rejects_bad_arguments(tmp_path, capsys):
    from rzero.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["init-model", "--preset", "huge", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2
    assert "invalid choice: 'huge'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_sizes(preset, tiny_model_dirs):
    model = load_model(tiny_model_dirs[preset])
    n_params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    assert 1_000_000 <= n_params <= 5_000_000, n_params
    config = model.config
    if preset == "tiny-moe":
        assert config.num_experts >= 8 and config.num_experts_per_tok == 2
        assert all(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
        assert type(model.model.layers[0].mlp).__name__ == "SparseMoeBlock"
    else:
        assert config.num_experts == 0
    assert config.num_attention_heads > config.num_key_value_heads  # GQA is exercised
