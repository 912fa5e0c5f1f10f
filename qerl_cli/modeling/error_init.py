"""An error-compensating LoRA start: a rank-r factorisation of a 4-bit weight's rounding error.

A 4-bit base computes ``deq(Q(W)) x`` where the BF16 model computed ``W x``; the difference is
``E x`` with ``E = W - deq(Q(W))``. A LoRA adapter adds ``scaling * B A x``, so starting it at a
rank-r approximation of ``E`` starts training from (nearly) the BF16 model instead of the damaged
4-bit one. Which rank-r matrix is best depends on the inputs: the error that matters is
``||(E - D) X||_F`` over the activations ``X`` the layer actually sees, not ``||E - D||_F``.

EoRA (arXiv 2410.21271) minimises the former. With ``C = E[x x^T]`` (the calibration activations'
second moment), ``||(E - D) X||_F^2 = n * ||(E - D) S||_F^2`` for any ``S`` with ``S S^T = C``; taking
``C = Q diag(l) Q^T`` and ``S = Q diag(sqrt(l))`` the best ``D S`` is the truncated SVD of ``E S``
(Eckart-Young), so ``D = U_r Sig_r V_r^T S^-1``. The plain SVD of ``E`` (``second_moment=None``,
``lora.init: svd``) treats every input direction alike, so at the same rank it recovers far less of the
model than EoRA does (EoRA's KL to the BF16 model: ``docs/quantize.md``).

The folder that holds one base's factors (``<quantized model>/lora_init/``, a PEFT adapter folder
written through :mod:`qerl_cli.modeling.adapter`, plus :data:`INFO_NAME`) is named here, so that
``qerl quantize`` (writer) and ``qerl train`` (reader) agree on it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from qerl_cli.errors import QerlError

INIT_DIR = "lora_init"  # beside the 4-bit checkpoint
INFO_NAME = "error_init.json"  # how the factors were made (LoraInitInfo), inside INIT_DIR
INIT_METHODS = ("eora", "svd")
# Tikhonov damping of C: a fraction of its mean eigenvalue (= mean diagonal, the same rule as GPTQ's
# 1 % ``dampening_frac``) added to every eigenvalue. Without it, input directions the calibration set
# never excited (eigenvalue ~0) get S^-1 entries of ~1e4 and A blows up along directions that training
# data will excite; with it they are treated like weakly-seen directions instead.
DAMP = 0.01
# The eigendecomposition runs in float64 up to this input width (18944x18944 float64 eigh costs
# minutes on a CPU and 2.9 GB); wider inputs run in float32, whose relative eigenvalue error (~1e-6 of
# the largest) stays far below the damping.
EIGH_FLOAT64_MAX = 8192


@dataclass
class Whitening:
    """``S`` with ``S S^T = C + damping`` (``[in, in]``) and its inverse, float32, for one input."""

    scale: torch.Tensor
    inverse: torch.Tensor


def whitening(second_moment: torch.Tensor, damp: float = DAMP) -> Whitening:
    """``S = Q diag(sqrt(l))`` and ``S^-1 = diag(1 / sqrt(l)) Q^T`` for ``C = Q diag(l) Q^T``, with
    ``damp * mean(l)`` added to every eigenvalue (negative round-off eigenvalues are clipped to 0 first).
    A matrix of zeros (an input never seen) gives the identity: the plain SVD for that layer."""
    width = second_moment.shape[0]
    dtype = torch.float64 if width <= EIGH_FLOAT64_MAX else torch.float32
    sym = second_moment.to(dtype)
    sym = (sym + sym.T) / 2  # accumulated in float32: exact symmetry for eigh
    eigenvalues, vectors = torch.linalg.eigh(sym)
    eigenvalues = eigenvalues.clamp(min=0)
    mean = float(eigenvalues.mean())
    if mean <= 0:
        eye = torch.eye(width, dtype=torch.float32, device=second_moment.device)
        return Whitening(eye, eye.clone())
    root = (eigenvalues + damp * mean).sqrt()
    scale = (vectors * root).to(torch.float32)  # Q diag(sqrt l): scales Q's columns
    inverse = (vectors / root).T.contiguous().to(torch.float32)  # diag(1/sqrt l) Q^T
    return Whitening(scale, inverse)


def factorise(
    error: torch.Tensor, rank: int, scaling: float, whiten: Whitening | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """LoRA factors ``(A [rank, in], B [out, rank])`` with ``scaling * B @ A`` the best rank-``rank``
    approximation of ``error`` (``[out, in]``) in the activation-weighted norm (``whiten``: EoRA) or in
    the plain Frobenius norm (``None``: SVD). Components come largest first, so truncating to the first
    k rows of A / columns of B keeps the best rank-k correction. The singular values are split evenly
    (``Sig^1/2`` on each side) and both factors divided by ``sqrt(scaling)``, PEFT's ``alpha / r``.
    A rank above ``min(out, in)`` is padded with zero components."""
    if rank <= 0 or scaling <= 0:
        raise ValueError(f"rank and scaling must be positive, got {rank}, {scaling}")
    err = error.to(torch.float32)
    target = err @ whiten.scale if whiten is not None else err
    u, sig, vh = torch.linalg.svd(target, full_matrices=False)
    keep = min(rank, sig.numel())
    root = sig[:keep].sqrt()
    a = root[:, None] * vh[:keep]
    if whiten is not None:
        a = a @ whiten.inverse
    b = u[:, :keep] * root
    norm = scaling**0.5
    out_a = torch.zeros(rank, err.shape[1], dtype=torch.float32, device=err.device)
    out_b = torch.zeros(err.shape[0], rank, dtype=torch.float32, device=err.device)
    out_a[:keep] = a / norm
    out_b[:, :keep] = b / norm
    return out_a, out_b


def weighted_sq_norm(matrix: torch.Tensor, second_moment: torch.Tensor) -> float:
    """``tr(M C M^T)`` = ``||M X||_F^2 / n``: the mean squared output a weight (or an error) puts on
    the calibration activations."""
    m = matrix.to(torch.float32)
    return float(((m @ second_moment.to(torch.float32)) * m).sum())


def lora_key(module: str, which: str) -> str:
    """The PEFT state-dict key of a LoRA factor (``which``: "A" or "B") of the linear ``module``
    (its name in the bare model), as PEFT saves a causal LM's adapter."""
    return f"base_model.model.{module}.lora_{which}.weight"


