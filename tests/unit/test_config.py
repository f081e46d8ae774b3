"""EngineConfig rejects values the engine could not run, before any model loads."""

from __future__ import annotations

import pytest

from qworker.config import EngineConfig

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "float64"}, "dtype must be auto or one of"),
        ({"seed": 2**63}, "seed must be in"),
        ({"seed": -(2**63) - 1}, "seed must be in"),
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"attention_backend": "flash"}, "attention_backend must be"),
    ],
)
def test_bad_values_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("dtype", ["auto", "float32", "bf16", "float16"])
def test_known_dtypes_and_extreme_seeds_are_accepted(dtype: str) -> None:
    EngineConfig(dtype=dtype, seed=2**63 - 1)
    EngineConfig(dtype=dtype, seed=-(2**63))
