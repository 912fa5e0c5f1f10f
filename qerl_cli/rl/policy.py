"""The trainable policy: a frozen base (4-bit packed or BF16) plus LoRA adapters.

- The base comes from ``qerl_cli.modeling.loading.load_policy_model``: a qerl / compressed-tensors /
  bitsandbytes 4-bit checkpoint keeps its packed weights (QuantLinear), a BF16 one is the LoRA
  baseline of the paper.
- LoRA goes on ``cfg.lora.target_modules`` (PEFT; ``qerl_cli.modeling.lora`` teaches PEFT about
  QuantLinear). RMSNorm weights can be trained too (``lora.train_norms``); they are saved with the
  adapter as PEFT ``modules_to_save``.
- The adapter starts at zero (PEFT's B = 0) or, with ``lora.init: eora | svd``, at the correction of
  the 4-bit rounding error that ``qerl quantize --lora-init`` wrote to ``<model.path>/lora_init/``
  (:func:`load_lora_init`; the math in ``qerl_cli.modeling.error_init``).
- The KL reference is the policy at step 0 (:meth:`Policy.reference`): the same model with the
  adapters disabled when they started at zero, else with the initial LoRA matrices swapped in (a CPU
  copy of them is kept). No second copy of the base is ever loaded. The bare base (adapters off,
  :meth:`Policy.bare_base`) is what the vLLM staleness probe compares with vLLM's adapter-free model.

:func:`completion_logprobs` is the one forward the trainer runs: per-token log-probabilities of the
completion tokens at the sampling temperature, exactly comparable to the rollout engine's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qerl_cli.config import TrainConfig
from qerl_cli.errors import QerlError
from qerl_cli.modeling import adapter as adapter_folder
from qerl_cli.modeling import lora as qerl_lora
from qerl_cli.modeling.adapter import save_peft_model
from qerl_cli.modeling.base_compute import apply_base_compute
from qerl_cli.modeling.error_init import find_lora_init
from qerl_cli.modeling.fused_kernels import AppliedKernels, apply_fused_kernels
from qerl_cli.modeling.loading import load_base_model, load_tokenizer
from qerl_cli.modeling.lora import load_factors, snapshot, swapped_in
from qerl_cli.modeling.sources import resolve_model_source
from qerl_cli.rl.logprobs import LinearLogprob, chunked_token_logprobs, head_and_decoder
from qerl_cli.torch_utils import DTYPES, resolve_device

log = logging.getLogger(__name__)


def norm_module_names(model: nn.Module) -> list[str]:
    """Leaf names of the RMSNorm modules (``input_layernorm``, ``post_attention_layernorm``, ``norm``)."""
    return sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")}
    )


def attach_lora(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """Wrap ``model`` in a PEFT LoRA model per ``cfg.lora`` (on QuantLinear or nn.Linear layers)."""

    targets = list(cfg.lora.target_modules)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in present]
    if missing:
        raise QerlError(
            f"lora.target_modules {missing} are not modules of this model; it has e.g. "
            f"{sorted(p for p in present if p.endswith('proj'))[:8]}"
        )
    peft_model = qerl_lora.attach_lora(
        model, r=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout, target_modules=targets
    )
    if cfg.lora.train_norms:
        _make_norms_trainable(peft_model)
    return peft_model


def _make_norms_trainable(peft_model: nn.Module) -> None:
    """Train the RMSNorm weights as PEFT ``modules_to_save``: PEFT then saves them with the adapter
    and ``disable_adapter`` (the KL reference) falls back to the frozen originals."""
    from peft.utils.other import set_additional_trainable_modules

    config = peft_model.peft_config["default"]
    config.modules_to_save = norm_module_names(peft_model)
    set_additional_trainable_modules(peft_model, config, peft_model.base_model.model.config, "default")


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Non-reentrant checkpointing works with a frozen base (no input-grad hook needed)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@dataclass
class Policy:
    model: nn.Module  # a PeftModel
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    base_format: str  # "bf16", "nvfp4", "mxfp4", "nf4"
    fused_kernels: str = "off"  # what train.fused_kernels resolved to ("liger" or "off")
    base_compute: str = "bf16"  # what train.base_compute resolved to ("bf16" or "fp8"; modeling.base_compute)
    # Liger's process-wide RoPE patch, put back by close() (qerl_cli.modeling.fused_kernels)
    kernels: AppliedKernels = field(default_factory=lambda: AppliedKernels(kind="off"))
    # lora.init eora / svd: CPU copies of the LoRA matrices at step 0 (the KL reference); None: zeros
    initial_adapter: dict[str, torch.Tensor] | None = None

    @property
    def is_quantized(self) -> bool:
        return self.base_format != "bf16"

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def named_trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    @contextmanager
    def reference(self) -> Iterator[None]:
        """The KL reference, the policy at step 0: the frozen base (adapters off) for an adapter that
        started at zero, else base + initial adapter (the step-0 LoRA matrices swapped in, trained norms
        off). Training moves away from the corrected start, not from the damaged 4-bit base."""
        if self.initial_adapter is None:
            with self.model.disable_adapter():
                yield
            return

        with swapped_in(self.model, self.initial_adapter), _saved_modules_off(self.model):
            yield

    @contextmanager
    def bare_base(self) -> Iterator[None]:
        """The base alone (adapters off), whatever the adapter started from."""
        with self.model.disable_adapter():
            yield

    def save_adapter(self, out_dir: str | Path) -> Path:
        return save_peft_model(self.model, out_dir)

    def close(self) -> None:
        """Training is over: models of this family built from now on in the process (an evaluation,
        another engine) get transformers' RoPE function back. This model stays usable."""
        self.kernels.restore()


