"""The base of every config model (frozen, typed, strict, and no unknown keys) and the counts
configs write with suffixes ('300K', '1.5e18')."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from scalestudy.config.errors import ConfigError

Tuple = Annotated[tuple, Field(strict=False)]  # YAML gives lists; accept them for tuples.


class Frozen(BaseModel):
    """A frozen pydantic model that refuses unknown keys, loose types and inf/nan."""

    # allow_inf_nan=False: `.inf` or `.nan` for a float (eps, grad_clip_norm, z_loss, ...) is
    # an error naming the key, not a run whose parameters never change.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)
    # Text fields where "" means something (a delimiter of nothing); every other text field
    # refuses "" unless "" is its default: `data.delimiter=` would split on nothing, a path or
    # name of "" would be found missing (or worse, be the current directory) far into a run.
    empty_ok: ClassVar[frozenset[str]] = frozenset()

    @field_validator("*", mode="after")
    @classmethod
    def _not_empty(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str) and not value and info.field_name not in cls.empty_ok:
            default = cls.model_fields[info.field_name].default
            if default != "":
                unset = "leave the key out" + (f" for {default!r}" if default else "")
                raise ValueError(f"is empty; give a non-empty value, or {unset}")
        return value

    def replace(self, **changes: Any) -> Frozen:
        """A validated copy with `changes` applied (nested models may be given as dicts)."""
        return type(self).model_validate({**self.model_dump(), **changes})


_COUNT_SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def parse_count(value: Any) -> Any:
    """Read a count written as a number, '1e6', '1.5e18' or with a suffix ('300K', '168B')."""
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        scale = _COUNT_SUFFIXES.get(text[-1:].upper(), 1.0) if text else 1.0
        if scale != 1.0:
            text = text[:-1]
        try:
            return float(text) * scale
        except ValueError:
            raise ConfigError(
                f"cannot read {value!r} as a count; write a number such as 2e6, 1.5e18, "
                "300K, 20M or 168B"
            ) from None
    return value


Count = Annotated[float, BeforeValidator(parse_count), Field(strict=False, gt=0)]
