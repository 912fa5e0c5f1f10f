"""``qerl bench kernels``, ``update``, ``scaling`` and ``quality``: the benchmarks with a JSON file of
their own (``bench.json``'s three are in :mod:`qerl_cli.cli.bench`).

Each checks its arguments before torch is imported and exits 2 naming the flag; ``--dry-run`` prints
the resolved settings as YAML and runs nothing. ``kernels``, ``update`` and ``quality`` resolve their
settings (:mod:`qerl_cli.bench.settings`) as every stage does: ``--config`` < flags < ``--set``;
``scaling`` takes a training recipe and ``--set`` its keys.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.markup import escape

from qerl_cli.bench.preflight import (
    Requirement,
    check_output,
    check_requirements,
    check_tool,
    describe_model,
    package_available,
    resolve_engine,
)
from qerl_cli.bench.settings import (
    DEFAULT_QUALITY_ROWS,
    KernelsSettings,
    QualitySettings,
    UpdateSettings,
    auto_last,
    check_choices,
    parse_row,
)
from qerl_cli.cli.app import (
    ConfigOption,
    DryRunOption,
    check_recipe_path,
    command_line,
    config_option,
    console,
    csv,
    finish_config,
    given_flags,
    print_plan,
    set_option,
    use_free_cpu_threads,
)
from qerl_cli.cli.bench import DeviceOption, check_exists, check_formats
from qerl_cli.cli.gemm_options import (
    GemmBackendsOption,
    GemmRowsOption,
    GemmShapesOption,
    GemmTuneOption,
    gemm_plan,
    gemm_settings,
)
from qerl_cli.cli.stages import print_checks
from qerl_cli.config import TrainConfig, load_config
from qerl_cli.config.choices import BaseCompute, FusedKernels
from qerl_cli.errors import Checked, QerlError
from qerl_cli.files import check_input_not_replaced

S = TypeVar("S")
OutputOption = Annotated[
    str | None,
    typer.Option("--output", "-o", metavar="DIR", help="Folder of the report.", show_default="bench_results"),
]
KernelsSet, UpdateSet, QualitySet = (
    set_option("iters=20"),
    set_option("sequences=64"),
    set_option("seq_len=512"),
)
ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        metavar="MODEL",
        help="SHAPE (qwen2.5-7b, tiny, ...; random weights in each format) or a BF16 folder.",
        show_default="qwen2.5-7b on a GPU, else tiny",
    ),
]


def positive(flag: str, value: int) -> int:
    if value < 1:
        raise QerlError(f"{flag} must be a positive integer, got {value}")
    return value


def default_model(model: str | None, device: str) -> str:
    """The benchmarks' model: a 7B shape on a GPU, the tiny one on a CPU (only then is torch asked)."""
    if model:
        return model
    if device.startswith("cpu"):
        return "tiny"
    import torch

    return "qwen2.5-7b" if torch.cuda.is_available() else "tiny"


def default_fused() -> str:
    """``--fused``'s default: Liger beside the plain update where liger-kernel is installed (the dev install
    has none, and its default must run there). Asked of the package index, not of
    ``modeling.fused_kernels``, whose import would bring torch before the arguments are checked."""
    return "off,liger" if package_available("liger_kernel") else "off"


def _done(path: Path, errors: bool) -> None:
    console.print(f"wrote {escape(str(path))}")
    if errors:  # a section or case without figures: its error is in the report
        raise typer.Exit(1)


K, U, Q = KernelsSettings, UpdateSettings, QualitySettings  # the --help defaults below are theirs


def option(cls: type, key: str, flag: str, metavar: str, kind: type = int) -> Any:
    """The flag of settings key ``key`` of ``cls``: None ("not given") unless typed, so that --config can
    set the key; its --help is the comment above the field (the settings' one home of it) and shows the
    settings' default."""
    return Annotated[kind | None, config_option(cls, key, flag, metavar=metavar)]


PackOption = Annotated[bool | None, typer.Option("--pack", help="Pack sequences (train.pack_sequences).")]
ProfileOption = Annotated[
    bool | None, typer.Option("--profile", help="Also the GPU time by kernel category (CUDA profiler).")
]
FusedOption = Annotated[
    str | None,
    typer.Option(
        "--fused",
        metavar="KIND,...",
        help=f"train.fused_kernels per case: {', '.join(auto_last(FusedKernels))}.",
        show_default="off,liger with liger-kernel installed, else off",
    ),
]


def load_settings(cls: type[S], values: dict[str, Any], config: Path | None, sets: list[str] | None) -> S:
    """A tool benchmark's settings: ``--config`` < its flags (None: not given) < ``--set``, checked by
    the class (an error names the flag that set a key); formats from any of them against the registry."""
    check_recipe_path(config, "--config")
    check_formats(values.get("formats"), "--formats")
    flags = given_flags(values, sets)
    conf = load_config(cls, config, sets, flags=flags, **values)
    check_formats(getattr(conf, "formats", None), flags.get("formats", "formats"))
    return conf