# --------------------------------------------------------------------------------------------
# The record beside the factors
# --------------------------------------------------------------------------------------------
@dataclass
class LoraInitInfo:
    """How ``lora_init/`` was made and what it achieves (``error_init.json``, and ``lora_init`` in
    ``qerl_quant.json``). The relative errors are ``sqrt(sum tr(R C R^T) / sum tr(W C W^T))`` over all
    corrected layers (undamped C): the base alone (``R = E``) and base + init (``R = E - scaling B A``)."""

    method: str  # "eora" | "svd"
    rank: int
    alpha: int
    target_modules: list[str]  # leaf names (q_proj, ...) of the corrected linears
    layers: int
    damp: float
    calibration: dict[str, Any] | None
    relative_error_base: float
    relative_error_corrected: float
    seconds: float
    weights_bytes: int  # the adapter's weights file (float32 factors)
    quantized_linear_bytes: int  # the packed 4-bit linears it corrects (weights + scales)
    passes: int  # forward passes over the calibration set (memory budget of the second moments)
    per_layer: dict[str, list[float]] = field(default_factory=dict)  # name -> [base, corrected]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoraInitInfo:
        return cls(**{**data, "per_layer": {k: list(v) for k, v in (data.get("per_layer") or {}).items()}})


def init_folder(model_path: str | Path) -> Path:
    return Path(model_path).expanduser() / INIT_DIR


def read_info(folder: str | Path) -> LoraInitInfo:
    path = Path(folder) / INFO_NAME
    if not path.is_file():
        raise QerlError(f"{folder} has no {INFO_NAME}: it was not written by `qerl quantize --lora-init`")
    try:
        return LoraInitInfo.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise QerlError(f"{path} is not a valid LoRA init record ({exc}); write it again") from None


def find_lora_init(
    method: str, rank: int, model_path: str, model_dir: str | Path, base_format: str
) -> tuple[Path, LoraInitInfo]:
    """``model_dir/lora_init/`` and its record, for ``lora.init`` ``method`` (eora / svd) on the recipe's
    ``model_path``: a QerlError naming the folder and the `qerl quantize --lora-init` command that writes
    it where it is missing or holds another method's start. Asked by `qerl train`'s checks before the
    model loads and again when the adapter is made (``rl.policy.load_lora_init``)."""
    if base_format == "bf16":
        # The init is the 4-bit rounding's error, so a BF16 model has none: it is what gets quantized.
        raise QerlError(
            f"lora.init={method} needs a 4-bit base written by `qerl quantize --lora-init {method}`; "
            f"{model_path} is a BF16 model: `qerl quantize {model_path} --format nvfp4 --lora-init {method} "
            f"--lora-init-rank {rank} -o NEWDIR`, then --set model.path=NEWDIR (or set lora.init=zeros)"
        )
    folder = init_folder(model_dir)
    fmt = base_format
    command = (
        f"qerl quantize BF16_MODEL --format {fmt} --method {'rtn' if fmt == 'nf4' else 'gptq'} "
        f"--lora-init {method} --lora-init-rank {rank} --output {model_path} --overwrite"
    )
    if not folder.is_dir():
        raise QerlError(
            f"lora.init={method} starts the adapter from {folder}, which does not exist. Write it with "
            f"`{command}` (BF16_MODEL: the model {model_path} was quantized from), or set lora.init=zeros"
        )
    info = read_info(folder)
    if info.method != method:
        raise QerlError(
            f"{folder} holds a {info.method} LoRA init, not {method}: set lora.init={info.method}, or "
            f"write a {method} one with `{command}`"
        )
    return folder, info
