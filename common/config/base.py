"""What every config section is built from: the section base class, the constrained number types, the error."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

__all__ = ["ConfigError", "Section", "PositiveInt", "NonNegativeInt", "PositiveFloat", "NonNegativeFloat",
           "Fraction", "Port"]


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key path."""


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=False):
    """A config section: keyword-only, unknown keys refused.

    Each field is `name: type = default` with its docstring on the line below it; `rlstream config docs` and the
    validation messages read those docstrings from the source (`common/config/docs.py`).
    """


# Constrained numbers, the bounds msgspec checks at load (an error names the key and the bound).
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
PositiveFloat = Annotated[float, Meta(gt=0)]
NonNegativeFloat = Annotated[float, Meta(ge=0)]
Fraction = Annotated[float, Meta(ge=0, le=1)]
Port = Annotated[int, Meta(ge=0, le=65535)]  # 0: pick a free one
