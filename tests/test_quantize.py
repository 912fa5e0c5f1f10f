"""`qerl quantize` on the tiny model: AWQ/RTN NVFP4 and MXFP4 via llm-compressor, NF4, bad input.

Each quantized output is produced once per module (fixtures) and checked several ways. Runs that go
through llm-compressor's AWQ take ~10-20 s each on two CPU cores and are marked slow.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from qerl_cli.config import QuantizeConfig
from qerl_cli.errors import QerlError
from qerl_cli.quantize import REPORT_NAME, QuantizeResult, quantize_table, read_report, run_quantize
from qerl_cli.quantize.report import Perplexity

SEQ_LEN = 48
NUM_SAMPLES = 3


def _config(model: Path, out: Path, calib: Path, **overrides) -> QuantizeConfig:
    values = dict(
        model=str(model),
        output=str(out),
        calib=str(calib),
        num_samples=NUM_SAMPLES,
        seq_len=SEQ_LEN,
        device="cpu",
    )
    values.update(overrides)
    return QuantizeConfig(**values)


def _quantize(tmp_path_factory, tiny_model_dir, calib_file, name: str, **overrides) -> Path:
    out = tmp_path_factory.mktemp(name) / "out"
    run_quantize(_config(tiny_model_dir, out, calib_file, **overrides))
    return out


@pytest.fixture(scope="module")
def awq_nvfp4(tmp_path_factory, tiny_model_dir, calib_file) -> Path:
    return _quantize(tmp_path_factory, tiny_model_dir, calib_file, "awq_nvfp4", format="nvfp4", eval_ppl=True)


@pytest.fixture(scope="module")
def awq_mxfp4(tmp_path_factory, tiny_model_dir, calib_file) -> Path:
    return _quantize(tmp_path_factory, tiny_model_dir, calib_file, "awq_mxfp4", format="mxfp4")


@pytest.fixture(scope="module")
def gptq_nvfp4(tmp_path_factory, tiny_model_dir, calib_file) -> Path:
    return _quantize(
        tmp_path_factory, tiny_model_dir, calib_file, "gptq_nvfp4", format="nvfp4", method="gptq"
    )


@pytest.fixture(scope="module")
def rtn_nf4(tmp_path_factory, tiny_model_dir, calib_file) -> Path:
    return _quantize(tmp_path_factory, tiny_model_dir, calib_file, "rtn_nf4", format="nf4", method="rtn")


def _generate(path: Path) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cpu")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True
    )
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _logits(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _assert_report_complete(path: Path, fmt: str, method: str) -> dict:
    report = json.loads((path / REPORT_NAME).read_text())
    assert report["format"] == fmt and report["method"] == method
    for key in ("llmcompressor", "compressed-tensors", "transformers", "bitsandbytes"):
        assert key in report["versions"]
    assert report["versions"]["transformers"]
    assert report["elapsed_s"] > 0
    size = report["size"]
    assert 0 < size["weights_bytes"] < size["bf16_bytes"] and size["folder_bytes"] >= size["weights_bytes"]
    errors = report["weight_error"]
    # 2 layers x 7 linears; FP4/NF4 of Gaussian weights lands near 0.1 relative error
    assert errors["layers"] == 14 and len(errors["per_layer"]) == 14
    assert 0.02 < errors["mean"] <= errors["max"] < 0.3
    assert errors["worst_layers"][0]["relative_error"] == errors["max"]
    if method in ("awq", "gptq"):
        calib = report["calibration"]
        assert calib["num_samples"] == NUM_SAMPLES and calib["seq_len"] == SEQ_LEN
        assert calib["field"] == "conversations" and calib["rendering"] == ["chat_template"]
    assert (path / "tokenizer.json").is_file() and (path / "config.json").is_file()
    return report


# ------------------------------------------------------------------------------------------------
# NVFP4 / MXFP4 through llm-compressor
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["awq_nvfp4", "awq_mxfp4"])
def test_awq_fp4_output_loads_generates_and_matches_quantlinear(fixture: str, request) -> None:
    from transformers import AutoModelForCausalLM

    from qerl_cli.modeling.loading import load_policy_model

    path: Path = request.getfixturevalue(fixture)
    fmt = fixture.split("_")[1]
    report = _assert_report_complete(path, fmt, "awq")
    assert json.loads((path / "config.json").read_text())["quantization_config"]["format"] == (
        f"{fmt}-pack-quantized"
    )
    assert len(_generate(path)) == 6

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()  # decompresses
    ours, detected = load_policy_model(path, torch.bfloat16, "cpu")
    assert detected == fmt
    torch.testing.assert_close(_logits(ours.eval()), _logits(reference), atol=2e-2, rtol=2e-2)
    if fixture == "awq_nvfp4":
        ppl = report["perplexity"]
        assert ppl["samples"] >= 1 and ppl["bf16"] > 1 and ppl["quantized"] > 1


@pytest.mark.slow
def test_gptq_nvfp4_loads_in_qerl_and_follows_the_bf16_model_closer_than_rtn(
    gptq_nvfp4: Path, tmp_path, tiny_model_dir, calib_file, calib_ids
) -> None:
    """GPTQ's checkpoint is the same compressed-tensors layout (qerl's QuantLinear and transformers
    read it alike), and its error compensation shows where it matters: the model's output on text
    like the calibration text is closer to the BF16 model's than round-to-nearest's."""
    from transformers import AutoModelForCausalLM

    from qerl_cli.modeling.loading import load_policy_model

    report = _assert_report_complete(gptq_nvfp4, "nvfp4", "gptq")
    assert "GPTQ" in report["rounding"] and report["calibration"]["num_samples"] == NUM_SAMPLES
    reference = AutoModelForCausalLM.from_pretrained(gptq_nvfp4, dtype=torch.bfloat16).eval()
    ours, detected = load_policy_model(gptq_nvfp4, torch.bfloat16, "cpu")
    assert detected == "nvfp4"
    torch.testing.assert_close(_logits(ours.eval()), _logits(reference), atol=2e-2, rtol=2e-2)

    rtn = tmp_path / "rtn"
    run_quantize(_config(tiny_model_dir, rtn, calib_file, format="nvfp4", method="rtn"))
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rtn_model, _ = load_policy_model(rtn, torch.float32, "cpu")
    gptq_model, _ = load_policy_model(gptq_nvfp4, torch.float32, "cpu")
    ids = calib_ids

    def kl_to_bf16(model: torch.nn.Module) -> float:
        with torch.no_grad():
            target = torch.log_softmax(bf16(input_ids=ids).logits, -1)
            logq = torch.log_softmax(model.eval()(input_ids=ids).logits.float(), -1)
        return float((target.exp() * (target - logq)).sum(-1).mean())

    assert kl_to_bf16(gptq_model) < kl_to_bf16(rtn_model)


def test_gptq_refused_for_nf4_before_any_work(tmp_path, tiny_model_dir, calib_file) -> None:
    with pytest.raises(QerlError, match="no NF4 scheme"):
        run_quantize(_config(tiny_model_dir, tmp_path / "o", calib_file, format="nf4", method="gptq"))
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_rtn_nvfp4_equals_llmcompressor_byte_for_byte(tmp_path, tiny_model_dir, calib_file) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ours = tmp_path / "ours"
    run_quantize(_config(tiny_model_dir, ours, calib_file, format="nvfp4", method="rtn"))
    _assert_report_complete(ours, "nvfp4", "rtn")

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    oneshot(
        model=model, recipe=[QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"])]
    )
    model.save_pretrained(tmp_path / "upstream", save_compressed=True)

    mine, theirs = (
        load_file(ours / "model.safetensors"),
        load_file(tmp_path / "upstream" / "model.safetensors"),
    )
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert mine[name].dtype == tensor.dtype, name
        assert torch.equal(mine[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_cpu_pin_memory_workaround_is_scoped() -> None:
    pytest.importorskip("llmcompressor")
    from llmcompressor.pipelines.cache import IntermediatesCache

    from qerl_cli.quantize.pipeline import cpu_pin_memory_workaround

    original = IntermediatesCache.pin_memory
    with cpu_pin_memory_workaround():
        if not torch.accelerator.is_available():
            assert IntermediatesCache.pin_memory is not original
            assert IntermediatesCache.pin_memory(None, 0) is None  # would raise without an accelerator
    assert IntermediatesCache.pin_memory is original


# ------------------------------------------------------------------------------------------------
# NF4
# ------------------------------------------------------------------------------------------------
def test_nf4_rtn_loads_generates_and_reports(rtn_nf4: Path) -> None:
    pytest.importorskip("bitsandbytes")
    report = _assert_report_complete(rtn_nf4, "nf4", "rtn")
    assert report["calibration"] is None  # round to nearest needs no data
    assert "round-to-nearest" in report["rounding"]
    qconfig = json.loads((rtn_nf4 / "config.json").read_text())["quantization_config"]
    assert qconfig["quant_method"] == "bitsandbytes" and qconfig["bnb_4bit_quant_type"] == "nf4"
    assert qconfig["bnb_4bit_use_double_quant"] and qconfig["bnb_4bit_compute_dtype"] == "bfloat16"
    assert len(_generate(rtn_nf4)) == 6


def test_nf4_rtn_equals_bitsandbytes_through_transformers(
    rtn_nf4: Path, tiny_model_dir: Path, tmp_path
) -> None:
    pytest.importorskip("bitsandbytes")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=bnb, device_map="cpu")
    model.save_pretrained(tmp_path / "bnb")
    mine, theirs = load_file(rtn_nf4 / "model.safetensors"), load_file(tmp_path / "bnb" / "model.safetensors")
    assert mine.keys() == theirs.keys()
    different = [name for name, tensor in theirs.items() if not torch.equal(mine[name], tensor)]
    # Everything is byte-identical except, possibly, the double-quantized 8-bit absmax codes:
    # bitsandbytes' C++ CPU kernel searches its code table approximately and picks a neighbour of
    # the nearest code for values within ~1e-6 of a midpoint (its CUDA kernel, like ours, takes the
    # nearest; tests/test_formats.py checks ours is never farther). Those are rare one-code steps.
    assert all(name.endswith(".weight.absmax") for name in different), different
    for name in different:
        step = (mine[name].long() - theirs[name].long()).abs()
        assert int(step.max()) == 1 and float((step > 0).float().mean()) < 0.02, name


def test_nf4_loads_into_quantlinear(rtn_nf4: Path) -> None:
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    from qerl_cli.modeling.loading import load_policy_model

    reference = AutoModelForCausalLM.from_pretrained(rtn_nf4, dtype=torch.bfloat16, device_map="cpu").eval()
    ours, detected = load_policy_model(rtn_nf4, torch.bfloat16, "cpu")
    assert detected == "nf4"
    torch.testing.assert_close(_logits(ours.eval()), _logits(reference), atol=2e-2, rtol=2e-2)


@pytest.mark.slow
def test_nf4_awq_folds_smoothing_and_keeps_the_function(tmp_path, tiny_model_dir, calib_file) -> None:
    """AWQ scales move into norms/linears before NF4: the network must still compute (nearly) the same."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    out = tmp_path / "nf4_awq"
    report = run_quantize(_config(tiny_model_dir, out, calib_file, format="nf4", method="awq"))
    assert "AWQ smoothing" in report.rounding
    _assert_report_complete(out, "nf4", "awq")
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    quant = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, device_map="cpu").eval()
    reference, got = _logits(bf16), _logits(quant)
    # an unfolded (lost) smoothing scale would change the logits by O(1); NF4 rounding is ~0.1 relative
    assert float((got - reference).norm() / reference.norm()) < 0.3