def kernels(
    model: ModelOption = None,
    formats: option(K, "formats", "--formats", "FMT,...", str) = None,
    batch: option(K, "batch", "--batch", "N") = None,
    seq_len: option(K, "seq_len", "--seq-len", "TOKENS") = None,
    iters: option(K, "iters", "--iters", "N") = None,
    device: DeviceOption = None,
    output: OutputOption = None,
    gemm_shapes: GemmShapesOption = None,
    gemm_rows: GemmRowsOption = None,
    gemm_backends: GemmBackendsOption = None,
    gemm_tune: GemmTuneOption = True,
    config: ConfigOption = None,
    set_: KernelsSet = None,
    dry_run: DryRunOption = False,
) -> None:
    """4-bit weights' own costs per format: dequant bandwidth, memory, a layer's fwd+bwd vs BF16.

    Dequantization of the widest projection against a device copy, the model's memory as the trainer
    loads it, and the first decoder layer's forward + input-gradient backward against the same layer
    holding the dequantized weights in BF16 (float32 on the CPU). On a GPU, with nvfp4, also the decode
    GEMMs of the --gemm-shapes' linears per backend (and qerl's kernel in each candidate tile config).
    """
    values = dict(model=model, formats=csv(formats), batch=batch, seq_len=seq_len, iters=iters, device=device,
                  output=output)  # fmt: skip
    conf = load_settings(KernelsSettings, values, config, set_)
    checks = check_tool(
        conf.output, conf.device, default_model(conf.model, conf.device), device_flag="--device"
    )
    gemm = gemm_settings(gemm_shapes, gemm_rows, gemm_backends, gemm_tune)
    if finish_config(conf, dry_run):
        print_checks(checks)
        print_plan(gemm_plan(gemm, conf.formats, conf.device))  # flags, not config keys: the plan's
        return
    from qerl_cli.bench.kernels import REPORT_NAME, kernels_table, run_kernels

    use_free_cpu_threads()
    conf.model = default_model(conf.model, conf.device)
    report = run_kernels(conf, command=command_line(), gemm_settings=gemm)
    console.print(kernels_table(report))
    _done(Path(conf.output) / REPORT_NAME, bool(report["errors"]))


def update(
    model: ModelOption = None,
    formats: option(U, "formats", "--formats", "FMT,...", str) = None,
    fused: FusedOption = None,
    base_compute: option(U, "base_compute", "--base-compute", "KIND,...", str) = None,
    sequences: option(U, "sequences", "--sequences", "N") = None,
    group: option(U, "group", "--group", "N") = None,
    prompt_len: option(U, "prompt_len", "--prompt-len", "TOKENS") = None,
    gen_len: option(U, "gen_len", "--gen-len", "TOKENS") = None,
    micro_batch: option(U, "micro_batch", "--micro-batch", "N|auto", str) = None,
    checkpointing: option(U, "checkpointing", "--checkpointing", "auto|on|off", str) = None,
    pack: PackOption = None,
    lora_rank: option(U, "lora_rank", "--lora-rank", "RANK") = None,
    profile: ProfileOption = None,
    device: DeviceOption = None,
    output: OutputOption = None,
    config: ConfigOption = None,
    set_: UpdateSet = None,
    dry_run: DryRunOption = False,
) -> None:
    """The GRPO update phase alone: seconds, tokens/s, MFU, peak memory per format, fused kernels and
    base compute (--base-compute bf16,fp8 measures both side by side).

    Random rollouts of exactly --prompt-len + --gen-len tokens, one warm-up update, one timed.
    """
    values = dict(
        model=model, formats=csv(formats), fused=check_choices("--fused", fused, FusedKernels),
        base_compute=check_choices("--base-compute", base_compute, BaseCompute), sequences=sequences,
        group=group, prompt_len=prompt_len, gen_len=gen_len, micro_batch=micro_batch,
        checkpointing=checkpointing, pack=pack, lora_rank=lora_rank, profile=profile, device=device,
        output=output,
    )  # fmt: skip
    conf = load_settings(UpdateSettings, values, config, set_)
    conf.fused = update_fused(conf.fused)
    gpu_only = "--profile" if conf.profile else None
    checks = check_tool(
        conf.output, conf.device, default_model(conf.model, conf.device), gpu_only, device_flag="--device"
    )
    if finish_config(conf, dry_run):
        print_checks(checks)
        return
    from qerl_cli.bench.update import REPORT_NAME, run_update, update_table

    use_free_cpu_threads()
    conf.model = default_model(conf.model, conf.device)
    report = run_update(conf, command=command_line())
    console.print(update_table(report))
    for row in report["rows"]:  # the table cuts an error short: each in full, once
        if "error" in row:
            compute = row.get("base_compute", "bf16")
            case = f"{row['format']}, fused {row['fused_kernels']}, base compute {compute}"
            console.print(f"error ({case}): {row['error']}", markup=False, highlight=False)
    _done(Path(conf.output) / REPORT_NAME, any("error" in row for row in report["rows"]))


