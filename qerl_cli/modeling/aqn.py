"""AQN's perturbation of the rollout model: RMSNorm weights plus Gaussian noise, from a clean copy.

QeRL (arXiv 2510.11696, Sec. 3.3 and Appendix F) turns the static quantization error of the
4-bit rollout model into an exploration signal: before each rollout, every RMSNorm weight ``w`` of
the *rollout* model becomes ``w + z`` with ``z ~ N(0, sigma^2)`` drawn per channel. Because an RMSNorm
scale multiplies the input of the following linear layers, this equals a row-wise multiplicative
noise ``(1 + z / w)`` on those (quantized) weights, without touching the 4-bit kernels. The sigma of
each step comes from the schedule in :mod:`qerl_cli.rl.aqn_schedule`.

Norms that store ``w`` but scale by ``1 + w`` (HF ``Gemma3RMSNorm``, vLLM ``GemmaRMSNorm``) need no
special case: adding ``z`` to the stored ``w`` gives the channel scale ``(1 + w) + z``, the same additive
noise on the applied scale (a multiplicative ``w * (1 + z)`` would be wrong there: a stored weight near 0
would get no noise). How much of a sigma survives the cast to the weight's dtype depends on the stored
values: in bf16 a weight near 1.0 has a spacing of 2**-7, so sigmas well below ~4e-3 mostly round away.
:attr:`NormNoiser.last_changed_fraction` (logged as ``rollout/noise_changed_fraction``) reports the share
of weights that actually moved, not a share of tokens; per-model figures: ``docs/aqn.md``.

Deliberate differences from the reference code (NVlabs/QeRL):

- The reference adds noise in place to the rollout model's norm weights every step, so the noise
  accumulates across steps (a random walk). QeRL's Algorithm 1 and Eq. 10 describe
  ``w_noise = w + Z``, i.e. always from the clean weight; we follow the paper: every draw starts
  from the clean copy and :meth:`NormNoiser.restore` puts the exact clean weights back.
- The noise is drawn in float32 and added to the float32 clean weight before casting to the
  weight's dtype (the reference casts the noise to bf16 first).

The trainer's forward must never see the noise. With the HF engine (rollout model == policy
model) the engine wraps *only* generation in ``with noiser.noised(sigma, generator):`` (or calls
:meth:`NormNoiser.apply` before and :meth:`NormNoiser.restore` after generation); the vLLM engine
keeps its own clean copy and loads :func:`perturb_norm_weights` output into its model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from qerl_cli.config.checks import noise_sigma
from qerl_cli.errors import QerlError


def is_rms_norm(name: str, module: nn.Module) -> bool:
    """Default norm predicate: the module's class name ends with ``RMSNorm`` (Qwen2RMSNorm,
    LlamaRMSNorm, Qwen3RMSNorm, Gemma3RMSNorm, vLLM's RMSNorm and GemmaRMSNorm, ...) and it has a
    weight tensor."""
    has_weight = isinstance(getattr(module, "weight", None), torch.Tensor)
    return has_weight and type(module).__name__.endswith("RMSNorm")


def find_norm_modules(
    model: nn.Module, predicate: Callable[[str, nn.Module], bool] = is_rms_norm
) -> dict[str, nn.Module]:
    """Every module of ``model`` that ``predicate`` selects, by qualified name, in model order."""
    return {name: module for name, module in model.named_modules() if predicate(name, module)}


def perturb_norm_weights(
    clean: dict[str, torch.Tensor], sigma: float, generator: torch.Generator | None = None
) -> dict[str, torch.Tensor]:
    """New tensors ``clean[name] + N(0, sigma^2)`` (one draw per element), in ``clean``'s order.

    The noise is drawn on the generator's device (default RNG of each tensor's device without a
    generator) in float32, added in float32 and cast back to each tensor's dtype and device. Given
    the same generator state and the same name order, every caller (HF or vLLM engine) gets the same
    noise. ``clean`` is never modified.
    """
    noise_sigma("AQN sigma", sigma)
    noisy: dict[str, torch.Tensor] = {}
    for name, weight in clean.items():
        device = generator.device if generator is not None else weight.device
        noise = torch.randn(weight.shape, generator=generator, device=device, dtype=torch.float32)
        noisy[name] = (weight.float() + sigma * noise.to(weight.device)).to(weight.dtype)
    return noisy


class NormNoiser:
    """Perturb a plain torch model's RMSNorm weights from a clean copy, and put them back.

    The clean copy is taken at the first :meth:`apply` after construction or after a
    :meth:`restore`, so norms that are trainable (updated between rollouts) are picked up. While
    noised, further ``apply`` calls redraw from the same clean copy: noise never accumulates. Do not
    step an optimizer on the norms while noised: :meth:`restore` would undo that step.
    """

    def __init__(self, model: nn.Module, predicate: Callable[[str, nn.Module], bool] = is_rms_norm) -> None:
        self.modules = find_norm_modules(model, predicate)
        self._clean: dict[str, torch.Tensor] | None = None
        self.last_sigma = 0.0
        self.last_changed_fraction = 0.0

    @property
    def num_modules(self) -> int:
        return len(self.modules)

    @property
    def is_noised(self) -> bool:
        return self._clean is not None

    def apply(self, sigma: float, generator: torch.Generator | None = None) -> int:
        """Set every matched norm weight to clean + N(0, sigma^2); return how many were perturbed.

        ``sigma == 0`` restores the clean weights and returns 0. Raises :class:`QerlError` when
        ``sigma > 0`` and the model has no matching norm module (AQN would silently do nothing).
        """
        noise_sigma("AQN sigma", sigma)
        self.last_sigma = sigma
        if sigma == 0:
            self.restore()
            self.last_changed_fraction = 0.0
            return 0
        if not self.modules:
            raise QerlError(
                "AQN is on (sigma > 0) but the model has no RMSNorm module to perturb; use a model with "
                "RMSNorm layers, pass a norm predicate that matches its norms, or turn AQN off"
            )
        if self._clean is None:
            self._clean = {name: m.weight.detach().clone() for name, m in self.modules.items()}
        noisy = perturb_norm_weights(self._clean, sigma, generator)
        changed = total = 0
        with torch.no_grad():
            for name, module in self.modules.items():
                module.weight.copy_(noisy[name])
                changed += int((noisy[name] != self._clean[name]).sum())
                total += noisy[name].numel()
        self.last_changed_fraction = changed / total if total else 0.0
        return len(self.modules)

    def restore(self) -> None:
        """Put the exact clean weights back (no-op when not noised)."""
        if self._clean is None:
            return
        with torch.no_grad():
            for name, module in self.modules.items():
                module.weight.copy_(self._clean[name])
        self._clean = None

    @contextmanager
    def noised(self, sigma: float, generator: torch.Generator | None = None) -> Iterator[int]:
        """``with noiser.noised(sigma, g) as n:`` generate with noised norms; clean again on exit,
        even when generation raises."""
        try:
            yield self.apply(sigma, generator)
        finally:
            self.restore()