# ------------------------------------------------------------------------------------------------
# Bad input and atomic output
# ------------------------------------------------------------------------------------------------
def test_unknown_format(tmp_path, tiny_model_dir, calib_file) -> None:
    from qerl_cli import formats

    listed = ", ".join(formats.names())  # the registry's names, whatever they are
    with pytest.raises(QerlError, match=f"unknown 4-bit format 'int3'; choose one of: {listed}"):
        run_quantize(_config(tiny_model_dir, tmp_path / "o", calib_file, format="int3"))


def test_missing_local_model_and_unreachable_hub(tmp_path, calib_file, monkeypatch) -> None:
    import huggingface_hub.constants

    with pytest.raises(QerlError, match="no such folder"):
        run_quantize(_config(tmp_path / "no-such-model", tmp_path / "o", calib_file))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(QerlError, match="Hugging Face Hub.*(local folder|pass the folder instead)"):
        run_quantize(_config(Path("qerl-test-org/no-such-model"), tmp_path / "o", calib_file))
    assert not (tmp_path / "o").exists()


def test_existing_output_needs_overwrite(tmp_path, tiny_model_dir, calib_file) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")  # an earlier output: what --overwrite replaces
    (out / "keep.txt").write_text("mine")
    with pytest.raises(QerlError, match="already exists.*--overwrite"):
        run_quantize(_config(tiny_model_dir, out, calib_file, format="nf4", method="rtn"))
    assert (out / "keep.txt").read_text() == "mine"
    # --overwrite replaces the folder whole: a file of the user's beside the old model is refused, kept
    with pytest.raises(QerlError, match="holds keep.txt beside the model, which --overwrite would delete"):
        run_quantize(_config(tiny_model_dir, out, calib_file, format="nf4", method="rtn", overwrite=True))
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    run_quantize(_config(tiny_model_dir, out, calib_file, format="nf4", method="rtn", overwrite=True))
    assert (out / REPORT_NAME).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging folder left behind