def update_fused(kinds: list[str] | None) -> list[str]:
    """The fused-kernel cases: those given, else what is installed; Liger asked for must be installed."""
    chosen = kinds if kinds is not None else check_choices("--fused", default_fused(), FusedKernels) or []
    if "liger" in chosen:
        check_requirements([Requirement("liger_kernel", "liger", "--fused liger")])
    return chosen


ScalingSet = set_option("train.max_steps=5")
ScalingModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        metavar="MODEL",
        help="A model folder, or a SHAPE (qwen2.5-7b, ...: random weights in --format), for model.path.",
    ),
]
ScalingFormatOption = Annotated[
    str | None,
    typer.Option("--format", metavar="FORMAT", help="The format of a --model SHAPE.", show_default="nvfp4"),
]
SyntheticOption = Annotated[
    bool,
    typer.Option(
        "--synthetic",
        help="Synthetic prompts and random rewards, as bench e2e (for random weights, where grading "
        "measures nothing).",
    ),
]
ScalingDeviceOption = Annotated[
    str | None,
    typer.Option(
        "--device", metavar="DEVICE", help="train.device of the run: auto, cpu or cuda[:N].",
        show_default="the recipe's",
    ),
]  # fmt: skip


def scaling(
    recipe: Annotated[
        Path, typer.Argument(metavar="RECIPE", help="Training recipe: a path or a shipped recipe's name.")
    ],
    steps: Annotated[
        int, typer.Option("--steps", metavar="N", help="GRPO steps (the first is left out of the means).")
    ] = 3,
    prompts_per_gpu: Annotated[
        int | None,
        typer.Option(
            "--prompts-per-gpu",
            metavar="N",
            help="Weak scaling: N prompts per step per process (without it: the recipe's global batch).",
        ),
    ] = None,
    reference: Annotated[
        str | None,
        typer.Option("--reference", metavar="JSON", help="scaling.json of a run on fewer GPUs (efficiency)."),
    ] = None,
    model: ScalingModelOption = None,
    model_format: ScalingFormatOption = None,
    synthetic: SyntheticOption = False,
    device: ScalingDeviceOption = None,
    output: OutputOption = "bench_results",
    set_: ScalingSet = None,
    dry_run: DryRunOption = False,
) -> None:
    """Data-parallel GRPO: step time, tokens/s per GPU, scaling efficiency against --reference.

    One world size per run: `qerl bench scaling RECIPE -o one` on one GPU, then `torchrun
    --nproc-per-node N -m qerl_cli bench scaling RECIPE --reference one/scaling.json -o n`. The last
    step is checkpointed: `qerl train n/run/config.yaml --resume n/run --set train.max_steps=MORE` goes
    on, on any number of GPUs (with the recipe's reward: --synthetic's random rewards are the bench's).
    """
    positive("--steps", steps)
    if prompts_per_gpu is not None:
        positive("--prompts-per-gpu", prompts_per_gpu)
    if model_format is not None:
        check_formats([model_format], "--format")
    check_exists(reference, "--reference", "the scaling.json of a run on fewer GPUs")
    run_dir = Path(output) / "run"
    if int(os.environ.get("RANK", "0")) == 0 and run_dir.exists():  # rank 0: the others start alongside
        raise QerlError(f"{run_dir} exists (an earlier scaling run): choose another --output or remove it")
    if model_format is not None and not model:  # before bench.scaling's import, which brings torch
        raise QerlError("--format names the format of a --model SHAPE; give --model too")
    if device:  # its name, as typed (it sets the recipe's train.device, which the user did not write)
        from qerl_cli.torch_utils import parse_device

        parse_device(device, "--device")
    sets = [f"train.device={device}", *(set_ or [])] if device else set_  # --set train.device wins
    check_recipe_path(recipe)
    conf = load_config(TrainConfig, recipe, sets)
    from qerl_cli.bench.models import is_shape
    from qerl_cli.bench.scaling import REPORT_NAME, model_folder, read_reference, scaled_config

    if reference:  # read as the run reads it first: a folder or another report fails the dry run too
        read_reference(reference)
        check_input_not_replaced(reference, "--reference", REPORT_NAME, output, "the reference run")
    if model:
        conf.model.path = str(model_folder(model, model_format, write=not dry_run, synthetic=synthetic))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    conf = scaled_config(conf, Path(output), steps, prompts_per_gpu, world, synthetic=synthetic)
    check_output(output)
    if conf.rollout.engine == "vllm":  # the recipe's engine: a GPU and vLLM, checked before the model loads
        resolve_engine("vllm")
    # A dry run writes no --model SHAPE's checkpoint: the shape stands for it in the checks.
    shape = model if model and not Path(conf.model.path).is_dir() and is_shape(model) else None
    if finish_config(conf, dry_run):  # the YAML, then the checks of `qerl train` on the run it trains
        print_checks(scaling_checks(conf, shape))
        return
    scaling_checks(conf, shape)  # seconds, before a model loads for minutes
    from qerl_cli.bench.scaling import run_scaling, scaling_table
    from qerl_cli.torch_utils import runs_on_cpu

    if runs_on_cpu(conf.train.device):
        use_free_cpu_threads()
    report = run_scaling(conf, output, command=command_line(), steps=steps, prompts_per_gpu=prompts_per_gpu,
                         reference=reference, synthetic=synthetic)  # fmt: skip
    if int(os.environ.get("RANK", "0")) == 0:
        console.print(scaling_table(report))
        _done(Path(output) / REPORT_NAME, False)


