"""``qerl bench lora-tune`` on the CPU: the plan (keys as vLLM's punica wrapper calls its LoRA ops), the
search with a stand-in timing function (the fastest valid config wins; failed and differing ones are
skipped), the files in vLLM's names and nesting, the report, ``--install``, the refusal without a GPU or
vLLM, and ``--dry-run``'s plan."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from test_lora_kernel_configs import vllm_rule_lookup

from qerl_cli.bench import lora_tune, lora_tune_gpu
from qerl_cli.bench.lora_tune import Trial, TuneKey, candidates, plan_keys, tune_key
from qerl_cli.bench.lora_tune_settings import LoraTuneSettings
from qerl_cli.cli import main
from qerl_cli.errors import QerlError
from qerl_cli.modeling.model_shape import ModelShape
from qerl_cli.modeling.random_checkpoint import SHAPES
from qerl_cli.rollout import lora_kernel_configs as lkc

GPU = "NVIDIA Test-GPU 80GB"
QWEN7B = ModelShape.from_config(SHAPES["qwen2.5-7b"])


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["bench", "lora-tune", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


# -- the plan ---------------------------------------------------------------------------------------
def test_keys_are_the_ops_calls_of_each_fused_linear() -> None:
    keys = plan_keys(QWEN7B, 16, [8])
    shrink = {k.linears: (k.num_slices, k.k, k.n) for k in keys if k.op == "shrink"}
    assert shrink == {("qkv",): (3, 3584, 16), ("o",): (1, 3584, 16), ("gate_up",): (2, 3584, 16),
                      ("down",): (1, 18944, 16)}  # fmt: skip
    expand = {k.linears: (k.num_slices, k.k, k.n, k.slice_sizes) for k in keys if k.op == "expand"}
    # expand's n is the largest slice's output (q's, not k's or v's); o and down share one key
    assert expand == {("qkv",): (3, 16, 3584, (3584, 512, 512)), ("o", "down"): (1, 16, 3584, (3584,)),
                      ("gate_up",): (2, 16, 18944, (18944, 18944))}  # fmt: skip
    assert len(plan_keys(QWEN7B, 16, [8, 256])) == 2 * len(keys)


def test_candidates_cover_the_rank_and_leave_out_tiles_of_padding() -> None:
    for op in ("shrink", "expand"):
        grid = candidates(op, 16)
        assert len(grid) == len({json.dumps(c, sort_keys=True) for c in grid}) > 10
        assert all(set(c) == set(lkc.CONFIG_FIELDS) for c in grid)
        assert {c["block_m"] for c in candidates(op, 16, 8)} == {16}
        assert candidates(op, 16, 4096) == grid
    assert {c["block_n"] for c in candidates("shrink", 64)} == {64}
    assert {c["block_k"] for c in candidates("expand", 16)} == {16}


def test_a_rank_vllm_does_not_run_is_refused_naming_the_one_it_does() -> None:
    with pytest.raises(QerlError, match="give --rank 16"):
        lora_tune.check_rank(12)
    assert lora_tune.check_rank(64) == 64


def test_a_model_folder_gives_its_shape(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SHAPES["qwen2.5-0.5b"]))
    assert lora_tune.model_shape(str(tmp_path)) == ModelShape.from_config(SHAPES["qwen2.5-0.5b"])
    with pytest.raises(QerlError, match="neither a model shape"):
        lora_tune.model_shape(str(tmp_path / "missing"))


# -- the search -------------------------------------------------------------------------------------
def fake_trial(failing: set[int] = frozenset(), differing: set[int] = frozenset()):  # type: ignore[assignment]
    """Time = a config's block_m + block_k / 100 + split_k / 1000 (expand: + block_n / 1000), in us; the
    block_k values in ``failing`` fail to compile, those in ``differing`` give another output."""
    seen: list[tuple[TuneKey, dict[str, Any], dict[str, Any]]] = []

    def trial(key: TuneKey, config: Mapping[str, Any], reference: Mapping[str, Any]) -> Trial:
        seen.append((key, dict(config), dict(reference)))
        if config["block_k"] in failing:
            return Trial(dict(config), "failed", detail="OutOfResources: shared memory")
        if config["block_k"] in differing:
            return Trial(dict(config), "differs", detail="max difference 3.1e-01 of the output's scale")
        us = config["block_m"] + config["block_k"] / 100 + (config.get("split_k") or 0) / 1000
        return Trial(dict(config), "ok", us + config.get("block_n", 0) / 1000)

    trial.seen = seen  # type: ignore[attr-defined]
    return trial


DEFAULT = {"block_m": 32, "block_n": 16, "block_k": 256, "split_k": 64, "num_warps": 4, "num_ctas": 1,
           "group_size_m": 8, "num_stages": 2, "max_nreg": None}  # fmt: skip
KEY = plan_keys(QWEN7B, 16, [64])[0]


def test_the_fastest_valid_config_wins_and_failed_or_differing_ones_are_skipped() -> None:
    # Without skipping, block_k 64 (16.64 us) would win; it fails, block_k 128 differs: 256 is left.
    trial = fake_trial(failing={64}, differing={128})
    result = tune_key(KEY, DEFAULT, candidates("shrink", 16, 64), trial)
    assert (
        result.best is not None
        and result.best.config["block_m"] == 16
        and result.best.config["block_k"] == 256
    )
    assert result.best.config["split_k"] == 8  # the fastest of the valid ones
    assert result.speedup == pytest.approx(result.default.us / result.best.us)
    statuses = {t.status for t in result.trials}
    assert statuses == {"ok", "failed", "differs"}
    assert all(ref == DEFAULT for _, _, ref in trial.seen)  # every output checked against the default's
    assert trial.seen[0][1] == DEFAULT  # the default first


def test_the_default_stays_when_no_candidate_beats_it() -> None:
    fastest = dict(DEFAULT, block_m=1)
    result = tune_key(KEY, fastest, candidates("shrink", 16, 64), fake_trial())
    assert result.best is not None and result.best.config == fastest and result.speedup == 1.0


def test_a_key_whose_default_cannot_run_keeps_the_default_and_says_why(tmp_path: Path) -> None:
    result = tune_key(KEY, DEFAULT, candidates("shrink", 16, 64), fake_trial(failing={256}))
    assert result.best is None and result.trials == [] and "OutOfResources" in (result.error or "")
    # Its slice count stays in the table (vLLM looks it up exactly), with what vLLM runs there anyway.
    (path,) = lora_tune.write_configs([result], GPU, tmp_path, 1)
    assert vllm_rule_lookup(tmp_path, GPU, "shrink", None, (2, KEY.num_slices, 64, KEY.k, KEY.n)) == DEFAULT


def test_the_files_are_what_vllms_lookup_finds_and_the_report_has_every_trial(tmp_path: Path) -> None:
    settings = LoraTuneSettings(rows=[8, 256], output=str(tmp_path))
    results = lora_tune.run_search(settings, fake_trial(failing={64}), lambda key, max_loras: dict(DEFAULT))
    written = lora_tune.write_configs(results, GPU, tmp_path, 1)
    assert sorted(p.name for p in written) == ["NVIDIA_Test_GPU_80GB_EXPAND_TRUE.json",
                                               "NVIDIA_Test_GPU_80GB_SHRINK.json"]  # fmt: skip
    for result in results:
        key = result.key
        found = vllm_rule_lookup(tmp_path, GPU, key.op, True if key.op == "expand" else None,
                                 (lkc.lookup_max_loras(1), key.num_slices, key.m, key.k, key.n))  # fmt: skip
        wanted = {name: v for name, v in result.best.config.items() if name in lkc.CONFIG_FIELDS}
        assert found == wanted, key.label()
    header = {"schema": lora_tune.SCHEMA, "command": "qerl bench lora-tune"}
    data = lora_tune.report(header, settings, results, 0.0, written)
    json.dumps(data)  # a JSON report
    assert data["files"] == [p.name for p in written] and data["errors"] == []
    assert len(data["keys"]) == len(results) == 2 * (4 + 3)
    first = data["keys"][0]
    assert first["default"]["us"] > 0 and first["speedup"] >= 1.0
    assert len(first["trials"]) == len(candidates(first["key"]["op"], 16, first["key"]["m"]))
    assert any(t["status"] == "failed" for t in first["trials"])


def test_install_copies_into_the_shipped_folder_of_a_checkout(tmp_path: Path, monkeypatch) -> None:
    assert lora_tune.source_tree_folder() == lkc.SHIPPED_FOLDER  # the tests run from a checkout
    source = tmp_path / lkc.config_file_name(GPU, "shrink")
    lkc.write_table(source, lkc.nest([(lkc.ConfigKey(2, 1, 8, 3584, 16), DEFAULT)]))
    target = tmp_path / "shipped"
    target.mkdir()
    assert lora_tune.install([source], target) == [target / source.name]
    assert (target / source.name).read_bytes() == source.read_bytes()
    (tmp_path / "broken.json").write_text("[")
    with pytest.raises(QerlError, match="not a readable LoRA kernel config file"):
        lora_tune.install([tmp_path / "broken.json"], target)
    wheel = tmp_path / "site" / "qerl_cli" / "rollout" / "lora_configs"  # no pyproject.toml above it
    monkeypatch.setattr(lkc, "SHIPPED_FOLDER", wheel)
    with pytest.raises(QerlError, match="run it from a clone"):
        lora_tune.source_tree_folder()


# -- the command ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("gpu", "vllm", "invariant", "device", "message"),
    [
        (False, True, "0", "auto", "on a CUDA GPU and none is visible"),
        (True, False, "0", "auto", 'vLLM is not installed: pip install -e ".[vllm]"'),
        (True, True, "1", "auto", "ignores tuned LoRA configs in batch-invariant mode"),
        (True, True, "0", "cuda:64", "--device cuda:64: this machine has"),
    ],
)
def test_refused_before_anything_runs_without_a_gpu_or_vllm(
    capsys, tmp_path: Path, monkeypatch, gpu: bool, vllm: bool, invariant: str, device: str, message: str
) -> None:
    monkeypatch.setattr(lora_tune_gpu, "gpu_available", lambda: gpu)
    monkeypatch.setattr(lora_tune_gpu, "vllm_available", lambda: vllm)
    monkeypatch.setenv(lkc.BATCH_INVARIANT_ENV, invariant)
    rc, out, err = run(capsys, "-o", str(tmp_path / "out"), "--device", device)
    assert rc == 2 and message in err
    assert not (tmp_path / "out").exists()


def test_dry_run_prints_the_settings_and_the_plan_without_a_gpu(capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(lora_tune_gpu, "gpu_available", lambda: False)
    out_dir = str(tmp_path / "out")
    rc, out, err = run(capsys, "--rows", "256,8", "--set", "rank=32", "-o", out_dir, "--dry-run")
    assert rc == 0, err
    # The settings as a --config file, sorted rows; the plan as comments after them.
    assert yaml.safe_load(out) == {"model": "qwen2.5-7b", "rank": 32, "rows": [8, 256], "install": False,
                                   "device": "auto", "output": out_dir}  # fmt: skip
    plan = [line[2:] for line in out.splitlines() if line.startswith("# ")]
    assert "qkv 3584 -> 3584+512+512" in plan[1] and "down 18944 -> 3584" in plan[1]
    assert plan[2] == "keys: 8 shrink, 6 expand"
    grid = f"{len(candidates('shrink', 32))} shrink and {len(candidates('expand', 32))} expand candidates"
    assert plan[3].startswith(f"grid: {grid}")
    shrink_trials = sum(len(candidates("shrink", 32, m)) + 1 for m in (8, 256)) * 4
    assert plan[4].startswith(f"trials: {shrink_trials} shrink")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rank", "0"], "--rank must be a positive integer"),
        (["--rank", "12"], "give --rank 16"),
        (["--rows", "8,x"], "--rows takes comma-separated positive integers"),
        (["--set", "rows=[0]"], "rows takes positive token counts"),
        (["--device", "cpu"], "--device is auto or cuda[:N]"),
        (["--model", "no-such-shape"], "neither a model shape"),
    ],
)
def test_bad_input_exits_2_naming_the_flag(capsys, argv: list[str], message: str) -> None:
    rc, out, err = run(capsys, *argv, "--dry-run")
    assert rc == 2 and message in err


# -- the GPU side's plumbing, with vLLM's ops stood in for ------------------------------------------
def stand_in_ops(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``vllm.lora.ops.triton_ops`` with its two ops in torch, each reading its config through its module's
    ``get_lora_op_configs`` as vLLM's do: block_k 64 "fails to compile", block_m 64 computes a wrong
    output. Records the configs each op launched in."""
    launched: dict[str, list[dict[str, Any]]] = {"shrink": [], "expand": []}
    package = types.ModuleType("vllm.lora.ops.triton_ops")
    mods = {name: types.ModuleType(f"vllm.lora.ops.triton_ops.{name}")
            for name in ("lora_shrink_op", "lora_expand_op", "utils")}  # fmt: skip
    mods["utils"].get_lora_op_configs = lambda op_type, **kw: dict(DEFAULT)

    def run_op(op: str, module: types.ModuleType) -> dict[str, Any]:
        config = module.get_lora_op_configs(op, max_loras=2, batch=1, hidden_size=1, rank=1, num_slices=1)
        launched[op].append(config)
        if config["block_k"] == 64:
            raise RuntimeError("OutOfResources: out of resource: shared memory\nRequired: 200000")
        return config

    def lora_shrink(x, weights, out, *meta_and_scaling):
        config = run_op("shrink", mods["lora_shrink_op"])
        out.zero_()
        for i, w in enumerate(weights):
            out[i] += x.float() @ w[0].float().t() * (2.0 if config["block_m"] == 64 else 1.0)

    def lora_expand(x, weights, out, *meta, offset_start=0, add_inputs=True):
        run_op("expand", mods["lora_expand_op"])
        start = offset_start
        for i, w in enumerate(weights):
            out[:, start : start + w.shape[1]] += (x[i] @ w[0].float().t()).to(out.dtype)
            start += w.shape[1]

    class Meta:
        @staticmethod
        def make(max_loras: int, tokens: int, device: Any) -> Meta:
            return Meta()

        def prepare_tensors(self, mapping: Any) -> None:
            assert (mapping == 0).all()  # every token on adapter 0

        def meta_args(self, tokens: int, specialize: bool) -> tuple:
            return (None,) * 7

    mods["lora_shrink_op"].get_lora_op_configs = mods["lora_expand_op"].get_lora_op_configs = None
    package.lora_shrink, package.lora_expand, package.LoRAKernelMeta = lora_shrink, lora_expand, Meta
    monkeypatch.setitem(sys.modules, "vllm.lora.ops.triton_ops", package)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, f"vllm.lora.ops.triton_ops.{name}", mod)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(lora_tune_gpu, "graph_us", lambda calls: 5.0 + len(launched["shrink"]) / 1000)
    return launched


