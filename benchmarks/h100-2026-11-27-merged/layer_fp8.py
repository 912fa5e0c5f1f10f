"""One frozen layer's forward + input gradient in BF16 and in FP8 (``train.base_compute: fp8``), on one GPU.

Run from the repository root. The figures of README.md section 3 came from an untidied form of this
script (the same shapes, timing and calls) on one H100 80GB HBM3; this form has not been run since:

    PYTHONPATH=$PWD python3 benchmarks/h100-2026-11-27-merged/layer_fp8.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from qerl_cli.modeling.fp8_update import Fp8LinearFunction, Fp8Weight, fp8_mm, quantize_rows

TOKENS = 4608  # a micro-batch of two 2304-token sequences
SHAPES = ((18944, 3584), (3584, 18944), (3584, 3584), (512, 3584))  # a 7B's gate/up, down, q/o, k/v


def milliseconds(fn: Callable[[], object], iterations: int = 20) -> float:
    for _ in range(3):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iterations):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iterations


def measure(n: int, k: int) -> str:
    """One ``[n, k]`` layer: forward + input gradient in each precision, the rounding, one GEMM each."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(TOKENS, n, device="cuda", dtype=torch.bfloat16)
    copies = Fp8Weight.derive(w.float())
    rounded = quantize_rows(x.detach())

    def bf16() -> None:
        F.linear(x, w).backward(grad)

    def fp8() -> None:
        Fp8LinearFunction.apply(x, None, copies).backward(grad)

    t_bf16, t_fp8 = milliseconds(bf16), milliseconds(fp8)
    t_round = milliseconds(lambda: quantize_rows(x.detach()))
    t_gemm16 = milliseconds(lambda: x.detach() @ w.t())
    t_gemm8 = milliseconds(lambda: fp8_mm(*rounded, copies.rows, copies.row_scale, torch.bfloat16))
    tflops = 2 * TOKENS * n * k / 1e9
    return (
        f"{n}x{k}: forward + input gradient BF16 {t_bf16:.3f} ms, FP8 {t_fp8:.3f} ms "
        f"({t_bf16 / t_fp8:.2f}x); "
        f"rounding x {t_round:.3f} ms; one GEMM BF16 {t_gemm16:.3f} ms ({tflops / t_gemm16:.0f} TFLOP/s), "
        f"FP8 {t_gemm8:.3f} ms ({tflops / t_gemm8:.0f} TFLOP/s)"
    )


def main() -> None:
    print(torch.cuda.get_device_name())
    for n, k in SHAPES:
        print(measure(n, k))


if __name__ == "__main__":
    main()
