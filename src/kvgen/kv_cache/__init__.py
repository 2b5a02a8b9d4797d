"""KV caches: ``DynamicCache`` (grows by concatenation) and ``StaticCache``
(preallocated, written in place). The paged cache of the engine lives beside them.
"""

from kvgen.kv_cache.dynamic import DynamicCache
from kvgen.kv_cache.static import StaticCache

__all__ = ["DynamicCache", "StaticCache"]
