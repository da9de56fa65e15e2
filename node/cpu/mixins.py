"""Classes made by putting a mixin in front of an mlx-lm module's own class.

The fused paths (`fused_layers`, `fused_stack`, `moe_blocks`, `layer_eval`) change only a module's
class: parameters, children, names and `isinstance` checks see the same model. Each (mixin, class)
pair is made once, so every layer of a model shares one class, named and placed as the original.
"""

from __future__ import annotations

from typing import Any

_CLASSES: dict[tuple[type, type], type] = {}


def with_mixin(mixin: type, cls: type, **namespace: Any) -> type:
    """`cls` with `mixin` in front of it (and `namespace`, e.g. the kernels module, as class attributes)."""
    if (mixin, cls) not in _CLASSES:
        attributes = {"__module__": cls.__module__, **namespace}
        _CLASSES[mixin, cls] = type(cls.__name__, (mixin, cls), attributes)
    return _CLASSES[mixin, cls]
