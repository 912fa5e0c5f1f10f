"""`qerl train` checks what is cheap before it loads a model (output folder, model, dataset, engine
package, GPU), and `qerl train --dry-run` runs exactly these checks, saying what each found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cli_runner import run_cli as run

from qerl_cli.modeling.source_checks import missing_model_hint


def recipe(tmp_path: Path, model: Path | str, *lines: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(
        f"model:\n  path: {model}\ntrain:\n  device: cpu\n"
        f"output:\n  dir: {tmp_path / 'runs' / 'x'}\n" + "".join(line + "\n" for line in lines)
    )
    return path


@pytest.fixture
def vllm_on_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in machine for the preflight: vLLM 'installed' and a Hopper GPU visible."""
    import importlib.util

    import qerl_cli.rl.preflight as preflight_mod

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real_find_spec(n, *a)
    )
    monkeypatch.setattr(preflight_mod.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(preflight_mod, "cuda_capability", lambda device: (9, 0))
    monkeypatch.setattr(preflight_mod, "installed_vllm_version", lambda: (0, 26))


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks must answer before training (a model load) starts."""
    import qerl_cli.rl.trainer as trainer_mod

    def must_not_run(*args, **kwargs):
        raise AssertionError("training started before the cheap checks refused")

    monkeypatch.setattr(trainer_mod, "train", must_not_run)


def test_dry_run_says_what_it_checked_and_writes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path
) -> None:
    rc, out, err = run(
        capsys,
        "train",
        str(recipe(tmp_path, tiny_model_dir)),
        "--set",
        "data.dataset=synthetic-addition",
        "--dry-run",
    )
    assert rc == 0, err
    assert yaml.safe_load(out)["model"]["path"] == str(tiny_model_dir)  # the YAML stays reusable on stdout
    assert "checked, nothing loaded or written:" in err
    for what in (
        "output.dir",
        "train.device",
        "model.path",
        "data.dataset",
        "rollout.engine",
        "reward grader",
    ):
        assert f"{what}:" in err
    assert "a new folder (made when the run starts)" in err and "a synthetic task" in err
    assert not (tmp_path / "runs").exists()


def test_a_hub_dataset_offline_is_refused_before_any_model_loads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, monkeypatch, no_training
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    monkeypatch.setattr("qerl_cli.data.datasets._in_local_cache", lambda hub_id: False)
    for extra in ([], ["--dry-run"]):
        rc, _, err = run(
            capsys, "train", str(recipe(tmp_path, tiny_model_dir)), "--set", "data.dataset=gsm8k", *extra
        )
        assert rc == 2, err
        assert "data.dataset gsm8k comes from the Hugging Face Hub (openai/gsm8k" in err
        assert "offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set)" in err and "data.dataset=PATH" in err
    assert not (tmp_path / "runs").exists()


def test_a_missing_local_dataset_file_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, no_training
) -> None:
    rc, _, err = run(
        capsys,
        "train",
        str(recipe(tmp_path, tiny_model_dir)),
        "--set",
        f"data.dataset={tmp_path / 'no.jsonl'}",
    )
    assert rc == 2 and f"data.dataset {tmp_path / 'no.jsonl'}: no such file" in err


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_a_dataset_file_with_other_columns_fails_the_dry_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, no_training, suffix: str
) -> None:
    """`qerl train R --set data.dataset=mine.jsonl --dry-run` passed a file whose rows are {"q", "a"}; the
    run then stopped after loading the model. The dry run names the fields and the keys that name them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / f"mine{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist([{"q": "1+1", "a": "2"}]), data)
    else:
        data.write_text({".jsonl": '{"q": "1+1", "a": "2"}\n', ".csv": "q,a\n1+1,2\n"}[suffix])
    argv = ["train", str(recipe(tmp_path, tiny_model_dir)), "--set", f"data.dataset={data}", "--dry-run"]
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and "has none of the question fields 'problem', 'question'" in err, err
    assert "its fields are 'a', 'q'" in err and "--set data.prompt_field=FIELD" in err
    rc, _, err = run(capsys, *argv, "--set", "data.prompt_field=q")
    assert rc == 2 and "--set data.answer_field=FIELD" in err, err
    rc, _, err = run(capsys, *argv, "--set", "data.prompt_field=q", "--set", "data.answer_field=a")
    assert rc == 0, err


def test_vllm_missing_is_said_before_any_model_loads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, no_training, hide_packages
) -> None:
    hide_packages("vllm")
    rc, _, err = run(
        capsys,
        "train",
        str(recipe(tmp_path, tiny_model_dir)),
        "--set",
        "rollout.engine=vllm",
        "--set",
        "data.dataset=synthetic-addition",
    )
    assert rc == 2 and "rollout.engine=vllm needs vLLM, which is not installed" in err
    assert "--set rollout.engine=hf" in err


