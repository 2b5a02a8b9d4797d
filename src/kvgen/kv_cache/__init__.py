"""KV caches: ``StaticCache`` (preallocated, written in place), ``DynamicCache`` (the same,
grown on demand) and the engine's ``PagedKVCache`` (a pool of
fixed-size blocks addressed by per-sequence block tables).
"""

from kvgen.kv_cache.dynamic import DynamicCache
from kvgen.kv_cache.paged import (
    PagedAttentionMetadata,
    PagedKVCache,
    num_blocks_for_memory,
)
from kvgen.kv_cache.static import StaticCache

__all__ = ["DynamicCache", "PagedAttentionMetadata", "PagedKVCache", "StaticCache", "num_blocks_for_memory"]
