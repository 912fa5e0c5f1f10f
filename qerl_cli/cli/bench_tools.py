"""``qerl bench kernels``, ``update``, ``scaling`` and ``quality``: the benchmarks with a JSON file of
their own (``bench.json``'s three are in :mod:`qerl_cli.cli.bench`).

Each checks its arguments before torch is imported and exits 2 naming the flag; ``--dry-run`` prints
the resolved settings as YAML and runs nothing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.markup import escape

from qerl_cli import config as cfg
from qerl_cli.bench.preflight import (
    Requirement,
    check_output,
    check_requirements,
    describe_model,
    gpu_available,
    package_available,
    resolve_engine,
)
from qerl_cli.cli.app import (
    DryRunOption,
    command_line,
    console,
    csv,
    finish_config,
    set_option,
    use_free_cpu_threads,
)
from qerl_cli.cli.bench import check_exists, check_formats
from qerl_cli.errors import QerlError

# bench quality's rows when --rows is not given (its AWQ row where llm-compressor is installed).
DEFAULT_QUALITY_ROWS = "nvfp4-rtn,nvfp4-awq,mxfp4-rtn,nf4-rtn"
OutputOption = Annotated[str, typer.Option("--output", "-o", metavar="DIR", help="Folder of the report.")]
DeviceOption = Annotated[str, typer.Option("--device", metavar="DEVICE", help="auto, cpu or cuda[:N].")]
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


def check_tool(output: str, device: str, model: str | None, gpu_only: str | None = None) -> None:
    """What a benchmark with its own report can check before any work (--dry-run included): the output
    folder, a GPU where ``--device cuda`` (or ``gpu_only``, a flag) asks for one, the model."""
    check_output(output)
    if gpu_only and device.startswith("cpu"):
        raise QerlError(f"{gpu_only} needs a GPU, and --device {device} runs on the CPU: leave one out")
    if (device.startswith("cuda") or gpu_only) and not gpu_available():
        what = gpu_only or f"--device {device}"
        raise QerlError(f"{what} needs a GPU (CUDA) and none is visible; use --device cpu (or leave it out)")
    if model:
        describe_model(model)


def dry_run_settings(settings: dict[str, Any], dry_run: bool) -> bool:
    """Print ``settings`` as YAML for --dry-run; True when the command should stop."""
    if dry_run:
        sys.stdout.write(yaml.safe_dump(settings, sort_keys=False))
    return dry_run


def _done(path: Path, errors: bool) -> None:
    console.print(f"wrote {escape(str(path))}")
    if errors:  # a section or case without figures: its error is in the report
        raise typer.Exit(1)


def kernels(
    model: ModelOption = None,
    formats: Annotated[
        str, typer.Option("--formats", metavar="FMT,...", help="Comma list of 4-bit formats (and bf16).")
    ] = "nvfp4,mxfp4,nf4",
    batch: Annotated[int, typer.Option("--batch", metavar="N", help="Sequences through the layer.")] = 8,
    seq_len: Annotated[int, typer.Option("--seq-len", metavar="TOKENS", help="Tokens per sequence.")] = 1024,
    iters: Annotated[int, typer.Option("--iters", metavar="N", help="Timed calls per figure (median).")] = 10,
    device: DeviceOption = "auto",
    output: OutputOption = "bench_results",
    dry_run: DryRunOption = False,
) -> None:
    """4-bit weights' own costs per format: dequant bandwidth, memory, a layer's fwd+bwd vs BF16.

    Dequantization of the widest projection against a device copy, the model's memory as the trainer
    loads it, and the first decoder layer's forward + input-gradient backward against the same layer
    holding the dequantized weights in BF16 (float32 on the CPU).
    """
    chosen = csv(formats) or []
    check_formats(chosen or None, "--formats")
    if not chosen:
        raise QerlError("--formats needs at least one format (e.g. nvfp4)")
    for flag, value in (("--batch", batch), ("--seq-len", seq_len), ("--iters", iters)):
        positive(flag, value)
    settings = dict(
        model=model,
        formats=[f.lower() for f in chosen],
        batch=batch,
        seq_len=seq_len,
        iters=iters,
        device=device,
        output=output,
    )
    check_tool(output, device, model)
    if dry_run_settings(settings, dry_run):
        return
    from qerl_cli.bench.kernels import REPORT_NAME, kernels_table, run_kernels

    use_free_cpu_threads()
    settings["model"] = default_model(model, device)
    out = settings.pop("output")
    report = run_kernels(**settings, out_dir=out, command=command_line())
    console.print(kernels_table(report))
    _done(Path(out) / REPORT_NAME, bool(report["errors"]))


def update(
    model: ModelOption = None,
    formats: Annotated[
        str, typer.Option("--formats", metavar="FMT,...", help="Comma list of base formats.")
    ] = "bf16,nvfp4",
    fused: Annotated[
        str | None,
        typer.Option(
            "--fused",
            metavar="KIND,...",
            help="train.fused_kernels per case: off, liger, auto.",
            show_default="off,liger with liger-kernel installed, else off",
        ),
    ] = None,
    base_compute: Annotated[
        str,
        typer.Option(
            "--base-compute",
            metavar="KIND,...",
            help="train.base_compute per case: bf16, fp8, auto (the 4-bit base's GEMMs).",
        ),
    ] = "bf16",
    sequences: Annotated[int, typer.Option("--sequences", metavar="N", help="Rollouts in the batch.")] = 32,
    group: Annotated[int, typer.Option("--group", metavar="N", help="Completions per prompt.")] = 8,
    prompt_len: Annotated[int, typer.Option("--prompt-len", metavar="TOKENS", help="Prompt tokens.")] = 256,
    gen_len: Annotated[int, typer.Option("--gen-len", metavar="TOKENS", help="Completion tokens.")] = 2048,
    micro_batch: Annotated[
        str,
        typer.Option("--micro-batch", metavar="N|auto", help="Sequences per micro-batch (auto: the plan's)."),
    ] = "auto",
    checkpointing: Annotated[
        str, typer.Option("--checkpointing", metavar="auto|on|off", help="Gradient checkpointing.")
    ] = "auto",
    pack: Annotated[bool, typer.Option("--pack", help="Pack sequences (train.pack_sequences).")] = False,
    lora_rank: Annotated[int, typer.Option("--lora-rank", metavar="RANK", help="LoRA rank.")] = 16,
    profile: Annotated[
        bool, typer.Option("--profile", help="Also the GPU time by kernel category (CUDA profiler).")
    ] = False,
    device: DeviceOption = "auto",
    output: OutputOption = "bench_results",
    dry_run: DryRunOption = False,
) -> None:
    """The GRPO update phase alone: seconds, tokens/s, MFU, peak memory per format, fused kernels and
    base compute (--base-compute bf16,fp8 measures both side by side).

    Random rollouts of exactly --prompt-len + --gen-len tokens, one warm-up update, one timed.
    """
    chosen = csv(formats) or []
    check_formats(chosen or None, "--formats")
    kinds, computes = update_cases(fused, base_compute)
    if not chosen:
        raise QerlError("--formats needs at least one format (e.g. bf16,nvfp4)")
    for flag, value in (
        ("--sequences", sequences),
        ("--group", group),
        ("--prompt-len", prompt_len),
        ("--gen-len", gen_len),
        ("--lora-rank", lora_rank),
    ):
        positive(flag, value)
    if sequences % group:  # GRPO's groups: every prompt has --group completions
        raise QerlError(f"--sequences ({sequences}) must be a multiple of --group ({group})")
    micro: int | str = micro_batch if micro_batch == "auto" else positive("--micro-batch", _int(micro_batch))
    modes = {"auto": "auto", "on": True, "off": False}
    if checkpointing not in modes:
        raise QerlError(f"--checkpointing takes auto, on or off; got {checkpointing!r}")
    settings = dict(
        model=model,
        formats=[f.lower() for f in chosen],
        fused=kinds,
        base_compute=computes,
        sequences=sequences,
        group=group,
        prompt_len=prompt_len,
        gen_len=gen_len,
        micro_batch=micro,
        checkpointing=modes[checkpointing],
        pack=pack,
        lora_rank=lora_rank,
        profile=profile,
        device=device,
    )
    check_tool(output, device, model, gpu_only="--profile" if profile else None)
    if dry_run_settings({**settings, "output": output}, dry_run):
        return
    from qerl_cli.bench.update import REPORT_NAME, UpdateSettings, run_update, update_table

    use_free_cpu_threads()
    settings["model"] = default_model(model, device)
    report = run_update(UpdateSettings(**settings), output, command=command_line())
    console.print(update_table(report))
    for row in report["rows"]:  # the table cuts an error short: each in full, once
        if "error" in row:
            compute = row.get("base_compute", "bf16")
            case = f"{row['format']}, fused {row['fused_kernels']}, base compute {compute}"
            console.print(f"error ({case}): {row['error']}", markup=False, highlight=False)
    _done(Path(output) / REPORT_NAME, any("error" in row for row in report["rows"]))


def update_cases(fused: str | None, base_compute: str) -> tuple[list[str], list[str]]:
    """``--fused`` (its default: what is installed) and ``--base-compute`` checked: (fused kinds, base
    computes); Liger asked for must be installed."""
    kinds = csv(fused if fused is not None else default_fused()) or []
    unknown = [k for k in kinds if k not in ("off", "liger", "auto")]
    if unknown or not kinds:
        raise QerlError(f"--fused takes a comma list of off, liger, auto; got {fused!r}")
    if "liger" in kinds:
        check_requirements([Requirement("liger_kernel", "liger", "--fused liger")])
    computes = csv(base_compute) or []
    if not computes or any(c not in ("bf16", "fp8", "auto") for c in computes):
        raise QerlError(f"--base-compute takes a comma list of bf16, fp8, auto; got {base_compute!r}")
    return kinds, computes


def _int(text: str) -> int:
    if not text.isdigit():
        raise QerlError(f"--micro-batch takes a positive integer or auto, got {text!r}")
    return int(text)


ScalingSet = set_option("train.max_steps=5")


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
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            metavar="MODEL",
            help="A model folder, or a SHAPE (qwen2.5-7b, ...: random weights in --format), for model.path.",
        ),
    ] = None,
    model_format: Annotated[
        str | None,
        typer.Option(
            "--format", metavar="FORMAT", help="The format of a --model SHAPE.", show_default="nvfp4"
        ),
    ] = None,
    synthetic: Annotated[
        bool,
        typer.Option(
            "--synthetic",
            help="Synthetic prompts and random rewards, as bench e2e (for random weights, where grading "
            "measures nothing).",
        ),
    ] = False,
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
    conf = cfg.load_config(cfg.TrainConfig, recipe, set_)
    from qerl_cli.bench.scaling import model_folder, scaled_config

    if model:
        conf.model.path = str(model_folder(model, model_format, write=not dry_run, synthetic=synthetic))
    elif model_format is not None:
        raise QerlError("--format names the format of a --model SHAPE; give --model too")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    conf = scaled_config(conf, Path(output), steps, prompts_per_gpu, world, synthetic=synthetic)
    check_output(output)
    if conf.rollout.engine == "vllm":  # the recipe's engine: a GPU and vLLM, checked before the model loads
        resolve_engine("vllm")
    if finish_config(conf, dry_run):
        return
    from qerl_cli.bench.scaling import REPORT_NAME, run_scaling, scaling_table
    from qerl_cli.torch_utils import runs_on_cpu

    if runs_on_cpu(conf.train.device):
        use_free_cpu_threads()
    report = run_scaling(
        conf,
        output,
        command=command_line(),
        steps=steps,
        prompts_per_gpu=prompts_per_gpu,
        reference=reference,
        synthetic=synthetic,
    )
    if int(os.environ.get("RANK", "0")) == 0:
        console.print(scaling_table(report))
        _done(Path(output) / REPORT_NAME, False)


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
            show_default=f"{DEFAULT_QUALITY_ROWS} (the awq row only with llm-compressor installed)",
        ),
    ] = None,
    calib_samples: Annotated[
        int, typer.Option("--calib-samples", metavar="N", help="Calibration rows of qerl-text (awq, gptq).")
    ] = 48,
    seq_len: Annotated[int, typer.Option("--seq-len", metavar="TOKENS", help="Tokens per row.")] = 256,
    heldout_rows: Annotated[
        int, typer.Option("--heldout-rows", metavar="N", help="Held-out rows the bases are measured on.")
    ] = 64,
    device: DeviceOption = "auto",
    output: OutputOption = "bench_results",
    dry_run: DryRunOption = False,
) -> None:
    """Quantize one BF16 model per --rows format and method, then measure what each base keeps.

    Perplexity, KL to BF16 and top-1 agreement on held-out text, by the library of `qerl quality`
    (which measures bases you already have), beside each base's weight error.
    """
    chosen = [r.lower() for r in csv(rows if rows is not None else DEFAULT_QUALITY_ROWS) or []]
    if not chosen:
        raise QerlError("--rows needs at least one FORMAT-METHOD (e.g. nvfp4-rtn)")
    from qerl_cli.bench.quality import parse_row  # no torch: the rows are checked before any import of it

    calibrated = [row for row in chosen if parse_row(row)[1] != "rtn"]  # AWQ, GPTQ: llm-compressor's
    if calibrated and not package_available("llmcompressor"):
        if rows is not None:  # asked for by name: it must run
            check_requirements([Requirement("llmcompressor", "quantize", f"--rows {','.join(calibrated)}")])
        chosen = [row for row in chosen if row not in calibrated]  # the default measures what is installed
    for flag, value in (("--calib-samples", calib_samples), ("--heldout-rows", heldout_rows)):
        positive(flag, value)
    if seq_len < 2:
        raise QerlError(f"--seq-len must be >= 2, got {seq_len}")
    settings = dict(
        model=model,
        rows=chosen,
        calib_samples=calib_samples,
        seq_len=seq_len,
        heldout_rows=heldout_rows,
        device=device,
    )
    check_tool(output, device, None)
    if dry_run_settings({**settings, "output": output}, dry_run):
        return
    from qerl_cli.bench.quality import REPORT_NAME, QualitySettings, run_quality

    use_free_cpu_threads()
    report = run_quality(QualitySettings(**settings), output, command=command_line())
    console.print((Path(output) / "quality.md").read_text(), markup=False, highlight=False)
    made = [r for r in report["rows"] if "skipped" not in r]
    _done(Path(output) / REPORT_NAME, not made)  # a table of skipped rows only is a failed run
