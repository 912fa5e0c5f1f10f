"""Per-channel or per-tensor FP8 scales for the merged rollout copy (``rollout.linear_backend: fp8-merged``).

Two measurements, one question: is one scale per tensor faster than one per output row, and at what cost
in the rollout/trainer log-probability gap?

    python probe.py gemm -o gemm.json            # GPU: the 7B decode GEMMs under both schemes
    python probe.py gap MODEL_DIR -o gap.json    # CPU or GPU: the logprob gap each scheme adds

``gemm`` times, for Qwen2.5-7B's four linear shapes and 28 layers, the dynamic FP8 quantization of the
activations plus the FP8 GEMM, replayed from a CUDA graph (as vLLM's decode runs): per-row weight scales
with per-token activation scales (compressed-tensors ``FP8_DYNAMIC``, what qerl writes) against one weight
scale per tensor with one dynamic activation scale (vLLM's online ``quantization="fp8"``). vLLM's own ops
(``scaled_fp8_quant``, ``cutlass_scaled_mm``) when vLLM is importable, else ``torch._scaled_mm``.

``gap`` takes a real BF16 model, rounds every projection to NVFP4 (qerl's round-to-nearest), adds a rank-16
"adapter" (the SVD of that rounding error: an EoRA-like start of realistic size), and compares the
merged model's next-token distribution on held-out text with the same model whose merged weights and
activations are rounded to FP8 under each scheme (q/k/v and gate/up share one scale per tensor, as vLLM's
fused layers do after loading).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Qwen2.5-7B: hidden 3584, MLP 18944, 28 query heads and 4 KV heads of 128; (out, in) of each fused linear.
QWEN7B_LINEARS = {"qkv_proj": (4608, 3584), "o_proj": (3584, 3584), "gate_up_proj": (37888, 3584),
                  "down_proj": (3584, 18944)}  # fmt: skip
QWEN7B_LAYERS = 28
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


# ---------------------------------------------------------------------------------------------- gemm
def _ops():
    try:
        from vllm import _custom_ops as ops

        return ops
    except Exception:  # noqa: BLE001 - any import failure means: use torch's kernels
        return None


def _linear_fn(scheme: str, ops):
    """y = x @ W^T with the activation quantized at run time, for a weight given as (codes^T, scale)."""
    per_token = scheme == "per-channel"
    if ops is not None:

        def run(x, w_t, w_scale):
            q, s = ops.scaled_fp8_quant(x, None, use_per_token_if_dynamic=per_token)
            return ops.cutlass_scaled_mm(q, w_t, s, w_scale, out_dtype=torch.bfloat16)

        return run

    def run_torch(x, w_t, w_scale):
        amax = x.abs().amax(dim=1, keepdim=True) if per_token else x.abs().amax().reshape(1, 1)
        s = (amax.float() / FP8_MAX).clamp(min=1e-12)
        q = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return torch._scaled_mm(q, w_t, scale_a=s, scale_b=w_scale, out_dtype=torch.bfloat16)

    return run_torch


def _weights(scheme: str, device: torch.device):
    """Per layer and linear: (E4M3 codes as [in, out] column-major, the weight scale vLLM passes)."""
    layers = []
    for _ in range(QWEN7B_LAYERS):
        layer = {}
        for name, (n, k) in QWEN7B_LINEARS.items():
            codes = (torch.randn(n, k, device=device) * 64).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            scale = (torch.rand(1, n, device=device) * 1e-3 + 1e-4) if scheme == "per-channel" \
                else torch.tensor([[5e-4]], device=device)  # fmt: skip
            layer[name] = (codes.t(), scale.float())
        layers.append(layer)
    return layers


def time_gemm(scheme: str, rows: int, ops, reps: int = 20) -> float:
    """Seconds for one decode step's linears (all layers), replayed from a CUDA graph."""
    device = torch.device("cuda")
    run = _linear_fn(scheme, ops)
    layers = _weights(scheme, device)
    inputs = {name: torch.randn(rows, k, device=device, dtype=torch.bfloat16) for name, (_, k) in
              QWEN7B_LINEARS.items()}  # fmt: skip

    def step():
        for layer in layers:
            for name, (w_t, w_scale) in layer.items():
                run(inputs[name], w_t, w_scale)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / reps
    graph.reset()
    layers.clear()
    torch.cuda.empty_cache()
    return seconds


