"""Load a policy model: BF16, or a 4-bit checkpoint straight into QuantLinear layers.

For 4-bit checkpoints (compressed-tensors ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized``, or
bitsandbytes NF4 as transformers saves it) the model skeleton is built with its *parameters* on the meta
device, the quantized linears are swapped for QuantLinear layers allocated at packed size, and then the
safetensors files are read one tensor at a time straight onto the target device. No dense copy of a
quantized weight ever exists, so peak memory stays near the packed model size. Embeddings, norms and
``lm_head`` are loaded as stored (cast to ``dtype``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from qerl_cli import formats
from qerl_cli.errors import QerlError
from qerl_cli.formats.base import QuantFormat
from qerl_cli.formats.nf4 import STATE_KEY, NF4Format
from qerl_cli.modeling.quant_linear import QuantLinear
from qerl_cli.modeling.source_checks import (
    check_model_source,
    pickle_allowed,
    pickle_refusal,
    weight_file_kwargs,
)
from qerl_cli.modeling.sources import resolve_model_source

COMPRESSED_TENSORS_FORMATS = {
    fmt.compressed_tensors_format: name
    for name, fmt in formats.FORMATS.items()
    if fmt.compressed_tensors_format is not None
}
MISSING_MODEL_HINT = (
    "write a 4-bit base with `qerl quantize MODEL`, or build recipes/tiny.yaml's offline base with "
    "`qerl tiny-base` (run from the repository root)"
)
# Activation-quantization side tensors of W4A4 checkpoints: weight-only loading ignores them.
_IGNORED_SUFFIXES = (".input_global_scale",)


# The record `qerl quantize` writes beside a 4-bit checkpoint (qerl_cli.quantize.report.QuantizeResult).
QUANT_RECORD = "qerl_quant.json"
# The record beside a dense BF16 copy of a 4-bit base's dequantized weights (qerl_cli.quantize.native).
DEQUANTIZED_RECORD = "qerl_dequantized.json"  # what a dense copy was made from (format, method, source)


def quantized_with(path: str | Path) -> str | None:
    """The method (gptq, awq, rtn) `qerl quantize` made the checkpoint at ``path`` with; None when it
    holds no readable record (a BF16 model, or a 4-bit one made elsewhere)."""
    record = Path(path) / QUANT_RECORD
    try:
        method = json.loads(record.read_text()).get("method")
    except (OSError, ValueError, AttributeError):
        return None
    return str(method) if method else None


def read_config(path: Path) -> dict:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise QerlError(f"{path} has no config.json; pass a Hugging Face model folder")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise QerlError(
            f"{config_file} is not valid JSON ({exc}); fix it or download the model folder again"
        ) from None


def detect_format(config: dict) -> str:
    """``bf16`` (unquantized), ``nvfp4``, ``mxfp4`` or ``nf4`` from a config.json dict."""
    qc = config.get("quantization_config")
    if not qc:
        return "bf16"
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        names = {qc.get("format")} | {g.get("format") for g in groups.values()}
        names.discard(None)
        known = {COMPRESSED_TENSORS_FORMATS.get(n) for n in names}
        if len(names) != 1 or None in known:
            raise QerlError(
                f"compressed-tensors format(s) {sorted(names)} not supported; use one of "
                f"{sorted(COMPRESSED_TENSORS_FORMATS)} (qerl quantize writes them)"
            )
        return known.pop()
    if method == "bitsandbytes":
        if not qc.get("load_in_4bit") or qc.get("bnb_4bit_quant_type") != "nf4":
            raise QerlError(
                "only bitsandbytes 4-bit nf4 checkpoints are supported (load_in_4bit, quant_type nf4)"
            )
        return "nf4"
    raise QerlError(
        f"quantization method {method!r} not supported; use compressed-tensors or bitsandbytes (formats "
        f"{', '.join(formats.names())})"
    )


def folder_format(path: str | Path) -> str | None:
    """The format (bf16, nvfp4, mxfp4, nf4) the config.json of the local model folder ``path`` says it
    holds; None where that cannot be read: no such folder or config.json (a Hub id, a .gguf file, an
    alias, a folder not made yet), a config that is not JSON, or a quantization qerl does not load.
    Those are not refused here: the source checks or the load say what is wrong with them."""
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text())
        return detect_format(config) if isinstance(config, dict) else None
    except (OSError, ValueError, QerlError, AttributeError):
        return None


def check_declared_format(declared: str, path: str | Path, held: str | None = None) -> str | None:
    """Refuse a ``model.format`` (``declared``; auto accepts any) that is not the format the folder
    ``path`` holds: ``held`` where the caller has detected it already, else :func:`folder_format`.
    Returns the format held (None: not known, nothing refused). The one home of this check and its
    message: `qerl train`'s checks before work ask it, and the loader and the vLLM engine again, so a
    mismatch reads the same whether it is found in a second or after the weights have loaded."""
    held = folder_format(path) if held is None else held
    if declared == "auto" or held is None or held == declared:
        return held
    source = "has no quantization_config" if held == "bf16" else f"has a {held} quantization_config"
    if declared == "bf16":
        other = "the BF16 model it was quantized from"
    else:
        origin = path if held == "bf16" else "BF16_MODEL"
        other = f"a {declared} checkpoint (`qerl quantize {origin} --format {declared} -o DIR` writes one)"
    raise QerlError(
        f"model.format={declared} but {path} holds a {held} checkpoint (its config.json {source}): set "
        f"model.format={held} (or auto) to use what the folder holds, or point model.path at {other}"
    )


def format_for(name: str, config: dict) -> QuantFormat:
    if name == "nf4":
        return NF4Format(
            double_quant=bool(config["quantization_config"].get("bnb_4bit_use_double_quant", False))
        )
    return formats.get(name)


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise QerlError(f"{path} has no model.safetensors(.index.json); only safetensors checkpoints are loaded")


def checkpoint_keys(files: list[Path]) -> list[str]:

    keys: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys.extend(f.keys())
    return keys


def quantized_prefixes(keys: list[str], fmt: QuantFormat) -> list[str]:
    """Module names that hold quantized weights, recognised by the format's marker tensor."""
    marker = "." + (STATE_KEY if fmt.name == "nf4" else "weight_packed")
    return sorted(k[: -len(marker)] for k in keys if k.endswith(marker))


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Create modules with parameters on the meta device but real buffers.

    Buffers such as rotary ``inv_freq`` are computed in ``__init__`` and are not in the checkpoint, so
    they must be materialised; parameters will come from the checkpoint and must not cost memory.
    """
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def load_base_model(
    path: str,
    fmt: str,
    dtype: torch.dtype,
    device: torch.device,
    *,
    trust_remote_code: bool = False,
    trust_hint: str = "--set model.trust_remote_code=true",
) -> tuple[nn.Module, str]:
    """(model, format name) for a base checkpoint; ``fmt`` "auto" accepts what the folder holds.

    4-bit checkpoints load packed into QuantLinear layers (no dense copy), BF16 ones as they are.
    The folder is checked first (:func:`~qerl_cli.modeling.source_checks.check_model_source`): a missing
    folder, pickle-only weights or a model that needs its own code fail with what to do.
    """
    check_model_source(
        path,
        what="model",
        trust_remote_code=trust_remote_code,
        trust_hint=trust_hint,
        hint=MISSING_MODEL_HINT,
    )
    model, found = load_policy_model(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    check_declared_format(fmt, path, found)  # `qerl train` asked before loading; other callers did not
    return model, found


def load_tokenizer(path: str, *, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    path = resolve_model_source(path)  # a .gguf file or alias: the tokenizer of its converted folder
    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        # Padding positions are masked everywhere; any id works, EOS is the conventional choice.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy_model(
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    compute_dtype: torch.dtype | None = None,
    *,
    trust_remote_code: bool = False,
) -> tuple[nn.Module, str]:
    """Load a causal LM folder; returns ``(model, detected_format)`` with format in bf16/nvfp4/mxfp4/nf4.

    Quantized linears become :class:`QuantLinear` (packed at rest); everything else is ``dtype``.
    BF16 weights load from safetensors only, unless ``QERL_ALLOW_PICKLE=1`` opts in to pickle files.
    """
    path = Path(resolve_model_source(path))  # a .gguf file or alias becomes its converted folder
    config_dict = read_config(path)
    fmt_name = detect_format(config_dict)
    device = torch.device(device)
    if fmt_name == "bf16":
        model = load_pretrained_lm(path, dtype=dtype, trust_remote_code=trust_remote_code)
        return model.to(device), fmt_name
    model = _build_quantized_skeleton(path, format_for(fmt_name, config_dict), dtype, device, compute_dtype)
    return model, fmt_name


def load_pretrained_lm(ref: str | Path, *, what: str = "model", **kwargs: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(ref, **kwargs)``, safetensors only: every load of a model's
    weights by transformers goes through here (a GGUF file goes through ``sources.load_gguf``, which parses
    it and unpickles nothing).

    A folder or hub id without safetensors weights is refused with a QerlError saying why, not
    transformers' advice to drop ``use_safetensors=True``: the checks before loading miss a hub id whose
    repository holds only ``*.bin``, which transformers would otherwise unpickle.
    """
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(ref, **kwargs, **weight_file_kwargs())
    except OSError as exc:
        text = str(exc)
        if pickle_allowed() or "file named" not in text or ".safetensors" not in text:
            raise  # some other failure (network, a missing config): the caller's to report
        raise pickle_refusal(what, ref, "no safetensors weights (model.safetensors or its index)") from None


