"""QuantLinear: forward equals F.linear on the dequantized weight, input gradients match, LoRA trains."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qerl_cli import formats
from qerl_cli.errors import QerlError
from qerl_cli.modeling.lora import attach_lora, lora_parameters
from qerl_cli.modeling.quant_linear import QuantLinear, packed_nbytes


def make_layer(name: str, bias: bool = True, dtype=torch.bfloat16) -> QuantLinear:
    torch.manual_seed(0)
    return QuantLinear.from_linear(nn.Linear(256, 128, bias=bias).to(dtype), name)


@pytest.mark.parametrize("name", formats.names())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_equals_linear_on_dequantized_weight(name, dtype) -> None:
    layer = make_layer(name)
    x = torch.randn(3, 5, 256, dtype=dtype)
    expected = F.linear(x, layer.dequantized_weight(dtype), layer.bias.to(dtype))
    assert torch.equal(layer(x), expected)


@pytest.mark.parametrize("name", formats.names())
def test_backward_under_activation_checkpointing(name) -> None:
    """Gradient checkpointing re-runs forward and unpacks the saved tensors in backward: the
    training default, so it must work for every format (and give the plain backward's gradient)."""
    from torch.utils.checkpoint import checkpoint

    layer = make_layer(name, dtype=torch.float32)
    x = torch.randn(2, 7, 256, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    x_plain = x.detach().clone().requires_grad_(True)
    layer(x_plain).sum().backward()
    assert torch.equal(x.grad, x_plain.grad)


@pytest.mark.parametrize("name", formats.names())
def test_input_gradient_matches_autograd_through_dequantized_weight(name) -> None:
    layer = make_layer(name)
    x = torch.randn(4, 9, 256, requires_grad=True)
    upstream = torch.randn(4, 9, 128)
    (layer(x) * upstream).sum().backward()

    weight = layer.dequantized_weight(torch.float32).requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    (F.linear(x_ref, weight, layer.bias.float()) * upstream).sum().backward()
    rel = (x.grad - x_ref.grad).norm() / x_ref.grad.norm()
    assert rel < 1e-3
    # Packed tensors are buffers: frozen, never given a gradient.
    assert not list(layer.parameters())
    assert all(not b.requires_grad and b.grad is None for b in layer.buffers())


def test_backward_saves_only_packed_tensors() -> None:
    layer = make_layer("nvfp4")
    x = torch.randn(2, 256, requires_grad=True)
    out = layer(x)
    saved = out.grad_fn.saved_tensors
    packed = {b.data_ptr() for b in layer.packed_buffers().values()}
    assert {t.data_ptr() for t in saved} == packed  # not the input, not a dense weight


@pytest.mark.parametrize("name", formats.names())
def test_packed_at_rest_and_dtype_casts_keep_packing(name) -> None:
    layer = make_layer(name, dtype=torch.float32)
    assert "weight" not in dict(layer.named_buffers()) or name == "nf4"
    assert packed_nbytes(layer) < 256 * 128 * 2 / 3  # well under the BF16 weight's size
    before = {k: v.clone() for k, v in layer.packed_buffers().items()}
    layer.to(torch.bfloat16)
    assert layer.bias.dtype == torch.bfloat16
    for key, value in layer.packed_buffers().items():
        assert value.dtype == before[key].dtype and torch.equal(value, before[key]), key


def test_state_dict_round_trip() -> None:
    layer = make_layer("nvfp4")
    clone = QuantLinear(256, 128, "nvfp4", bias=True)
    clone.load_state_dict(layer.state_dict())
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    assert torch.equal(clone(x), layer(x))
    assert set(layer.state_dict()) == {"weight_packed", "weight_scale", "weight_global_scale", "bias"}


class TwoLayer(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(128)
        self.up_proj = QuantLinear.from_linear(nn.Linear(128, 256), name)
        self.down_proj = QuantLinear.from_linear(nn.Linear(256, 128, bias=False), name)

    def forward(self, x):
        return self.down_proj(F.silu(self.up_proj(self.norm(x))))


@pytest.mark.parametrize("name", formats.names())
def test_lora_on_quant_linear_trains(name) -> None:
    model = attach_lora(TwoLayer(name), r=4, alpha=8, target_modules=["up_proj", "down_proj"], task_type=None)
    params = lora_parameters(model)
    assert len(params) == 4 and all(p.dtype == torch.float32 for p in params)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, p in model.named_parameters() if "lora_" in n
    }
    x, target = torch.randn(16, 128), torch.randn(16, 128)
    optimizer = torch.optim.Adam(params, lr=1e-2)
    losses = []
    for _ in range(15):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        assert all(p.grad is not None for p in params)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.95
    base = model.base_model.model.up_proj.base_layer
    assert isinstance(base, QuantLinear) and all(b.grad is None for b in base.buffers())
    with pytest.raises(QerlError, match="cannot be merged"):
        model.merge_and_unload()