FREE_BACKEND = "--set rollout.engine=hf --set rollout.linear_backend=auto"
HF_REMEDIES = [
    *(((f"rollout.linear_backend={b}",), FREE_BACKEND) for b in ("qerl-triton", "humming", "fp8", "merged")),
    (("rollout.tensor_parallel_size=2",), "--set rollout.engine=hf --set rollout.tensor_parallel_size=1"),
]


@pytest.mark.parametrize(("settings", "remedy"), HF_REMEDIES)
def test_the_hf_remedy_for_a_missing_vllm_also_frees_a_vllm_only_setting(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    tiny_model_dir: Path,
    no_training,
    hide_packages,
    settings: tuple[str, ...],
    remedy: str,
) -> None:
    """Without vLLM, `rollout.linear_backend=qerl-triton` (or tensor parallelism) was told to "use the HF
    engine with --set rollout.engine=hf", which the recipe then refused (the backend "chooses vLLM
    kernels"; the hf engine runs on one GPU): the remedy must be one that runs."""
    hide_packages("vllm")
    argv = ["train", str(recipe(tmp_path, tiny_model_dir)), "--set", "data.dataset=synthetic-addition",
            "--set", "rollout.engine=vllm", *(item for s in settings for item in ("--set", s))]  # fmt: skip
    rc, _, err = run(capsys, *argv, "--dry-run")
    said = " ".join(err.split())
    assert rc == 2 and remedy in said, err
    remedy = said.split("or use the HF engine with ", 1)[1].split()
    sets = [remedy[i + 1] for i, word in enumerate(remedy[:-1]) if word == "--set"]
    argv += [item for setting in sets for item in ("--set", setting)]
    rc, _, err = run(capsys, *argv, "--dry-run")  # the remedy, followed, passes
    assert rc == 0 and "rollout.engine: hf" in err, err


def test_an_output_folder_under_a_file_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, no_training
) -> None:
    (tmp_path / "afile").write_text("x")
    rc, _, err = run(
        capsys,
        "train",
        str(recipe(tmp_path, tiny_model_dir)),
        "--set",
        f"output.dir={tmp_path / 'afile' / 'run'}",
        "--dry-run",
    )
    assert rc == 2 and "cannot be written" in err and "afile is a file, not a folder" in err


def test_a_folder_holding_a_run_is_refused_by_the_dry_run_too(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path
) -> None:
    run_dir = tmp_path / "runs" / "x"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    path = recipe(tmp_path, tiny_model_dir, "data:\n  dataset: synthetic-addition")
    rc, _, err = run(capsys, "train", str(path), "--dry-run")
    assert rc == 2 and "already holds a training run" in err
    rc, _, err = run(capsys, "train", str(path), "--dry-run", "--overwrite")
    assert rc == 0 and "holds a run, which --overwrite deletes when the run starts" in err
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'  # a dry run deletes nothing


def test_the_missing_model_hint_fits_the_recipe() -> None:
    bigmath = missing_model_hint("./Qwen2.5-14B-Instruct-NVFP4")
    assert "qerl quantize Qwen/Qwen2.5-14B-Instruct --format nvfp4 -o ./Qwen2.5-14B-Instruct-NVFP4" in bigmath
    assert "--set model.path=DIR" in bigmath and "tiny-base" not in bigmath
    tiny = missing_model_hint("runs/tiny-base/nvfp4")
    assert "qerl tiny-base" in tiny and "--set model.path=DIR" in tiny
    other = missing_model_hint("/data/my-model", "mxfp4")
    assert "qerl quantize MODEL --format mxfp4 -o /data/my-model" in other and "tiny-base" not in other


