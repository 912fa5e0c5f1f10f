"""Token logprobs from hidden states without materialising [batch, length, vocab] logits.

At RL lengths the logits dominate the update's memory: 8 sequences x 2304 tokens x 152k vocab in
float32 are 11 GiB, plus as much again for their softmax and gradient. :class:`LinearLogprob` runs
the LM head on ``chunk`` tokens at a time, keeps only each token's logprob, and in backward
recomputes each chunk's logits to form the gradient, so at most one chunk's logits live at once.

Only the tokens that are scored (the completion mask) go through the LM head, so right padding
of short completions costs nothing there either.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class LinearLogprob(torch.autograd.Function):
    """``log_softmax(hidden @ weight.T / temperature)[i, targets[i]]`` for each row, chunked.

    The matmul runs in the compute dtype (like the LM head in the model), the softmax in float32
    on the chunk; the result is float32. The backward gives the same gradients as autograd on the
    unchunked expression.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
    ) -> torch.Tensor:
        acc = _softmax_dtype(weight)
        out = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        for begin in range(0, hidden.shape[0], chunk):
            end = begin + chunk
            logits = F.linear(hidden[begin:end], weight).to(acc) / temperature
            out[begin:end] = torch.log_softmax(logits, dim=-1).gather(1, targets[begin:end, None]).squeeze(1)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, targets = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        acc = _softmax_dtype(weight)
        grad_weight = torch.zeros_like(weight, dtype=acc) if need_weight else None
        for begin in range(0, hidden.shape[0], ctx.chunk):
            end = begin + ctx.chunk
            h = hidden[begin:end]
            logits = F.linear(h, weight).to(acc) / ctx.temperature
            # d logprob / d logits = onehot(target) - softmax; times the incoming gradient, / T.
            grad = torch.softmax(logits, dim=-1).mul_(-grad_out[begin:end, None])
            del logits
            grad.scatter_add_(1, targets[begin:end, None], grad_out[begin:end, None].to(acc))
            grad = grad.div_(ctx.temperature).to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[begin:end] = grad @ weight
            if grad_weight is not None:
                grad_weight += (grad.t() @ h).to(acc)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def _softmax_dtype(weight: torch.Tensor) -> torch.dtype:
    """float32 for BF16/FP16/FP32 weights (as the model's ``logits.float()``), float64 for float64."""
    return torch.promote_types(weight.dtype, torch.float32)


# Config keys of models whose ``ForCausalLM.forward`` transforms the logits after the LM head
# (Gemma's soft-capping, Cohere's and Granite's scaling): the chunked path, which applies the head
# itself, would skip that transform.
LOGIT_TRANSFORM_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def head_and_decoder(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """(decoder stack, LM head) of a (PEFT-wrapped) causal LM when the chunked path applies: a plain
    bias-free ``nn.Linear`` head and no logit transform after it (else full logits are used)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    decoder = getattr(base, "model", None)
    if type(head) is not nn.Linear or head.bias is not None or not isinstance(decoder, nn.Module):
        return None
    config = getattr(base, "config", None)
    if any(getattr(config, key, None) not in (None, 1, 1.0) for key in LOGIT_TRANSFORM_KEYS):
        return None
    return decoder, head


def chunked_token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    score_mask: torch.Tensor,
    temperature: float,
    chunk: int,
) -> torch.Tensor | None:
    """``[B, C]`` float32 logprobs of the last ``C = score_mask.shape[1]`` tokens of ``input_ids``
    (zero where ``score_mask`` is 0), or None when the model's head does not allow the chunked path.
    """
    parts = head_and_decoder(model)
    if parts is None:
        return None
    decoder, head = parts
    width = score_mask.shape[1]
    hidden = decoder(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state
    # Position t predicts token t + 1: the hidden states from the last prompt column on.
    hidden = hidden[:, -(width + 1) : -1, :]
    targets = input_ids[:, -width:]
    rows, cols = score_mask.nonzero(as_tuple=True)
    scored = LinearLogprob.apply(hidden[rows, cols], head.weight, targets[rows, cols], temperature, chunk)
    out = torch.zeros(score_mask.shape, dtype=torch.float32, device=scored.device)
    return out.index_put((rows, cols), scored)