@contextmanager
def _saved_modules_off(model: nn.Module) -> Iterator[None]:
    """Trained norms (PEFT ``modules_to_save``) switched to their frozen originals for the block."""
    from peft.utils.other import ModulesToSaveWrapper

    wrappers = [m for m in model.modules() if isinstance(m, ModulesToSaveWrapper)]
    for wrapper in wrappers:
        wrapper.enable_adapters(False)
    try:
        yield
    finally:
        for wrapper in wrappers:
            wrapper.enable_adapters(True)


def load_lora_init(model: nn.Module, cfg: TrainConfig, base_format: str) -> dict[str, torch.Tensor] | None:
    """Start the adapter from ``<model.path>/lora_init/`` (``lora.init`` eora / svd), rescaled to the
    recipe's alpha and rank (``modeling.lora.load_factors``); returns CPU copies of the step-0 LoRA
    matrices, or None for ``lora.init: zeros``."""

    method = cfg.lora.init
    if method == "zeros":
        return None
    folder, info = find_lora_init(
        cfg.lora.init, cfg.lora.rank, cfg.model.path, resolve_model_source(cfg.model.path), base_format
    )
    adapter_folder.check_folder(folder, "LoRA init")
    config = adapter_folder.read_config(folder, "LoRA init")
    loaded = load_factors(
        model, adapter_folder.read_weights(folder), float(config["lora_alpha"]) / float(config["r"])
    )
    if not loaded.loaded:
        raise QerlError(
            f"the LoRA init in {folder} corrects {info.target_modules}, none of lora.target_modules "
            f"{list(cfg.lora.target_modules)}: the adapter would start from zeros"
        )
    for warning in loaded.warnings(str(folder)):  # once each, naming one example
        log.warning("%s", warning)
    log.info("LoRA start: %s init of rank %d from %s (%d layers)", method, info.rank, folder,
             len(loaded.loaded))  # fmt: skip
    return snapshot(model)


def build_policy(cfg: TrainConfig, device: torch.device | None = None) -> Policy:
    device = device or resolve_device(cfg.train.device)
    dtype = DTYPES[cfg.model.dtype]
    if dtype == torch.float16:
        log.warning("float16 LoRA training can overflow; bfloat16 is the tested compute dtype")
    base, fmt = load_base_model(
        cfg.model.path, cfg.model.format, dtype, device, trust_remote_code=cfg.model.trust_remote_code
    )
    for param in base.parameters():
        param.requires_grad_(False)
    kernels = apply_fused_kernels(base, cfg.train.fused_kernels, on_gpu=device.type == "cuda")
    try:
        if cfg.train.gradient_checkpointing is True:  # "auto": decided by the memory plan (rl.memory)
            enable_gradient_checkpointing(base)
        base.config.use_cache = False  # training forwards; generation asks for the cache explicitly
        model = attach_lora(base, cfg)
        model.to(device)
        base_compute = apply_base_compute(model, cfg.train.base_compute, device)  # after the move
        initial_adapter = load_lora_init(model, cfg, fmt)
        tokenizer = load_tokenizer(
            cfg.model.path, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
        )
        if not any(p.requires_grad for p in model.parameters()):
            raise QerlError("the policy has no trainable parameter; check lora.target_modules")
    except BaseException:
        kernels.restore()
        raise
    return Policy(model=model, tokenizer=tokenizer, device=device, dtype=dtype, base_format=fmt,
                  fused_kernels=kernels.kind, base_compute=base_compute, kernels=kernels,
                  initial_adapter=initial_adapter)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Token batches and logprobs