def test_output_may_not_contain_the_input_or_the_working_folder(tmp_path, monkeypatch) -> None:
    """--overwrite removes the old output folder: one holding the model or the cwd is refused."""
    from qerl_cli.quantize.validate import ModelSource, check_output

    model_dir = tmp_path / "models" / "qwen"
    model_dir.mkdir(parents=True)
    source = ModelSource(ref=str(model_dir), name="qwen", is_local=True)
    for output in (model_dir, tmp_path / "models", tmp_path):
        with pytest.raises(QerlError, match="input model"):
            check_output(output, source, overwrite=True)
    monkeypatch.chdir(model_dir)
    hub = ModelSource(ref="org/model", name="model", is_local=False)
    for output in (Path("."), model_dir.parent):
        with pytest.raises(QerlError, match="current folder"):
            check_output(output, hub, overwrite=True)
    assert check_output(Path("sub"), hub, overwrite=True) == Path("sub")
    assert model_dir.is_dir()


def test_default_output_name(tmp_path, tiny_model_dir, calib_file, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    report = run_quantize(_config(tiny_model_dir, None, calib_file, output=None, format="nf4", method="rtn"))
    assert Path(report.output) == tmp_path / f"{tiny_model_dir.name}-NF4"
    assert (tmp_path / f"{tiny_model_dir.name}-NF4" / REPORT_NAME).is_file()


def test_failure_leaves_nothing_at_the_output(tmp_path, tiny_model_dir, calib_file, monkeypatch) -> None:
    import qerl_cli.quantize.run as run_module

    def broken_save(*args, **kwargs):
        out_dir = args[4]
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(run_module, "save_nf4", broken_save)
    with pytest.raises(RuntimeError, match="disk full"):
        run_quantize(_config(tiny_model_dir, tmp_path / "out", calib_file, format="nf4", method="rtn"))
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def odd_width_model(tmp_path_factory) -> Path:
    """Tiny model whose MLP is 200 wide: down_proj's input is not a multiple of 16, 32 or 64."""
    from transformers import Qwen2ForCausalLM

    from qerl_cli.modeling.tiny import build_tiny_config, build_tokenizer, save_model_folder

    config = build_tiny_config()
    config.intermediate_size = 200
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    return save_model_folder(model, build_tokenizer(), tmp_path_factory.mktemp("odd") / "model")


def test_incompatible_widths_named_then_skipped(tmp_path, odd_width_model, calib_file) -> None:
    named = r"model\.layers\.0\.mlp\.down_proj, model\.layers\.1\.mlp\.down_proj.*--skip-incompatible"
    with pytest.raises(QerlError, match=named):
        run_quantize(_config(odd_width_model, tmp_path / "o", calib_file, format="nf4", method="rtn"))
    assert not (tmp_path / "o").exists()

    report = run_quantize(
        _config(
            odd_width_model, tmp_path / "o", calib_file, format="nf4", method="rtn", skip_incompatible=True
        )
    )
    assert report.skipped_layers == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert report.weight_error.layers == 12
    from safetensors import safe_open

    with safe_open(str(tmp_path / "o" / "model.safetensors"), "pt") as handle:
        assert handle.get_tensor("model.layers.0.mlp.down_proj.weight").dtype == torch.bfloat16
        assert "model.layers.0.mlp.up_proj.weight.absmax" in set(handle.keys())
    qconfig = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.down_proj" in qconfig["llm_int8_skip_modules"]


def test_calibration_file_without_expected_fields(tmp_path, tiny_model_dir) -> None:
    calib = tmp_path / "bad.jsonl"
    calib.write_text(json.dumps({"question": "1+1", "solution": "2"}) + "\n")
    with pytest.raises(QerlError, match="fields present: question, solution.*--calib-field"):
        run_quantize(_config(tiny_model_dir, tmp_path / "o", calib, format="nf4", method="awq"))
    with pytest.raises(QerlError, match="no field 'prompt'; fields present: question, solution"):
        run_quantize(_config(tiny_model_dir, tmp_path / "o", calib, calib_field="prompt", eval_ppl=True))
    assert not (tmp_path / "o").exists()


def test_calibration_rendering_shuffle_and_plain_text(tmp_path, tiny_model_dir, calib_file) -> None:
    from transformers import AutoTokenizer

    from qerl_cli.quantize.calibration import load_calibration

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    first = load_calibration(str(calib_file), tokenizer, num_samples=4, seq_len=SEQ_LEN, seed=1, held_out=2)
    again = load_calibration(str(calib_file), tokenizer, num_samples=4, seq_len=SEQ_LEN, seed=1, held_out=2)
    other = load_calibration(str(calib_file), tokenizer, num_samples=4, seq_len=SEQ_LEN, seed=2, held_out=2)
    assert first.samples == again.samples and first.samples != other.samples
    assert len(first.samples) == 4 and len(first.held_out) == 2
    assert all(len(s) <= SEQ_LEN for s in first.samples)
    text = tokenizer.decode(first.samples[0])
    assert text.startswith("<|im_start|>system\nThink step by step.<|im_end|>\n<|im_start|>user\n")

    parquet = tmp_path / "plain.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["alpha beta", "gamma delta", "  "]}), parquet)
    plain = load_calibration(str(parquet), tokenizer, num_samples=5, seq_len=8, seed=0, field_name="body")
    assert plain.spec["rendering"] == ["plain"] and plain.spec["num_samples"] == 2  # blank row dropped
    assert sorted(tokenizer.decode(s) for s in plain.samples) == ["alpha be", "gamma de"]


def test_quantize_table_renders(rtn_nf4: Path) -> None:
    from rich.console import Console

    report = dataclasses.replace(
        read_report(rtn_nf4), perplexity=Perplexity(samples=4, bf16=10.0, quantized=10.5)
    )
    console = Console(width=140, record=True)
    console.print(quantize_table(report))
    text = console.export_text()
    assert "NF4" in text and "weights size" in text and "10.500" in text and "smaller" in text
    assert "14 / 0" in text and "rel. weight error mean / max" in text


def test_the_result_is_qerl_quant_json_key_for_key(rtn_nf4: Path) -> None:
    """qerl_quant.json is read by other tools: the typed result writes and reads it unchanged."""
    on_disk = json.loads((rtn_nf4 / REPORT_NAME).read_text())
    result = read_report(rtn_nf4)
    assert json.dumps(result.to_dict()) == json.dumps(on_disk)  # same keys, same order, same values
    assert QuantizeResult.from_dict(on_disk) == result
    assert result.format == "nf4" and result.weight_error.layers == 14 and result.perplexity is None
    assert result.weight_error.worst_layers[0].relative_error == result.weight_error.max
    assert list(on_disk) == [
        "model", "output", "format", "method", "rounding", "calibration", "ignored_layers", "skipped_layers",
        "versions", "size", "weight_error", "perplexity", "vllm_marlin", "device", "peak_gpu_bytes",
        "timings_s", "elapsed_s", "source",
    ]  # fmt: skip
    with_ppl = {**on_disk, "perplexity": {"samples": 4, "bf16": 10.0, "quantized": 10.5}}
    assert json.dumps(QuantizeResult.from_dict(with_ppl).to_dict()) == json.dumps(with_ppl)


def test_unreachable_calibration_dataset_says_so(tiny_model_dir) -> None:
    """conftest sets HF_DATASETS_OFFLINE=1: the default hub dataset cannot be opened."""
    from transformers import AutoTokenizer

    from qerl_cli.quantize.calibration import DEFAULT_CALIB, load_calibration

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(QerlError, match="could not be opened.*local .jsonl/.parquet file with --calib"):
        load_calibration(DEFAULT_CALIB, tokenizer, num_samples=2, seq_len=16, seed=0)


def test_the_cli_renders_the_result(tmp_path, tiny_model_dir, capsys) -> None:
    from qerl_cli.cli import main

    out = tmp_path / "nf4"
    argv = ["quantize", str(tiny_model_dir), "--format", "nf4", "--method", "rtn", "--device", "cpu"]
    assert main([*argv, "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"qerl quantize: {tiny_model_dir} -> NF4 (rtn)" in " ".join(text.split())
    assert "weights size" in text and "14 / 0" in text and "smaller" in text
    assert read_report(out).output == str(out)