def scaling_checks(conf: TrainConfig, shape: str | None) -> list[Checked]:
    """`qerl train`'s checks before work (:mod:`qerl_cli.rl.preflight`) on the run the benchmark trains, so
    a missing model, dataset or engine fails in seconds. ``shape``: a --model SHAPE not written yet."""
    from qerl_cli.rl import preflight as train_checks

    if shape is None:
        return train_checks.preflight(conf, resume=None, overwrite=False)
    return [
        train_checks.output_folder(conf.output.dir, resume=None, overwrite=False),
        Checked("model.path", f"{conf.model.path}: {describe_model(shape)}"),
        train_checks.dataset(conf),
        train_checks.engine(conf),
        train_checks.grader(),
    ]


def quality(
    model: Annotated[
        str, typer.Argument(metavar="BF16_MODEL", help="The BF16 model (folder, .gguf or alias).")
    ],
    rows: Annotated[
        str | None,
        typer.Option(
            "--rows",
            metavar="FORMAT-METHOD,...",
            help="The bases to make and measure.",
            show_default=f"{','.join(DEFAULT_QUALITY_ROWS)} (the awq row only with llm-compressor installed)",
        ),
    ] = None,
    calib_samples: option(Q, "calib_samples", "--calib-samples", "N") = None,
    seq_len: option(Q, "seq_len", "--seq-len", "TOKENS") = None,
    heldout_rows: option(Q, "heldout_rows", "--heldout-rows", "N") = None,
    device: DeviceOption = None,
    output: OutputOption = None,
    config: ConfigOption = None,
    set_: QualitySet = None,
    dry_run: DryRunOption = False,
) -> None:
    """Quantize one BF16 model per --rows format and method, then measure what each base keeps.

    Perplexity, KL to BF16 and top-1 agreement on held-out text, by the library of `qerl quality`
    (which measures bases you already have), beside each base's weight error.
    """
    values = dict(model=model, rows=csv(rows), calib_samples=calib_samples, seq_len=seq_len,
                  heldout_rows=heldout_rows, device=device, output=output)  # fmt: skip
    conf = load_settings(QualitySettings, values, config, set_)
    conf.rows = quality_rows(conf.rows)
    from qerl_cli.modeling.source_checks import model_source_found

    checks = check_tool(conf.output, conf.device, None, device_flag="--device")
    # A stage's model (folder, .gguf, alias), not a bench --model shape: checked as a stage checks one.
    found = model_source_found(conf.model, what="BF16_MODEL")
    if finish_config(conf, dry_run):
        print_checks([Checked("BF16_MODEL", found), *checks])
        return
    from qerl_cli.bench.quality import REPORT_NAME, run_quality

    use_free_cpu_threads()
    report = run_quality(conf, command=command_line())
    console.print((Path(conf.output) / "quality.md").read_text(), markup=False, highlight=False)
    made = [r for r in report["rows"] if "skipped" not in r]
    _done(Path(conf.output) / REPORT_NAME, not made)  # a table of skipped rows only is a failed run


def quality_rows(given: list[str] | None) -> list[str]:
    """The rows measured: those given (AWQ / GPTQ ones need llm-compressor), else the default rows that
    what is installed can make."""

    chosen = list(given if given is not None else DEFAULT_QUALITY_ROWS)
    calibrated = [row for row in chosen if parse_row(row)[1] != "rtn"]  # AWQ, GPTQ: llm-compressor's
    if calibrated and not package_available("llmcompressor"):
        if given is not None:  # asked for by name: it must run
            check_requirements([Requirement("llmcompressor", "quantize", f"--rows {','.join(calibrated)}")])
        chosen = [row for row in chosen if row not in calibrated]  # the default measures what is installed
    return chosen
