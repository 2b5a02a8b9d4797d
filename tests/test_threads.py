"""Thread defaults: one torch thread per physical core, unless --threads or $OMP_NUM_THREADS says otherwise."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvgen.threads import available_cpus, physical_cores, set_threads


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_physical_cores_lie_within_the_affinity_mask() -> None:
    assert 1 <= physical_cores() <= available_cpus()


def test_an_explicit_count_is_set_and_returned() -> None:
    assert set_threads(3) == 3 and torch.get_num_threads() == 3


def test_the_default_is_the_physical_cores_without_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(5)
    assert set_threads() == physical_cores() == torch.get_num_threads()


def test_omp_num_threads_is_kept_when_no_count_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)
    assert set_threads() == 3 and torch.get_num_threads() == 3


def test_a_count_outside_one_to_max_threads_is_refused() -> None:
    """0 threads, or so many that starting them exhausts the process (100,000 made the CLI fail with "can't start new
    thread"): a ValueError before torch is asked."""
    before = torch.get_num_threads()
    for count in (0, 513, 100_000):
        with pytest.raises(ValueError, match=rf"num_threads must be in \[1, 512\], got {count}"):
            set_threads(count)
    assert torch.get_num_threads() == before
