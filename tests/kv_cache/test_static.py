"""StaticCache: refuses sizes it cannot hold, naming them."""

from __future__ import annotations

import pytest

from kvgen.kv_cache import StaticCache

SIZES = {"num_layers": 2, "batch_size": 1, "num_kv_heads": 2, "head_dim": 4, "max_cache_len": 8}


@pytest.mark.parametrize("name", list(SIZES))
def test_a_size_below_one_is_refused_by_name(name):
    # the error named lazy_zeros' "count" and shape instead of the argument
    with pytest.raises(ValueError, match=rf"^{name} must be an int >= 1, got 0$"):
        StaticCache(**{**SIZES, name: 0})

