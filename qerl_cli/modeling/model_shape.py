"""The dimensions of a transformer that decide its memory: parameters by kind, weight bytes per format,
KV-cache bytes per token. Pure arithmetic on a ``config.json`` dict, shared by the memory plan
(``rl.memory``), the rollout backend choice (``rollout.backends``) and the benchmarks' roofline.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from qerl_cli import formats
from qerl_cli.errors import QerlError

# Bytes per weight of a linear layer, scales included: each 4-bit format's own figure (NVFP4 has one
# FP8 scale per 16 weights, MXFP4 one E8M0 scale per 32, NF4 one double-quantized absmax per 64).
# FP8: the per-channel E4M3 rollout copy of a 4-bit base (one float32 scale per row, negligible).
WEIGHT_BYTES = {
    formats.DENSE: 2.0,
    "fp8": 1.0,
    **{name: fmt.bytes_per_weight for name, fmt in formats.FORMATS.items()},
}
KV_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that decide memory (from a transformers ``config.json`` dict)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int
    tie_embeddings: bool = False

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            return cls(
                hidden=hidden,
                intermediate=int(config["intermediate_size"]),
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                vocab=int(config["vocab_size"]),
                head_dim=int(config.get("head_dim") or hidden // heads),
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            )
        except KeyError as exc:
            raise QerlError(f"the model config has no {exc.args[0]}: cannot size its memory") from None

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each projection of one decoder layer."""
        h, i = self.hidden, self.intermediate
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    def fused_linears(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """The GEMMs of one decoder layer as vLLM runs them, q/k/v and gate/up fused: each one's input
        features and its slices' output features (one slice per projection it fuses)."""
        shapes = self.linear_shapes()
        return {
            "qkv": (shapes["q_proj"][0], tuple(shapes[p][1] for p in ("q_proj", "k_proj", "v_proj"))),
            "o": (shapes["o_proj"][0], (shapes["o_proj"][1],)),
            "gate_up": (shapes["gate_proj"][0], (shapes["gate_proj"][1], shapes["up_proj"][1])),
            "down": (shapes["down_proj"][0], (shapes["down_proj"][1],)),
        }

    def lora_params(self, rank: int, targets: Iterable[str] | None = None) -> int:
        """Parameters of a rank-``rank`` LoRA (A and B) on the ``targets`` projections of every layer
        (None: all seven)."""
        chosen = set(self.linear_shapes() if targets is None else targets)
        linears = self.linear_shapes().items()
        return self.layers * sum(rank * (a + b) for name, (a, b) in linears if name in chosen)

    def decoder_linear_params(self) -> int:
        return self.layers * sum(a * b for a, b in self.linear_shapes().values())

    def dense_params(self) -> int:
        """Parameters kept in BF16 in every format: embeddings, LM head, norms, q/k/v biases."""
        embed = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        per_layer = 2 * self.hidden + self.heads * self.head_dim + 2 * self.kv_heads * self.head_dim
        return embed + self.layers * per_layer + self.hidden

    def parameters(self) -> int:
        """The model's parameter count (decoder linears plus the dense ones; biases of o/MLP ignored),
        whatever format it is stored in: what tells models of one size from another."""
        return self.decoder_linear_params() + self.dense_params()

    def kv_bytes_per_token(self, kv_dtype: str = "auto") -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * KV_DTYPE_BYTES.get(kv_dtype, 2)


def weight_bytes(shape: ModelShape, fmt: str) -> int:
    """Bytes of the base model's weights in ``fmt`` (bf16, nvfp4, mxfp4, nf4)."""
    if fmt not in WEIGHT_BYTES:
        raise QerlError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_BYTES)}")
    return int(shape.decoder_linear_params() * WEIGHT_BYTES[fmt] + shape.dense_params() * 2)
