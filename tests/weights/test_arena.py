"""``WeightArena``: packed weights copied back to back into mappings advised ``MADV_HUGEPAGE``, and the loader's use
of it (every ``QuantLinear`` weight of a loaded model lives in one)."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from helpers import save_tiny_model_dir

from kvgen.loader import load_model
from kvgen.models.quant_linear import QuantLinear
from kvgen.weights import arena
from kvgen.weights.arena import (
    CHUNK_BYTES,
    HUGE_PAGE_BYTES,
    WeightArena,
    huge_pages_available,
)

needs_thp = pytest.mark.skipif(not huge_pages_available(), reason="the kernel has no transparent huge pages")


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping of this process that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
def test_adopted_tensors_are_equal_copies_back_to_back_in_advised_mappings() -> None:
    gen = torch.Generator().manual_seed(0)
    a = WeightArena()
    sources = [torch.randint(0, 256, (3, 5, 160), dtype=torch.uint8, generator=gen), torch.randn(7, 9, generator=gen),
               torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=gen)]
    copies = [a.adopt(t) for t in sources]
    for src, got in zip(sources, copies):
        assert torch.equal(got, src) and got.dtype == src.dtype and got.is_contiguous()
        assert got.data_ptr() != src.data_ptr()
        assert got.data_ptr() % 64 == 0  # a cache line
        assert "hg" in _vm_flags(got.data_ptr())  # MADV_HUGEPAGE
    assert copies[0].data_ptr() % HUGE_PAGE_BYTES == 0  # the first starts a huge page
    assert copies[1].data_ptr() == copies[0].data_ptr() + 2432  # 2,400 bytes, then the next cache line
    assert copies[2].data_ptr() == copies[1].data_ptr() + 256  # 7 x 9 float32: 252 bytes
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 1  # one mapping
    fresh = a.empty((5, 3), torch.float32)  # what the loader packs into: zeros, next in line
    assert fresh.shape == (5, 3) and fresh.dtype == torch.float32 and not fresh.any()
    assert fresh.data_ptr() == copies[2].data_ptr() + 1024  # 1,000 bytes, then the next cache line


@needs_thp
def test_a_large_tensor_gets_its_own_mapping_and_the_chunk_keeps_its_room() -> None:
    a = WeightArena()
    small = a.adopt(torch.ones(100, dtype=torch.uint8))
    big = a.adopt(torch.full((CHUNK_BYTES // 2 + 1,), 7, dtype=torch.uint8))
    after = a.adopt(torch.ones(100, dtype=torch.uint8))
    assert big.untyped_storage().data_ptr() != small.untyped_storage().data_ptr()
    assert big.data_ptr() % HUGE_PAGE_BYTES == 0 and int(big[-1]) == 7 and "hg" in _vm_flags(big.data_ptr())
    assert after.data_ptr() == small.data_ptr() + 128  # the next cache line: the big one took no room here


def test_a_disabled_arena_or_a_machine_without_huge_pages_keeps_the_tensor(monkeypatch) -> None:
    t = torch.ones(4)
    assert WeightArena(enabled=False).adopt(t) is t
    monkeypatch.setattr(arena, "THP_MODE", Path("/nonexistent/enabled"))
    assert not huge_pages_available() and WeightArena().adopt(t) is t


def test_huge_pages_follow_the_kernels_mode(tmp_path: Path, monkeypatch) -> None:
    mode = tmp_path / "enabled"
    monkeypatch.setattr(arena, "THP_MODE", mode)
    for text, available in (("always madvise [never]\n", False), ("always [madvise] never\n", True),
                            ("[always] madvise never\n", True)):
        mode.write_text(text)
        assert huge_pages_available() is available, text


@needs_thp
def test_a_loaded_models_packed_weights_live_in_the_arena(tmp_path: Path) -> None:
    """Quantized at load (q4_0): every QuantLinear's weight sits in an advised mapping, and the tied embedding and
    LM head share one weight."""
    save_tiny_model_dir(tmp_path, tie=True)
    model, _ = load_model(tmp_path, quantization="q4_0")
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears
    for linear in linears:
        assert "hg" in _vm_flags(linear.qweight.data_ptr())
    assert len({m.qweight.untyped_storage().data_ptr() for m in linears}) == 1  # one chunk: a tiny model


def test_a_refused_advice_still_gives_working_memory(monkeypatch) -> None:
    """Where madvise is refused (a container's seccomp policy), the arena's memory is ordinary pages, and a load
    goes on."""
    class Refusing(mmap.mmap):
        def madvise(self, *args: object) -> None:
            raise PermissionError("madvise is not allowed here")

    monkeypatch.setattr(arena.mmap, "mmap", Refusing)
    t = torch.arange(10, dtype=torch.float32)
    got = WeightArena(enabled=True).adopt(t)
    assert torch.equal(got, t) and got.data_ptr() != t.data_ptr()
