"""``BlockManager``: the paged KV pool's bookkeeping (no tensors): free blocks, reference
counts, block tables and the prefix cache.

A block holds ``block_size`` consecutive positions of one sequence. With prefix caching
every FULL, computed block is registered under ``sha256(parent_hash + tokens)``, so a later
request whose tokens start the same way reuses those blocks (reference counts let several
requests share them; full blocks are never written again, so sharing needs no copy).
A freed block keeps its hash and stays reusable until it is evicted, least recently freed
first, once no never-cached free block is left. A freed block without a hash holds nothing
reusable and is taken again first (unlike vLLM's single FIFO queue): the pool's memory is
committed page by page on first write (``kv_cache.pool``), so reusing written blocks keeps a
lightly loaded engine's resident memory near what it holds.

Source: vLLM v1 ``KVCacheManager`` / ``BlockPool`` (semantics: at least one prompt token is
always recomputed so its logits exist; a request's tail blocks are evicted before its head);
nano-vllm ``block_manager.py`` (shape).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

from kvgen.engine.request import Request

# Tokens per block: 128, as vLLM's CPU backend with intel_extension_for_pytorch's kernels (16 elsewhere). A head's
# rows of a block are one contiguous run, and once finished requests have left a pool's free blocks in no order, a
# sequence's blocks are scattered through it: decode steps of the default model measured 1.08x (1 sequence, 3,000
# tokens of context) to 1.2x (16 sequences, 1,024 tokens) faster at 128 than at 16, and a served workload 1.07x more
# tokens/s at 4 and 16 requests in flight. A prefix-cache hit is reused in whole blocks, so up to 127 prompt tokens
# are recomputed.
DEFAULT_BLOCK_SIZE = 128


BlockHash = bytes  # a SHA-256 digest, 32 bytes


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Prefix-cache key of a full block: SHA-256 of its parent's key and its token ids (int64), so its tokens are
    chained to every block before it. A cryptographic hash, as vLLM's default since CVE-2025-25183: with Python's
    ``hash()`` of int tuples (not randomized per process) a client could build a prompt whose blocks collide with
    another request's and be served that request's KV entries."""
    return hashlib.sha256((parent_hash or b"") + array("q", token_ids).tobytes()).digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates KV blocks to requests; ``request.block_ids`` is the request's block table.

    Raises ``ValueError`` for ``num_blocks`` or ``block_size`` < 1.
    """

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, enable_prefix_caching: bool = True):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}  # block hash -> block id
        self._free_uncached: deque[int] = deque(range(num_blocks))  # taken from the left
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order: first = evicted first
        self._num_registered: dict[str, int] = {}  # request_id -> leading blocks already registered

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they are evictable)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Hashes of the request's first ``min(num_blocks, full blocks)`` blocks (memoized on the request)."""
        hashes, size = request.block_hashes, self.block_size
        num_full = min(num_blocks, request.num_tokens // size)
        while len(hashes) < num_full:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, request.all_token_ids[i * size : (i + 1) * size]))
        return hashes[:num_full]

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached full-block prefix of the request's tokens: (block ids, tokens they cover).

        Never covers every token (the last one must be computed to get logits). Takes no reference;
        pass the ids to ``allocate_slots`` in the same scheduling step.
        """
        if not self.enable_prefix_caching:
            return [], 0
        block_ids: list[int] = []
        for h in self.block_hashes(request, (request.num_tokens - 1) // self.block_size):
            block_id = self._cached.get(h)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self.block_size

    def _num_new_blocks(self, request: Request, num_new_tokens: int, computed_block_ids: Sequence[int]) -> int:
        num_held = len(request.block_ids) + len(computed_block_ids)
        num_tokens = request.num_computed_tokens + len(computed_block_ids) * self.block_size + num_new_tokens
        return max(0, cdiv(num_tokens, self.block_size) - num_held)

    def can_allocate(self, request: Request, num_new_tokens: int, computed_block_ids: Sequence[int] = ()) -> bool:
        """Whether ``allocate_slots`` with the same arguments would succeed."""
        num_revived = sum(1 for b in computed_block_ids if self.ref_counts[b] == 0)  # leave the free pool
        return self._num_new_blocks(request, num_new_tokens, computed_block_ids) <= self.num_free_blocks - num_revived

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_block_ids: Sequence[int] = ()) -> bool:
        """Grow ``request.block_ids`` to cover positions ``[0, computed + num_new_tokens)``.

        ``computed_block_ids`` (a prefix-cache hit, only for a request holding no blocks) are
        shared first and their tokens count as computed. Returns False, changing nothing, when
        the pool is short.
        """
        assert not computed_block_ids or not request.block_ids, "cache hits only start a block table"
        if not self.can_allocate(request, num_new_tokens, computed_block_ids):
            return False
        num_new = self._num_new_blocks(request, num_new_tokens, computed_block_ids)
        for block_id in computed_block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free_cached[block_id]
            self.ref_counts[block_id] += 1
        request.block_ids.extend(computed_block_ids)
        request.block_ids.extend(self._take_free_block() for _ in range(num_new))
        return True

    def _take_free_block(self) -> int:
        if self._free_uncached:
            block_id = self._free_uncached.popleft()
        else:  # evict the least recently freed cached block
            block_id, _ = self._free_cached.popitem(last=False)
            block_hash = self._block_hash[block_id]
            assert block_hash is not None  # every cached block has a hash
            del self._cached[block_hash]
            self._block_hash[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that ``num_computed_tokens`` now fully covers.

        A block whose content is already cached in another block stays unregistered.
        """
        if not self.enable_prefix_caching:
            return
        start = self._num_registered.get(request.request_id, 0)
        end = request.num_computed_tokens // self.block_size
        hashes = self.block_hashes(request, end)
        for i in range(start, end):
            block_id, h = request.block_ids[i], hashes[i]
            if self._block_hash[block_id] is None and h not in self._cached:
                self._cached[h] = block_id
                self._block_hash[block_id] = h
        self._num_registered[request.request_id] = max(start, end)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (no later request hits them), as after new weights. Refused, changing nothing,
        while any request holds blocks: returns False then, True once reset. Source: vLLM v1
        ``BlockPool.reset_prefix_cache`` (False while ``num_used_blocks`` is not zero)."""
        if any(self.ref_counts):
            return False
        self._free_uncached.extendleft(self._free_cached)  # written blocks are taken first (their pages are resident)
        self._free_cached.clear()
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        return True

    def free(self, request: Request) -> None:
        """Drop the request's references; blocks nobody holds return to the pool (tail first)."""
        for block_id in reversed(request.block_ids):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_counts[block_id] == 0:
                if self._block_hash[block_id] is None:  # reused first: its pages are resident and warm
                    self._free_uncached.appendleft(block_id)
                else:
                    self._free_cached[block_id] = None
        request.block_ids = []
        self._num_registered.pop(request.request_id, None)