def test_the_cpu_estimate_is_said_from_the_configuration(tmp_path: Path) -> None:
    """SmolLM2-135M's shape, the shipped recipe's work: an estimate, labelled as one, in minutes a step."""

    from qerl_cli.config import TrainConfig, load_config
    from qerl_cli.rl.preflight import cpu_estimate
    from qerl_cli.torch_utils import cpu_seconds

    shape = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
             "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(shape))
    cfg = load_config(TrainConfig, "smollm2_wordproblems", [f"model.path={tmp_path}"])
    line = cpu_estimate(cfg)
    assert line is not None and line.startswith("estimate on this CPU (")
    assert (
        "a step" in line
        and "for 100 steps" in line
        and "16 prompts x 8 completions of up to 128 tokens" in line
    )
    assert "135M parameters" in line and "may be off 2x" in line
    # The one measured rate the estimates rest on: AWQ of SmolLM2-135M, 256 x 2048 tokens, 2 cores, ~48 min.
    assert 40 * 60 < cpu_seconds(134_515_008, forward_tokens=256 * 2048, threads=2) < 56 * 60
    assert (
        cpu_estimate(load_config(TrainConfig, "smollm2_wordproblems", ["model.path=org/hub-model"])) is None
    )


def test_a_lora_init_folder_missing_is_refused_before_any_model_loads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, no_training
) -> None:
    path = recipe(tmp_path, tiny_model_dir, "data:\n  dataset: synthetic-addition")
    for extra in ([], ["--dry-run"]):
        rc, _, err = run(capsys, "train", str(path), "--set", "lora.init=eora", *extra)
        assert rc == 2, err
        # A BF16 model has no 4-bit rounding error to start from: the command that writes such a base.
        assert "lora.init=eora needs a 4-bit base written by `qerl quantize --lora-init eora`" in err
        assert f"{tiny_model_dir} is a BF16 model: `qerl quantize {tiny_model_dir} --format nvfp4" in err
        assert "--lora-init eora" in err and "lora.init=zeros" in err and "Traceback" not in err


def test_liger_missing_is_refused_before_any_model_loads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, no_training, hide_packages
) -> None:
    hide_packages("liger_kernel")
    path = recipe(tmp_path, tiny_model_dir, "data:\n  dataset: synthetic-addition")
    for extra in ([], ["--dry-run"]):
        rc, _, err = run(capsys, "train", str(path), "--set", "train.fused_kernels=liger", *extra)
        assert rc == 2, err
        assert "train.fused_kernels=liger needs liger-kernel, which is not installed" in err
        assert 'pip install -e ".[liger]"' in err and "Traceback" not in err


def test_fp8_base_compute_without_a_gpu_is_refused_before_any_model_loads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, monkeypatch, no_training
) -> None:
    path = recipe(tmp_path, tiny_model_dir, "data:\n  dataset: synthetic-addition")
    sets = ["--set", "train.base_compute=fp8"]
    # A BF16 base computes in BF16 whatever the setting: nothing to refuse.
    rc, _, err = run(capsys, "train", str(path), *sets, "--dry-run")
    assert rc == 0 and "train.base_compute: fp8: the base is BF16" in err
    monkeypatch.setattr("qerl_cli.rl.preflight.declared_format", lambda cfg: "nvfp4")  # a 4-bit base
    for extra in ([], ["--dry-run"]):
        rc, _, err = run(capsys, "train", str(path), *sets, *extra)
        assert rc == 2, err
        assert "train.base_compute=fp8 cannot run: training runs on the CPU" in err
        assert "needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9" in err
        assert "Set train.base_compute to auto or bf16" in err and "Traceback" not in err


