"""Package attributes imported when first used (PEP 562's module ``__getattr__``).

A package whose re-exports pull heavy modules in (torch, the trainer, vLLM's machinery) lists them as
``{name: home module}`` and sets ``__getattr__ = lazy_attributes(__name__, homes)``: importing the
package, or a light module of it the CLI reads at start-up (``bench.settings``, ``compare.settings``),
then imports none of them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package`` that imports each of ``homes``' names from its home
    module when first asked for, and refuses any other name as a module does."""

    def __getattr__(name: str) -> Any:
        if name in homes:
            return getattr(importlib.import_module(homes[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
