"""Config field helpers: one int check, minimums from field metadata, flags generated from a dataclass and
errors that name the flag a CLI user typed."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvgen.fields import (
    add_config_flags,
    check_int,
    check_minimums,
    config_field,
    config_from_args,
    human_readable_int,
)


@dataclasses.dataclass
class _Config:
    num_threads: int | None = config_field(None, "threads", flags=("--threads", "--num-threads"), minimum=1)
    new_tokens: int = config_field(8, "tokens", minimum=2)
    sizes: tuple[int, ...] = config_field((1, 4), "sizes", minimum=1)
    seed: int = config_field(0, "seed", cli=False, minimum=0)

    def __post_init__(self) -> None:
        check_minimums(self)


@pytest.mark.parametrize("value", [0, -3, 1.5, True, "2", None])
def test_check_int_refuses_non_ints_and_values_below_the_minimum(value: object) -> None:
    with pytest.raises(ValueError, match=rf"^n must be an int >= 1, got {value!r}$"):
        check_int("n", value, 1)
    check_int("n", 1, 1)
    with pytest.raises(ValueError, match=r"^n must be an int in \[0, 3\], got 4$"):
        check_int("n", 4, 0, 3)


def test_check_minimums_reads_metadata_skips_none_and_checks_each_item() -> None:
    assert _Config().num_threads is None  # None means "the default", not a value below the minimum
    with pytest.raises(ValueError, match="^new_tokens must be an int >= 2, got 1$"):
        _Config(new_tokens=1)
    with pytest.raises(ValueError, match="^sizes must be an int >= 1, got 0$"):
        _Config(sizes=(2, 0))
    with pytest.raises(ValueError, match="^seed must be an int >= 0, got -1$"):
        _Config(seed=-1)


def test_config_from_args_names_the_flag_of_a_refused_value() -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, _Config)
    assert config_from_args(_Config, parser.parse_args(["--num-threads", "2", "--sizes", "3", "5"])) == _Config(2, 8, [3, 5])
    for argv, message in ((["--threads", "0"], "--threads must be an int >= 1, got 0"),
                          (["--new-tokens", "1"], "--new-tokens must be an int >= 2, got 1"),
                          (["--sizes", "2", "0"], "--sizes must be an int >= 1, got 0")):
        with pytest.raises(ValueError, match=f"^{message}$"):
            config_from_args(_Config, parser.parse_args(argv))
    with pytest.raises(ValueError, match="^seed must be"):  # no flag (cli=False): the field's name stays
        config_from_args(_Config, parser.parse_args([]), seed=-1)


def test_human_readable_int_reads_vllm_suffixes() -> None:
    """vLLM's human_readable_int (its docstring's examples: 1k = 1,000, 1K = 1,024, 25.6k = 25,600; no decimals with
    a binary suffix); ``--max-model-len 32k`` was "invalid int value"."""
    assert [human_readable_int(t) for t in ("4096", "1k", "1K", "25.6k", " 2M ", "1g")] == [4096, 1000, 1024, 25_600,
                                                                                           2 * 2**20, 10**9]
    for text in ("1.5K", "k", "12x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="invalid int value"):
            human_readable_int(text)


def test_enable_flags_take_both_forms() -> None:
    """A bool ``enable_x`` defaulting to True is ``--enable-x`` / ``--no-enable-x`` (vLLM's BooleanOptionalAction);
    ``--enable-prefix-caching`` was an unrecognized argument."""

    @dataclasses.dataclass
    class _Switches:
        enable_thing: bool = config_field(True, "use the thing")

    parser = argparse.ArgumentParser()
    add_config_flags(parser, _Switches)
    assert [parser.parse_args(argv).enable_thing for argv in ([], ["--enable-thing"], ["--no-enable-thing"])] == [
        True, True, False]