def test_the_declared_format_comes_from_the_setting_or_the_folder(tmp_path: Path) -> None:
    from qerl_cli.config import TrainConfig
    from qerl_cli.rl.preflight import declared_format

    cfg = TrainConfig()
    cfg.model.path, cfg.model.format = str(tmp_path), "nf4"
    assert declared_format(cfg) == "nf4"
    cfg.model.format = "auto"
    assert declared_format(cfg) is None  # no config.json: known only when the model loads
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    assert declared_format(cfg) == "bf16"
    nvfp4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": nvfp4}))
    assert declared_format(cfg) == "nvfp4"


def test_a_misspelt_template_is_refused_before_any_model_loads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, no_training
) -> None:
    """`data.template=plian` passed --dry-run and was refused only once the model had loaded."""
    path = recipe(tmp_path, tiny_model_dir, "data:\n  dataset: synthetic-addition")
    for dry_run in ([], ["--dry-run"]):
        rc, _, err = run(capsys, "train", str(path), "--set", "data.template=plian", *dry_run)
        assert rc == 2 and "data.template=plian is not a prompt template (did you mean plain?)" in err, err
        assert "choose one of qerl, boxed, plain, qerl-fewshot" in err and "estimate" not in err
    rc, _, err = run(capsys, "train", str(path), "--set", "data.template=plain", "--dry-run")
    assert rc == 0 and "data.template: plain: question only" in err, err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet", ".json"])
def test_a_dataset_file_without_records_is_refused_before_any_model_loads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, no_training, suffix: str
) -> None:
    """An empty .jsonl was told to name its question field (its "fields are none"); a .csv header without
    rows passed --dry-run and was refused ("has no rows") only once the model had loaded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / f"empty{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist([], schema=pa.schema([("question", pa.string())])), data)
    else:
        data.write_text({".jsonl": "\n", ".csv": "question,answer\n", ".json": "[]"}[suffix])
    argv = ["train", str(recipe(tmp_path, tiny_model_dir)), "--set", f"data.dataset={data}"]
    for dry_run in ([], ["--dry-run"]):
        rc, _, err = run(capsys, *argv, *dry_run)
        assert rc == 2 and f"{data} holds no records (no problems to read)" in err, err
        assert "prompt_field" not in err
    rc, _, err = run(capsys, "eval", str(tiny_model_dir), "--engine", "hf", "--benchmarks", "gsm8k",
                     "--data-file", f"gsm8k={data}", "--dry-run")  # fmt: skip
    assert rc == 2 and f"{data} holds no records" in err, err


@pytest.mark.parametrize(
    ("settings", "env", "said"),
    [
        ([], {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, "qerl-triton: needs vLLM's engine in this process"),
        (["model.dtype=float16"], {}, "qerl-triton: computes in bfloat16, but the rollout dtype is float16"),
        (["rollout.vllm_kwargs={pipeline_parallel_size: 2}"], {}, "start workers in other processes"),
    ],
)
def test_qerl_triton_where_it_cannot_serve_is_refused_before_any_model_loads(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    tiny_model_dir: Path,
    no_training,
    vllm_on_hopper,
    settings: list[str],
    env: dict[str, str],
    said: str,
) -> None:
    """qerl's kernel in vLLM needs one GPU and vLLM's engine in qerl's process: the dry run says so (on a
    stand-in Hopper GPU with vLLM 'installed'), not the engine after the trainer's model loaded."""
    import qerl_cli.rl.preflight as preflight_mod

    monkeypatch.setattr(preflight_mod, "folder_format", lambda path: "nvfp4")  # as an NVFP4 base
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    argv = ["train", str(recipe(tmp_path, tiny_model_dir)), "--dry-run", "--set", "rollout.engine=vllm",
            "--set", "rollout.linear_backend=qerl-triton",
            "--set", "data.dataset=synthetic-addition"]  # fmt: skip
    for setting in settings:
        argv += ["--set", setting]
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and said in " ".join(err.split()), err
    # A BF16 base keeps vLLM's default under the same recipe (one recipe serves both arms), and a base
    # whose format is known only once loaded (a Hub id) is asked when the engine starts: not refused here.
    for found in ("bf16", None):
        monkeypatch.setattr(preflight_mod, "folder_format", lambda path, found=found: found)
        rc, _, err = run(capsys, *argv)
        assert rc == 0, err