# --------------------------------------------------------------------------------------------
@dataclass
class TokenBatch:
    """Prompts left-padded then completions right-padded, one row per completion.

    ``input_ids``/``attention_mask`` are ``[B, P + C]``; ``completion_mask`` and
    ``rollout_logprobs`` are ``[B, C]`` over the completion columns.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    prompt_width: int

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def completion_width(self) -> int:
        return self.completion_mask.shape[1]

    def rows(self, index: torch.Tensor | slice) -> TokenBatch:
        return TokenBatch(
            self.input_ids[index],
            self.attention_mask[index],
            self.completion_mask[index],
            self.rollout_logprobs[index],
            self.prompt_width,
        )


def make_token_batch(
    prompts: list[list[int]], completions: list[list[int]], rollout_logprobs: list[list[float]], pad_id: int
) -> TokenBatch:
    if not (len(prompts) == len(completions) == len(rollout_logprobs)):
        raise QerlError("prompts, completions and rollout logprobs must have one row each")
    width_p = max(len(p) for p in prompts)
    width_c = max(1, max(len(c) for c in completions))
    rows = len(prompts)
    input_ids = torch.full((rows, width_p + width_c), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, width_p + width_c), dtype=torch.long)
    completion_mask = torch.zeros((rows, width_c), dtype=torch.float32)
    logprobs = torch.zeros((rows, width_c), dtype=torch.float32)
    for r, (p, c, lp) in enumerate(zip(prompts, completions, rollout_logprobs, strict=True)):
        if len(lp) != len(c):
            raise QerlError(f"row {r}: {len(c)} completion tokens but {len(lp)} rollout logprobs")
        input_ids[r, width_p - len(p) : width_p] = torch.tensor(p)
        attention[r, width_p - len(p) : width_p] = 1
        if c:
            input_ids[r, width_p : width_p + len(c)] = torch.tensor(c)
            attention[r, width_p : width_p + len(c)] = 1
            completion_mask[r, : len(c)] = 1
            logprobs[r, : len(c)] = torch.tensor(lp)
    return TokenBatch(input_ids, attention, completion_mask, logprobs, width_p)


def completion_logprobs(
    model: nn.Module,
    batch: TokenBatch,
    temperature: float,
    device: torch.device,
    chunk_tokens: int = 0,
    *,
    pack: bool = False,
) -> torch.Tensor:
    """``[B, C]`` float32 log p_T(completion token | prefix) for one micro-batch (grad if enabled).

    ``pack``: the rows go through the model as one row without padding (:func:`packed_logprobs`).

    Columns that are padding on every row are cut off before the forward (left padding of the
    prompts, right padding of the completions) so a micro-batch of short rows stays cheap; the
    result is padded back to the batch's width. Position ids follow the attention mask, as in
    ``generate`` with left padding, so rollout and trainer logprobs agree.

    ``chunk_tokens`` > 0 runs the LM head on that many completion tokens at a time and only on
    the scored ones (``rl.logprobs``): no [rows, length, vocab] logits, and zeros where the
    completion mask is 0. 0 computes the whole micro-batch's logits at once.
    """
    with lora_compute(model, device):
        if pack:
            return packed_logprobs(model, batch, temperature, device, chunk_tokens)
        return _padded_logprobs(model, batch, temperature, device, chunk_tokens)


def _padded_logprobs(
    model: nn.Module, batch: TokenBatch, temperature: float, device: torch.device, chunk_tokens: int
) -> torch.Tensor:
    mask = batch.attention_mask
    used_cols = mask.any(dim=0).nonzero().flatten()
    first = int(used_cols[0]) if used_cols.numel() else 0
    first = min(first, batch.prompt_width - 1)
    used_completion = (
        int(batch.completion_mask.any(dim=0).nonzero().max()) + 1 if batch.completion_mask.any() else 1
    )
    last = batch.prompt_width + used_completion
    input_ids = batch.input_ids[:, first:last].to(device)
    attention = mask[:, first:last].to(device)
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
    if chunk_tokens > 0:
        score = batch.completion_mask[:, :used_completion].to(device)
        token_lp = chunked_token_logprobs(
            model, input_ids, attention, positions, score, temperature, chunk_tokens
        )
        if token_lp is not None:
            return torch.nn.functional.pad(token_lp, (0, batch.completion_width - used_completion))
    # Logits only where they predict a completion token: from the last prompt column on.
    keep = used_completion + 1
    outputs = model(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=positions,
        logits_to_keep=keep,
        use_cache=False,
    )
    logits = outputs.logits[:, :-1, :].float() / temperature
    targets = input_ids[:, -used_completion:]
    token_lp = torch.log_softmax(logits, dim=-1).gather(2, targets.unsqueeze(-1)).squeeze(-1)
    if used_completion < batch.completion_width:
        token_lp = torch.nn.functional.pad(token_lp, (0, batch.completion_width - used_completion))
    return token_lp


@contextmanager
def lora_compute(model: nn.Module, device: torch.device) -> Iterator[None]:
    """LoRA's matmuls in the model's compute dtype on a GPU.

    PEFT keeps the adapter in float32 (so AdamW's updates are not lost to BF16 rounding) and by default
    casts every LoRA input to float32: on a GPU that runs the LoRA products as float32 GEMMs without
    tensor cores, plus a cast and a float32 add per projection, a large share of an update's time (the
    profile: docs/train.md). Under autocast the float32 weights are cast per matmul
    (they are small) and the activations stay BF16; gradients still reach the float32 weights.
    """
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    dtype = getattr(getattr(embeddings, "weight", None), "dtype", torch.float32)
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        yield
        return
    from peft.helpers import disable_input_dtype_casting

    with torch.autocast("cuda", dtype=dtype), disable_input_dtype_casting(model):
        yield


def packed_logprobs(
    model: nn.Module, batch: TokenBatch, temperature: float, device: torch.device, chunk_tokens: int = 0
) -> torch.Tensor:
    """:func:`completion_logprobs` with the micro-batch packed into one row: each sequence's real
    tokens (prompt + completion, no padding) one after the other, position ids restarting at 0 for
    each. transformers reads the restarts as packed sequences and keeps attention within each one
    (block-diagonal causal mask; varlen kernels under flash-attention), so every logprob equals the
    padded batch's while no token of padding is computed."""

    prompt_lens = batch.attention_mask[:, : batch.prompt_width].sum(dim=1).tolist()
    completion_lens = batch.completion_mask.sum(dim=1).long().tolist()
    pieces, positions, predict_at = [], [], []
    start = 0
    for r, (p_len, c_len) in enumerate(zip(prompt_lens, completion_lens, strict=True)):
        begin = batch.prompt_width - int(p_len)
        pieces.append(batch.input_ids[r, begin : batch.prompt_width + c_len])
        positions.append(torch.arange(int(p_len) + c_len))
        # The hidden state before each completion token predicts it.
        predict_at.append(start + int(p_len) - 1 + torch.arange(c_len))
        start += int(p_len) + c_len
    input_ids = torch.cat(pieces)[None].to(device)
    position_ids = torch.cat(positions)[None].to(device)
    at = torch.cat(predict_at).to(device)
    targets = input_ids[0, at + 1]
    parts = head_and_decoder(model)
    if parts is not None:
        decoder, head = parts
        hidden = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state[0]
        chunk = chunk_tokens if chunk_tokens > 0 else max(1, at.numel())
        scored = LinearLogprob.apply(hidden[at], head.weight, targets, temperature, chunk)
    else:  # a head with a logit transform (Gemma's soft-capping): the model's own logits
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[0, at]
        scored = torch.log_softmax(logits.float() / temperature, dim=-1).gather(1, targets[:, None])[:, 0]
    out = torch.zeros(batch.completion_mask.shape, dtype=torch.float32, device=scored.device)
    rows = torch.repeat_interleave(torch.arange(len(completion_lens)), torch.tensor(completion_lens))
    cols = torch.cat([torch.arange(c) for c in completion_lens])
    return out.index_put((rows.to(out.device), cols.to(out.device)), scored)


def batched_logprobs(
    model: nn.Module,
    batch: TokenBatch,
    temperature: float,
    device: torch.device,
    micro_batch_size: int,
    *,
    reference: Policy | None = None,
    chunk_tokens: int = 0,
) -> torch.Tensor:
    """No-grad :func:`completion_logprobs` over a whole batch (``reference``: its KL reference)."""
    parts = []
    context = reference.reference() if reference is not None else nullcontext()
    was_training = model.training
    model.eval()  # no dropout in the fixed "old" / reference logprobs
    try:
        with torch.no_grad(), context:
            for begin in range(0, batch.size, micro_batch_size):
                rows = batch.rows(slice(begin, begin + micro_batch_size))
                parts.append(completion_logprobs(model, rows, temperature, device, chunk_tokens).cpu())
    finally:
        model.train(was_training)
    return torch.cat(parts)
