"""``kvgen bench perplexity``: kvgen's default path vs ``float32`` vs llama.cpp on the same token ids.

Text: ``file``, else :data:`DEFAULT_TEXT` (the GNU GPL v3, ~35 kB of English prose that
Debian's essential ``base-files`` package installs on every Debian system). It is
tokenized once by kvgen's tokenizer (no special tokens) and cut into non-overlapping
``context_length``-token windows (:func:`kvgen.perplexity.windows`), each scored alone
from position 0. kvgen scores them with :func:`kvgen.perplexity.perplexity` at its
default dtype and at ``float32``; llama-cpp-python (``logits_all=True``, one ``eval``
per window, own torch-free process) returns its logits' summed NLL, computed in float64
by ``llama_cpp_peer.window_nll``. Perplexity = exp(mean NLL in nats) over the same tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

from kvgen.bench.common import (
    Progress,
    default_dtype,
    environment_info,
    ratio,
    set_threads,
    timed,
)
from kvgen.bench.llama_cpp_peer import run_llama_cpp

SCHEMA = "kvgen.bench.perplexity/1"
DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")


def read_text(file: str | Path | None) -> tuple[Path, str]:
    """The text to score and its path: ``file``, or :data:`DEFAULT_TEXT`.

    Raises ``ValueError`` when it cannot be read as UTF-8 (naming the path).
    """
    path = Path(file) if file is not None else DEFAULT_TEXT
    try:
        return path, path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        hint = "" if file is not None else " (the default text; pass --file FILE)"
        raise ValueError(f"cannot read {path}{hint}: {e}") from None


def _kvgen_side(model: str, dtype: str, text: str, context_length: int, log: Progress) -> tuple[dict[str, Any], list[int]]:
    """Load kvgen at ``dtype``, tokenize ``text`` and score it; returns the report and the token ids."""
    from kvgen.loader import load_model
    from kvgen.perplexity import perplexity

    log(f"kvgen ({dtype}): loading {model}")
    (llm, tokenizer), load_s = timed(lambda: load_model(model, dtype=dtype))
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    log(f"kvgen ({dtype}): scoring {len(token_ids)} tokens in {context_length}-token windows")
    result, score_s = timed(lambda: perplexity(llm, token_ids, context_length))
    log(f"kvgen ({dtype}): perplexity {result.perplexity:.4f} in {score_s:.1f} s")
    return {"dtype": dtype, **dataclasses.asdict(result), "load_s": load_s, "score_s": score_s}, token_ids


def _llama_cpp_side(model: str, token_ids: list[int], context_length: int, num_threads: int, log: Progress) -> dict[str, Any]:
    from kvgen.loader import resolve_model_path
    from kvgen.perplexity import windows

    path = resolve_model_path(model)
    if path.is_dir():
        return {"skipped": "llama.cpp reads GGUF files; the model is a Hugging Face directory"}
    request = {"model_path": str(path), "num_threads": num_threads, "context_length": context_length,
               "windows": windows(token_ids, context_length)}
    side = run_llama_cpp("perplexity", request, log)
    if "total_nll" in side:
        side["mean_nll"] = side["total_nll"] / side["num_tokens_scored"]
        side["perplexity"] = math.exp(side["mean_nll"])
        log(f"llama.cpp: perplexity {side['perplexity']:.4f}")
    return side


def relative_differences(sides: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """``a_vs_b = ppl(a) / ppl(b) - 1`` for each ordered pair of sides that has a perplexity (0.01 = 1 % higher)."""
    names = [n for n, s in sides.items() if "perplexity" in s]
    out: dict[str, float | None] = {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            r = ratio(sides[a]["perplexity"], sides[b]["perplexity"])
            out[f"{a}_vs_{b}"] = r - 1 if r is not None else None
    return out


def run_perplexity_bench(
    file: str | Path | None = None,
    model: str = "default",
    dtype: str | None = None,
    context_length: int = 512,
    include_llama_cpp: bool = True,
    num_threads: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Perplexity of kvgen at ``dtype`` (default: ``load_model``'s), of kvgen at ``float32`` and of
    llama-cpp-python on the same token ids and windows (see module docstring).

    Returns a JSON-ready dict: ``env``, ``text`` (path, sha256, sizes), ``workload``, ``kvgen_default``,
    ``kvgen_float32``, ``llama_cpp`` (or ``{"skipped"|"error": ...}``) and ``relative_differences``.
    Raises ``ValueError`` for an unreadable text, ``context_length`` out of range or too few tokens.
    """
    log = Progress(progress, "[bench:perplexity]")
    threads = set_threads(num_threads)
    dtype = dtype or default_dtype()
    path, text = read_text(file)
    result: dict[str, Any] = {"schema": SCHEMA, "env": environment_info()}
    result["kvgen_default"], token_ids = _kvgen_side(model, dtype, text, context_length, log)
    if dtype == "float32":
        result["kvgen_float32"] = result["kvgen_default"]
    else:
        result["kvgen_float32"] = _kvgen_side(model, "float32", text, context_length, log)[0]
    if include_llama_cpp:
        result["llama_cpp"] = _llama_cpp_side(model, token_ids, context_length, threads, log)
    else:
        result["llama_cpp"] = {"skipped": "include_llama_cpp=False"}
    result["text"] = {"path": str(path), "sha256": hashlib.sha256(text.encode()).hexdigest(),
                      "num_chars": len(text), "num_tokens": len(token_ids), "is_default_text": file is None}
    result["workload"] = {"model": model, "default_dtype": dtype, "context_length": context_length, "num_threads": threads,
                          "windows": "non-overlapping, each scored alone from position 0; kvgen's tokenizer, no special tokens"}
    sides = {k.removeprefix("kvgen_"): result[k] for k in ("kvgen_default", "kvgen_float32", "llama_cpp")}
    result["relative_differences"] = relative_differences(sides)
    log("done")
    return result


def format_perplexity_report(result: dict[str, Any]) -> str:
    """A human summary of ``run_perplexity_bench``'s result."""
    t, w = result["text"], result["workload"]
    lines = [f"perplexity bench: {t['path']} ({t['num_tokens']} tokens), {w['model']}, {w['context_length']}-token windows"]
    for name in ("kvgen_default", "kvgen_float32", "llama_cpp"):
        side = result[name]
        label = f"{name} ({side['dtype']})" if "dtype" in side else name
        value = f"{side['perplexity']:.4f}" if "perplexity" in side else side.get("skipped") or side.get("error")
        lines.append(f"{label:28}{value}")
    lines += [f"{k}: {v:+.3%}" for k, v in result["relative_differences"].items() if v is not None]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvgen.bench.perplexity``: the bench (the CLI's ``kvgen bench perplexity``)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvgen.bench.perplexity", description=__doc__.split("\n")[0])
    parser.add_argument("--file", default=None, help=f"UTF-8 text (default: {DEFAULT_TEXT})")
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--context-length", type=int, default=512)
    parser.add_argument("--threads", "--num-threads", dest="num_threads", type=int, default=None)
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args(argv)
    result = run_perplexity_bench(a.file, a.model, a.dtype, a.context_length, not a.no_llama_cpp, a.num_threads)
    print(json.dumps(result, indent=2) if a.json else format_perplexity_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