def test_qerl_triton_on_an_mxfp4_base_is_refused_before_any_model_loads(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    tiny_model_dir: Path,
    no_training,
    vllm_on_hopper,
) -> None:
    """docs/rollout.md: qerl-triton needs an NVFP4 base (not MXFP4), refused in the preflight. An MXFP4
    base passed --dry-run ("rollout.engine: vllm: installed, GPU visible") and was refused only when the
    engine was built, after the trainer's model had loaded."""
    import json
    import shutil

    import qerl_cli.rl.preflight as preflight_mod

    base = tmp_path / "mxfp4-base"
    shutil.copytree(tiny_model_dir, base)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
    (base / "config.json").write_text(json.dumps(config))
    argv = ["train", str(recipe(tmp_path, base)), "--set", "rollout.engine=vllm",
            "--set", "rollout.linear_backend=qerl-triton", "--set", "model.dtype=bfloat16",
            "--set", "data.dataset=synthetic-addition"]  # fmt: skip
    for dry_run in ([], ["--dry-run"]):
        rc, _, err = run(capsys, *argv, *dry_run)
        said = " ".join(err.split())
        assert rc == 2 and "rollout.linear_backend=qerl-triton: qerl's kernel reads NVFP4" in said, err
        assert "a mxfp4 checkpoint runs on marlin" in said, err
    # The same recipe on an NVFP4 base passes.
    monkeypatch.setattr(preflight_mod, "folder_format", lambda path: "nvfp4")
    rc, _, err = run(capsys, *argv, "--dry-run")
    assert rc == 0 and "rollout.engine: vllm" in err, err


def test_the_hf_remedy_for_a_machine_without_a_gpu_also_frees_a_vllm_only_backend(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    tiny_model_dir: Path,
    no_training,
) -> None:
    """vLLM installed on a machine without a GPU: the same remedy, one that the recipe then takes."""
    import importlib.util

    import qerl_cli.rl.preflight as preflight_mod

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real_find_spec(n, *a)
    )
    monkeypatch.setattr(preflight_mod.torch.cuda, "is_available", lambda: False)
    argv = ["train", str(recipe(tmp_path, tiny_model_dir)), "--set", "data.dataset=synthetic-addition",
            "--set", "rollout.engine=vllm", "--set", "rollout.linear_backend=qerl-triton",
            "--dry-run"]  # fmt: skip
    rc, _, err = run(capsys, *argv)
    said = " ".join(err.split())
    assert rc == 2 and "needs a CUDA GPU and this machine has none" in said, err
    assert "--set rollout.engine=hf --set rollout.linear_backend=auto" in said, err


@pytest.mark.parametrize("backend", ["merged", "fp8-merged", "fp8", "marlin", "auto"])
def test_trained_norms_on_vllm_are_refused_at_config_time_with_a_remedy_that_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, no_training, backend: str
) -> None:
    """`lora.train_norms=true` with `linear_backend=merged` was told "set lora.train_norms=false or
    rollout.linear_backend=fp8", and fp8 (as every vLLM backend: vLLM serves LoRA matrices only) passed the
    checks to be refused at the first adapter sync, after the model and vLLM had loaded."""
    argv = ["train", str(recipe(tmp_path, tiny_model_dir)), "--set", "data.dataset=synthetic-addition",
            "--set", "rollout.engine=vllm", "--set", f"rollout.linear_backend={backend}",
            "--set", "lora.train_norms=true"]  # fmt: skip
    rc, _, err = run(capsys, *argv, "--dry-run")
    said = " ".join(err.split())
    assert rc == 2 and "set lora.train_norms=false" in said, err
    assert "linear_backend=fp8" not in said.split("set lora.train_norms=false", 1)[1], err
    remedy = said.split(" with --set ", 1)[1].split()
    sets = ["--set", remedy[0]] + [item for i, w in enumerate(remedy[:-1]) if w == "--set"
                                   for item in ("--set", remedy[i + 1])]  # fmt: skip
    rc, _, err = run(capsys, *argv, *sets, "--dry-run")  # the remedy, followed, passes
    assert rc == 0 and "rollout.engine: hf" in err, err
