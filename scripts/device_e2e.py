"""End-to-end device checks: the memory plan, 32B on an 80 GB cap, GRPO at real lengths, bench wall time.

First written for issue 11 as ``scripts/device_issue11.py``; the figures in benchmarks/h200-2026-11-23 came
from it under that name.

Run through ``scripts/device_e2e.sh PART`` (it installs nothing; vLLM must be installed as
/work/shared/tools/device-vllm/README.md says, and it starts and stops the ballast). Subcommands:

* ``ballast --cap-gib 79.2 --ready FILE``: hold GPU memory so that only ``cap`` GiB stay free (an
  H100 80GB's usable memory on an H200), write FILE, and sleep until killed. A separate process:
  the trainer and vLLM then see the cap through ``mem_get_info`` exactly as on the smaller GPU,
  while their own ``torch.cuda`` peaks do not include the ballast.
* ``e2e``: random-weight checkpoint (built on the GPU, timed), then GRPO steps through the real
  trainer with colocated vLLM (``qerl_cli.bench.e2e.measure_format``), in this process.
* ``batch``: ``qerl bench --batch 2,8`` with its defaults, wall clock timed.

Every result is one JSON file (``--out``) with the GPU name, the date, the command, the device's
free/total memory before and after, and the figures; a failure writes the error and exits 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

GIB = 2**30
TRITON = {"attention_backend": "TRITON_ATTN"}  # the stripped vLLM bundle has no flash-attention


def device_info() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"gpu": None}
    free, total = torch.cuda.mem_get_info()
    return {"gpu": torch.cuda.get_device_name(0), "mem_get_info_free_gib": free / GIB,
            "mem_get_info_total_gib": total / GIB}  # fmt: skip


def header(argv: list[str]) -> dict[str, Any]:
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join(["python", "scripts/device_e2e.py", *argv]),
            "torch": torch.__version__, "before": device_info()}  # fmt: skip


def write(out: str, payload: dict[str, Any]) -> None:
    payload["after"] = device_info()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(payload, indent=2, default=str))
    print(json.dumps({k: payload.get(k) for k in ("ok", "error", "wall_s")}, default=str), flush=True)


def ballast(args: argparse.Namespace) -> int:
    free, total = torch.cuda.mem_get_info()
    hold = max(0, free - int(args.cap_gib * GIB))
    block = torch.empty(hold, dtype=torch.uint8, device="cuda") if hold else None
    free_now, _ = torch.cuda.mem_get_info()
    Path(args.ready).write_text(json.dumps({"held_gib": hold / GIB, "free_gib": free_now / GIB,
                                            "total_gib": total / GIB}))  # fmt: skip
    print(f"ballast holds {hold / GIB:.1f} GiB; {free_now / GIB:.1f} GiB free", flush=True)
    while True:  # killed by the wrapper
        time.sleep(3600)
    del block


def e2e(args: argparse.Namespace, argv: list[str]) -> int:
    from qerl_cli.bench.e2e import measure_format
    from qerl_cli.bench.models import prepare_checkpoints
    from qerl_cli.config import BenchConfig

    payload = header(argv)
    payload.update(part=args.name, model=args.model, format=args.format)
    if args.auto_memory:  # the recipe with every memory setting on auto (rl.memory decides)
        import yaml

        recipe = yaml.safe_load(Path(args.recipe).read_text())
        recipe["train"].update(micro_batch_size="auto", gradient_checkpointing="auto")
        recipe["rollout"]["gpu_memory_utilization"] = "auto"
        recipe["train"]["fused_kernels"] = args.fused
        args.recipe = f"/tmp/qerl-device-e2e/{args.name}-recipe.yaml"
        Path(args.recipe).parent.mkdir(parents=True, exist_ok=True)
        Path(args.recipe).write_text(yaml.safe_dump(recipe))
        payload["recipe"] = recipe
    started = time.perf_counter()
    try:
        t0 = time.perf_counter()
        (folder,) = prepare_checkpoints(args.model, [args.format], seed=0).values()
        payload["checkpoint_s"] = time.perf_counter() - t0  # ~0 when cached on this machine
        payload["checkpoint_dir"] = str(folder)
        cfg = BenchConfig(
            model=args.model, formats=[args.format], batch=[args.prompts], prompt_len=args.prompt_len,
            gen_len=args.gen_len, lora_rank=16, engine="vllm", e2e=True, warmup=0, repeats=args.steps,
            vllm_kwargs=dict(TRITON), e2e_generations=args.generations, e2e_prompts_per_step=args.prompts,
            e2e_gpu_memory_utilization=args.share if args.share != "recipe" else None,
            e2e_recipe=args.recipe, e2e_linear_backend=args.backend,
        )  # fmt: skip
        run_dir = f"/tmp/qerl-device-e2e/{args.name}"
        payload["row"] = measure_format(cfg, args.format, str(folder), "vllm", run_dir)
        payload["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - recorded, then a non-zero exit
        payload.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        payload["traceback"] = traceback.format_exc()[-4000:]
    payload["wall_s"] = time.perf_counter() - started
    write(args.out, payload)
    return 0 if payload["ok"] else 1


def batch(args: argparse.Namespace, argv: list[str]) -> int:
    payload = header(argv)
    cli = "import sys; from qerl_cli.cli import main; sys.exit(main(sys.argv[1:]))"
    command = [sys.executable, "-c", cli, "bench", "--batch", "2,8", "-o", "/tmp/qerl-device-e2e/bench",
               "--set", "vllm_kwargs={attention_backend: TRITON_ATTN}"]  # fmt: skip
    payload["bench_command"] = "qerl " + " ".join(command[3:])
    started = time.perf_counter()
    proc = subprocess.run(command, check=False, env=dict(os.environ))
    payload.update(wall_s=time.perf_counter() - started, rc=proc.returncode, ok=proc.returncode == 0)
    report = Path("/tmp/qerl-device-e2e/bench/bench.json")
    if report.is_file():
        payload["bench"] = json.loads(report.read_text())
    write(args.out, payload)
    return proc.returncode


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="device_e2e")
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("ballast")
    b.add_argument("--cap-gib", type=float, default=79.2)
    b.add_argument("--ready", required=True)
    e = sub.add_parser("e2e")
    e.add_argument("--name", required=True)
    e.add_argument("--model", default="qwen2.5-7b")
    e.add_argument("--format", default="nvfp4")
    e.add_argument("--prompt-len", type=int, default=256)
    e.add_argument("--gen-len", type=int, default=2048)
    e.add_argument("--prompts", type=int, default=16)
    e.add_argument("--generations", type=int, default=8)
    e.add_argument("--steps", type=int, default=3)
    e.add_argument("--recipe", default=None)
    e.add_argument("--auto-memory", action="store_true", help="--recipe with its memory settings on auto")
    e.add_argument("--share", default="auto", help="vLLM's gpu_memory_utilization, auto, or recipe")
    e.add_argument("--backend", default=None, help="rollout.linear_backend (default: the recipe's)")
    e.add_argument("--fused", default="auto", help="train.fused_kernels with --auto-memory")
    e.add_argument("--out", required=True)
    c = sub.add_parser("batch")
    c.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.cmd == "ballast":
        return ballast(args)
    if args.cmd == "e2e":
        if args.share not in ("auto", "recipe"):
            args.share = float(args.share)
        return e2e(args, argv)
    return batch(args, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
