"""kvgen.kv_cache.static: ``StaticCache``'s constructor checks its sizes."""

from __future__ import annotations

import pytest

from kvgen.kv_cache import StaticCache

SIZES = {"num_layers": 2, "batch_size": 1, "num_kv_heads": 2, "head_dim": 16, "max_cache_len": 8}


@pytest.mark.parametrize("name", list(SIZES))
@pytest.mark.parametrize("bad", [0, 8.5, "8", True])
def test_a_size_that_is_no_positive_int_is_named(name: str, bad: object) -> None:
    """A float or str died in the allocation with a TypeError naming no argument ("'float' object cannot be
    interpreted as an integer", "'<' not supported between instances of 'str' and 'int'")."""
    with pytest.raises(ValueError, match=f"{name} must be an int >= 1, got {bad!r}"):
        StaticCache(**{**SIZES, name: bad})
    assert StaticCache(**SIZES).layer_shape() == (1, 2, 0, 16)