def gemm(args: argparse.Namespace) -> dict:
    ops = _ops()
    props = torch.cuda.get_device_properties(0)
    weight_bytes = QWEN7B_LAYERS * sum(n * k for n, k in QWEN7B_LINEARS.values())  # one byte per weight
    rows = []
    for m in args.rows:
        entry: dict = {"rows": m}
        for scheme in ("per-channel", "per-tensor"):
            seconds = time_gemm(scheme, m, ops)
            entry[scheme] = {"seconds": seconds, "weight_read_tb_per_s": weight_bytes / seconds / 1e12,
                             "tflops": 2 * m * weight_bytes / seconds / 1e12}  # fmt: skip
        entry["per_tensor_speedup"] = entry["per-channel"]["seconds"] / entry["per-tensor"]["seconds"]
        rows.append(entry)
        print(json.dumps(entry), flush=True)
    return {
        "gpu": props.name,
        "kernels": "vllm._custom_ops" if ops is not None else "torch._scaled_mm",
        "shape": "Qwen2.5-7B linears x 28 layers",
        "weight_bytes": weight_bytes,
        "rows": rows,
    }


# ----------------------------------------------------------------------------------------------- gap
def _round_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def _scale(x: torch.Tensor, per_row: bool) -> torch.Tensor:
    amax = x.abs().amax(dim=-1, keepdim=True) if per_row else x.abs().amax()
    return (amax.float() / FP8_MAX).clamp(min=1e-12)


