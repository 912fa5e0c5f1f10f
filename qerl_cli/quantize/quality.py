"""How much of the BF16 model a 4-bit base keeps: ``qerl quality BF16 BASE [BASE+ADAPTER ...]``.

For each candidate (a 4-bit or BF16 folder, optionally with a LoRA adapter on it, e.g. the
error-compensating start ``BASE/lora_init``), on held-out text that no base was calibrated on:

* perplexity;
* KL(BF16 || candidate) per token, in nats: how far the next-token distribution moved;
* top-1 agreement: the share of positions where both models' most likely next token is the same.

The text is qerl-text's held-out rows (``--calib qerl-text`` calibrates on other rows of the same
set: prose and worked word problems). Greedy accuracy and the reward spread a base gives GRPO are
task figures: ``qerl compare`` measures them per arm (base pass@1, no-spread groups at the start).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from rich.table import Table

from qerl_cli.data import calib_text
from qerl_cli.errors import QerlError
from qerl_cli.modeling.adapter import attach_to_base
from qerl_cli.modeling.loading import load_policy_model, load_tokenizer
from qerl_cli.quantize.calibration import load_calibration
from qerl_cli.torch_utils import device_label, resolve_device


@dataclass(frozen=True)
class Candidate:
    label: str
    path: str
    adapter: str | None = None


@dataclass
class QualityRow:
    label: str
    path: str
    adapter: str | None
    perplexity: float
    kl_to_reference: float  # nats per token, KL(reference || candidate)
    top1_agreement: float


@dataclass
class QualityReport:
    reference: str
    reference_perplexity: float
    text: dict[str, Any]  # source, rows, tokens
    device: str
    rows: list[QualityRow] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rows": [asdict(row) for row in self.rows]}


def parse_candidate(text: str) -> Candidate:
    """``PATH`` or ``LABEL=PATH`` or ``LABEL=PATH+ADAPTER`` (an adapter folder on that base)."""
    label, _, rest = text.rpartition("=") if "=" in text else ("", "", text)
    path, _, adapter = rest.partition("+")
    if not path:
        raise QerlError(
            f"candidate {text!r} has no model folder: give PATH, LABEL=PATH or LABEL=PATH+ADAPTER"
        )
    return Candidate(label or default_label(path), path, adapter or None)


def default_label(path: str) -> str:
    """A candidate's label where none is given: its folder's own name."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def heldout_text(tokenizer: Any, rows: int, seq_len: int) -> list[list[int]]:
    """qerl-text's held-out rows (disjoint from any ``--calib qerl-text`` calibration)."""

    calib = load_calibration(
        calib_text.BUILTIN_NAME, tokenizer, num_samples=calib_text.SMALL_CALIB_SAMPLES, seq_len=seq_len,
        seed=42, field_name="text", held_out=rows,
    )  # fmt: skip
    return [ids for ids in calib.held_out if len(ids) >= 2]


def _load(path: str, adapter: str | None, device: torch.device) -> torch.nn.Module:
    model, _ = load_policy_model(path, dtype=torch.bfloat16, device=device)
    if adapter:
        model = attach_to_base(model, adapter).to(device)
    return model.eval()


@torch.no_grad()
def _compare(reference: torch.nn.Module, model: torch.nn.Module, texts: list[list[int]], device) -> tuple:
    """(perplexity, mean KL(reference || model), top-1 agreement) over every next-token position."""
    nll = kl = agree = 0.0
    tokens = 0
    for ids in texts:
        batch = torch.tensor([ids], device=device)
        ref = torch.log_softmax(reference(input_ids=batch).logits[0, :-1].float(), -1)
        out = torch.log_softmax(model(input_ids=batch).logits[0, :-1].float(), -1)
        targets = batch[0, 1:]
        nll -= float(out.gather(-1, targets[:, None]).sum())
        kl += float((ref.exp() * (ref - out)).sum())
        agree += float((ref.argmax(-1) == out.argmax(-1)).sum())
        tokens += len(ids) - 1
    return math.exp(nll / tokens), kl / tokens, agree / tokens


def measure_quality(
    reference: str, candidates: list[Candidate], device: str = "auto", rows: int = 64, seq_len: int = 256
) -> QualityReport:
    """Every candidate against ``reference`` (the BF16 model) on the same held-out text."""
    if not candidates:
        raise QerlError("no candidate to measure: pass one or more 4-bit model folders after the BF16 model")
    torch_device = resolve_device(device)
    texts = heldout_text(load_tokenizer(reference), rows, seq_len)
    ref_model = _load(reference, None, torch_device)
    ref_ppl, _, _ = _compare(ref_model, ref_model, texts, torch_device)
    report = QualityReport(
        reference=reference, reference_perplexity=ref_ppl, device=device_label(torch_device),
        text={"source": "qerl-text held-out rows", "rows": len(texts), "tokens": sum(map(len, texts))},
    )  # fmt: skip
    for candidate in candidates:
        model = _load(candidate.path, candidate.adapter, torch_device)
        ppl, kl, top1 = _compare(ref_model, model, texts, torch_device)
        report.rows.append(QualityRow(candidate.label, candidate.path, candidate.adapter, ppl, kl, top1))
        del model
    return report


def quality_table(report: QualityReport):  # -> rich.table.Table
    table = Table(title=f"kept quality vs {report.reference} ({report.text['tokens']} held-out tokens)")
    for name in ("candidate", "KL to BF16 (nats/token)", "top-1 agree", "perplexity"):
        table.add_column(name, overflow="fold")
    table.add_row("BF16 (reference)", "0", "1", f"{report.reference_perplexity:.2f}")
    for row in report.rows:
        table.add_row(
            row.label, f"{row.kl_to_reference:.4f}", f"{row.top1_agreement:.3f}", f"{row.perplexity:.2f}"
        )
    return table