@pytest.mark.parametrize("op", ["shrink", "expand"])
def test_each_config_reaches_vllms_op_and_its_output_is_checked(monkeypatch, op: str) -> None:
    launched = stand_in_ops(monkeypatch)
    ops = lora_tune_gpu.VllmLoraOps(16, 1, torch.device("cpu"))
    key = next(k for k in plan_keys(QWEN7B, 16, [8]) if k.op == op and k.num_slices == 3)
    default = ops.default_config(key, 1)
    assert default == DEFAULT
    ok = ops.trial(key, dict(DEFAULT, block_k=128), default)
    assert ok.status == "ok" and ok.us is not None
    failed = ops.trial(key, dict(DEFAULT, block_k=64), default)
    assert (
        failed.status == "failed"
        and failed.detail == "RuntimeError: OutOfResources: out of resource: shared memory"
    )
    wrong = ops.trial(key, dict(DEFAULT, block_m=64), default)
    assert wrong.status == ("differs" if op == "shrink" else "ok")  # the stand-in's expand ignores block_m
    # The reference in the default config first, then each trial's own; nothing forced outside a trial.
    assert [c["block_k"] for c in launched[op][:3]] == [DEFAULT["block_k"], 128, 64]
    assert sys.modules[f"vllm.lora.ops.triton_ops.lora_{op}_op"].get_lora_op_configs is None