class FakeFP8Linear(torch.nn.Module):
    """The merged weight already rounded; the activation rounded per token or per tensor at run time."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, per_token: bool) -> None:
        super().__init__()
        self.weight, self.bias, self.per_token = torch.nn.Parameter(weight, False), bias, per_token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        q = _round_fp8(flat, _scale(flat, self.per_token))
        y = (q @ self.weight.float().t()).to(x.dtype).reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


@torch.no_grad()
def merged_weights(model, rank: int) -> dict[str, torch.Tensor]:
    """Per projection: NVFP4-rounded weight + the rank-``rank`` SVD of its rounding error."""
    from qerl_cli import formats

    nvfp4 = formats.get("nvfp4")
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in (*FUSED, "o_proj", "down_proj"):
            w = mod.weight.float()
            deq = nvfp4.dequantize(nvfp4.quantize(w), torch.float32)
            u, s, vh = torch.linalg.svd(w - deq, full_matrices=False)
            out[name] = deq + (u[:, :rank] * s[:rank]) @ vh[:rank]
    return out


@torch.no_grad()
def scheme_modules(model, merged: dict[str, torch.Tensor], scheme: str) -> dict[str, torch.nn.Module]:
    """Per projection, the module that runs its merged weight under ``scheme`` (exact: no FP8 rounding)."""
    groups: dict[str, list[str]] = {}
    for name in merged:
        parent, leaf = name.rsplit(".", 1)
        groups.setdefault(f"{parent}.{FUSED.get(leaf, leaf)}", []).append(name)
    modules: dict[str, torch.nn.Module] = {}
    for names in groups.values():
        shared = _scale(torch.cat([merged[n] for n in names]), per_row=False)  # one scale per fused tensor
        for name in names:
            w, old = merged[name], model.get_submodule(name)
            if scheme == "exact":
                new = torch.nn.Linear(*w.shape[::-1], bias=old.bias is not None, dtype=old.weight.dtype)
                new.weight.copy_(w.to(old.weight.dtype))
                if old.bias is not None:
                    new.bias.copy_(old.bias)
            else:
                per_row = scheme == "per-channel"
                rounded = _round_fp8(w, _scale(w, True) if per_row else shared)
                new = FakeFP8Linear(rounded.to(old.weight.dtype), old.bias, per_token=per_row)
            modules[name] = new.to(old.weight.device)
    return modules


def use_modules(model, modules: dict[str, torch.nn.Module]) -> None:
    for name, module in modules.items():
        parent, leaf = name.rsplit(".", 1)
        setattr(model.get_submodule(parent), leaf, module)


SCHEMES = ("per-channel", "per-tensor")


@torch.no_grad()
def _logprobs(model, modules: dict[str, torch.nn.Module], batch) -> torch.Tensor:
    use_modules(model, modules)
    return torch.log_softmax(model(**batch).logits[:, :-1].float(), dim=-1)


def gap(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    from qerl_cli.data.calib_text import PARAGRAPHS, worked_problems
    from qerl_cli.modeling.loading import load_tokenizer
    from qerl_cli.modeling.sources import resolve_model_source

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = load_tokenizer(str(args.model))
    texts = [*PARAGRAPHS, *worked_problems("test", args.problems)]
    model = AutoModelForCausalLM.from_pretrained(resolve_model_source(args.model), dtype=torch.bfloat16)
    model = model.to(device).eval()
    merged = merged_weights(model, args.rank)
    variants = {scheme: scheme_modules(model, merged, scheme) for scheme in ("exact", *SCHEMES)}
    kl: dict[str, list[torch.Tensor]] = {s: [] for s in SCHEMES}
    token_gap: dict[str, list[torch.Tensor]] = {s: [] for s in SCHEMES}
    flips: dict[str, list[torch.Tensor]] = {s: [] for s in SCHEMES}
    for start in range(0, len(texts), 8):  # a few texts at a time: a 262k vocabulary's logits are large
        batch = tokenizer(texts[start : start + 8], return_tensors="pt", padding=True).to(device)
        mask = batch["attention_mask"][:, 1:].bool()
        chosen = batch["input_ids"][:, 1:, None]

        ref = _logprobs(model, variants["exact"], batch)
        for scheme in SCHEMES:
            lp = _logprobs(model, variants[scheme], batch)
            kl[scheme].append((ref.exp() * (ref - lp)).sum(-1)[mask])
            token_gap[scheme].append((ref.gather(-1, chosen) - lp.gather(-1, chosen))[..., 0][mask].abs())
            flips[scheme].append((ref.argmax(-1) != lp.argmax(-1))[mask].float())
    result: dict = {"model": str(args.model), "device": device, "adapter_rank": args.rank,
                    "tokens": int(torch.cat(flips[SCHEMES[0]]).numel())}  # fmt: skip
    for scheme in SCHEMES:
        gaps = torch.cat(token_gap[scheme])
        result[scheme] = {
            "kl_to_exact_mean": torch.cat(kl[scheme]).mean().item(),
            "abs_logprob_gap_mean": gaps.mean().item(),
            "abs_logprob_gap_p99": gaps.quantile(0.99).item(),
            "argmax_changed": torch.cat(flips[scheme]).mean().item(),
        }
        print(scheme, json.dumps(result[scheme]), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    g = sub.add_parser("gemm")
    g.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32, 128, 256, 2048])
    p = sub.add_parser("gap")
    p.add_argument("model", help="a BF16 model folder or a qerl model alias (gemma3-270m)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--problems", type=int, default=48)
    for s in (g, p):
        s.add_argument("-o", "--out", type=Path, required=True)
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    result = gemm(args) if args.mode == "gemm" else gap(args)
    result.update(command=" ".join(["python", *sys.argv]), date=started, torch=torch.__version__,
                  host_python=platform.python_version())  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