def _build_quantized_skeleton(
    path: Path, fmt: QuantFormat, dtype: torch.dtype, device: torch.device, compute_dtype: torch.dtype | None
) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    # The checkpoint is read here, not by transformers' quantizers: the skeleton must be plain.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)

    files = safetensors_files(path)
    keys = checkpoint_keys(files)
    prefixes = quantized_prefixes(keys, fmt)
    if not prefixes:
        raise QerlError(
            f"{path}: config says {fmt.name} but no quantized tensors were found in the checkpoint"
        )
    for prefix in prefixes:
        _swap_in_quant_linear(model, prefix, fmt, dtype, device, compute_dtype)
    for module in model.modules():  # non-persistent buffers built on CPU in __init__ follow the model
        if not isinstance(module, QuantLinear):
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(device)

    _stream_checkpoint(model, files, prefixes, fmt, dtype, device)
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
    missing = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise QerlError(
            f"{path}: checkpoint lacks tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    return model.eval()


def _swap_in_quant_linear(
    model: nn.Module, prefix: str, fmt: QuantFormat, dtype: torch.dtype, device: torch.device,
    compute_dtype: torch.dtype | None,
) -> None:  # fmt: skip
    parent_name, _, child_name = prefix.rpartition(".")
    parent = model.get_submodule(parent_name)
    linear = getattr(parent, child_name)
    if not isinstance(linear, nn.Linear):
        raise QerlError(f"quantized tensors for {prefix}, but the model has a {type(linear).__name__} there")
    layer = QuantLinear(
        linear.in_features, linear.out_features, fmt, bias=linear.bias is not None, device=device,
        compute_dtype=compute_dtype, bias_dtype=dtype,
    )  # fmt: skip
    setattr(parent, child_name, layer)


def _stream_checkpoint(
    model: nn.Module, files: list[Path], prefixes: list[str], fmt: QuantFormat, dtype: torch.dtype,
    device: torch.device,
) -> None:  # fmt: skip
    """Copy every checkpoint tensor into the model, one tensor in memory at a time (plus one layer's
    packed tensors while they are gathered)."""
    prefix_set = set(prefixes)
    needed = set(fmt.checkpoint_names())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not dicts
                if key.endswith(_IGNORED_SUFFIXES):
                    continue
                owner, name = _split_quant_key(key, prefix_set, needed)
                if owner is not None:
                    group = pending.setdefault(owner, {})
                    group[name] = f.get_tensor(key)
                    if needed <= group.keys():
                        model.get_submodule(owner).load_checkpoint_tensors(pending.pop(owner))
                    continue
                if not _assign_dense(model, key, f.get_tensor(key), dtype):
                    unexpected.append(key)
    if pending:
        raise QerlError(f"incomplete {fmt.name} tensors for {sorted(pending)[:3]}: need {sorted(needed)}")
    if unexpected:
        raise QerlError(f"checkpoint tensors the model does not have: {unexpected[:5]}")


def _split_quant_key(key: str, prefixes: set[str], names: set[str]) -> tuple[str | None, str]:
    for name in names:
        if key.endswith("." + name):
            owner = key[: -len(name) - 1]
            if owner in prefixes:
                return owner, name
    return None, ""


def _assign_dense(model: nn.Module, key: str, tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """Put a non-quantized checkpoint tensor in place; False if the model has no such tensor."""
    module_name, _, attr = key.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return False
    if tensor.is_floating_point():
        tensor = tensor.to(dtype)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=tensor.is_floating_point())
        return True
    if attr in module._buffers and module._buffers[attr] is not None:
        module._buffers[attr] = (
            tensor.to(module._buffers[attr].dtype) if isinstance(module, QuantLinear) else tensor
        )
        return True
    return False
