"""The flags of ``kvgen``'s subcommands: argparse with one-line errors, one flag per ``GenerationConfig`` field checked
by the shared rule table, the model flags, and the flags generated from the serve and bench config dataclasses."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from typing import Any, NoReturn

# Fields with a hand-written flag (or none) in `kvgen generate`.
_CUSTOM_GENERATE_FIELDS = {"use_cache", "cache_implementation", "return_dict_in_generate", "stop_strings", "constraints",
                           "low_memory", "output_hidden_states", "output_attentions", "disable_compile"}
# llama.cpp's names of the same settings (llama-cli -n, --temp, --repeat-penalty, -s) and vLLM's / OpenAI's
# max_tokens, accepted as well
_ALIASES = {"max_new_tokens": ("-n", "--n-predict", "--max-tokens"), "temperature": ("--temp",),
            "repetition_penalty": ("--repeat-penalty",), "seed": ("-s",)}
_HELP_SUFFIX = {"seed": " (-1: a random seed each run, as llama-cli's -s -1)"}
_CLI_DEFAULTS = {"max_new_tokens": 64}
CHAT_DEFAULTS = {"max_new_tokens": 256}
DEFAULT_PROMPT = "The three most useful things to know about the KV cache are"


class CliError(Exception):
    """A user error found by the CLI itself (exit code 2)."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors, and without prefix matching: ``--prompt`` must not silently mean
    ``--prompt-lookup-num-tokens``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse prints usage too)
        raise CliError(f"{self.prog}: {message}")


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {text!r} ({e.msg})") from None


def _early_stopping(text: str) -> bool | str:
    low = text.lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    if low == "never":
        return "never"
    raise argparse.ArgumentTypeError(f"must be true, false or never, got {text!r}")


def _dola_layers(text: str) -> str | list[int]:
    """``--dola-layers``: low, high or a JSON list of layer indices."""
    from kvgen.generation.config import check_dola_layers

    value = text if text in ("low", "high") else json.loads(text) if text.lstrip().startswith("[") else text
    try:
        check_dola_layers(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _checked(name: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` that parses, then checks the value against the shared rule table
    (``kvgen.sampling.params.PARAM_RULES``), so a bad value is refused while parsing."""
    from kvgen.sampling.params import check_param

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            kind = "an int" if parse is int else "a number"
            raise argparse.ArgumentTypeError(f"{name} must be {kind}, got {text!r}") from None
        try:
            check_param(name, value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    convert.__name__ = parse.__name__  # argparse names the type in its own messages
    return convert


def _seed(text: str) -> int | None:
    """``--seed`` / ``-s``: an int (checked as ``seed``); -1 is no seed, a random one each run, as llama-cli's
    ``-s -1`` (its LLAMA_DEFAULT_SEED) -- a fixed seed of -1 gave every run the same tokens."""
    value = _checked("seed", int)(text)
    return None if value == -1 else value


def _flag_kwargs(name: str, annotation: str) -> dict[str, Any]:
    """argparse keyword arguments for a GenerationConfig field, from its type annotation."""
    from kvgen.sampling.params import PARAM_RULES

    if name == "early_stopping":
        return {"type": _early_stopping}
    if name == "dola_layers":
        return {"type": _dola_layers, "metavar": "low|high|JSON"}
    if name == "seed":
        return {"type": _seed}
    if name in PARAM_RULES:
        return {"type": _checked(name, PARAM_RULES[name].kind)}
    if annotation == "bool":
        return {"action": "store_true", "default": None}
    if annotation.startswith(("int | list[int]", "list[int]")):
        return {"type": int, "nargs": "+"}
    if annotation.startswith("int"):
        return {"type": int}
    if annotation.startswith("float"):
        return {"type": float}
    if annotation == "str":  # a name (--num-assistant-tokens-schedule constant), not a JSON string
        return {"type": str}
    return {"type": _json_value, "metavar": "JSON"}


def add_generation_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per GenerationConfig field (``--max-new-tokens``, ``--num-beams``, ...), help from the field; also
    llama.cpp's names of four of them (``-n``, ``--temp``, ``--repeat-penalty``, ``-s``)."""
    from kvgen.generation.config import GenerationConfig

    group = parser.add_argument_group("generation (GenerationConfig fields)")
    for f in dataclasses.fields(GenerationConfig):
        if f.name in _CUSTOM_GENERATE_FIELDS:
            continue
        kwargs = {"dest": f.name, "default": None, "help": f.metadata.get("help", "") + _HELP_SUFFIX.get(f.name, "")}
        kwargs.update(_flag_kwargs(f.name, str(f.type)))
        group.add_argument("--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, ()), **kwargs)
    group.add_argument("--stop", dest="stop_strings", action="append", default=None, help="stop string (repeatable)")
    cache = group.add_mutually_exclusive_group()
    cache.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step (slow path)")
    cache.add_argument("--cache", choices=["dynamic", "static"], default=None, help="KV cache implementation (default: static)")


def generation_config_from_args(args: argparse.Namespace, defaults: dict[str, Any] | None = None) -> Any:
    """A validated GenerationConfig from parsed flags; ``--temperature 0`` means greedy.

    ``defaults`` (default: ``kvgen generate``'s) fill fields no flag set.
    Raises ``ValueError`` naming the field for a bad value or a contradictory pair.
    """
    from kvgen.generation.config import GenerationConfig

    flags = flag_values(args)
    values = {**(_CLI_DEFAULTS if defaults is None else defaults), **flags}
    if "max_length" in flags and "max_new_tokens" not in flags:  # --max-length alone decides the length
        del values["max_new_tokens"]
    values["use_cache"] = not args.no_cache
    values["cache_implementation"] = args.cache or "static"
    return GenerationConfig(**values)


def with_model_defaults(cfg: Any, model_defaults: dict[str, Any], flags: dict[str, Any]) -> Any:
    """``cfg`` (the CLI's GenerationConfig) with the model's generation config filling what it left at transformers'
    defaults, then the user's ``flags`` over both (as transformers' keyword arguments). The file's
    ``max_new_tokens`` replaces the CLI's own default length (as the server takes it for ``max_tokens``); its
    ``max_length`` does not (a file's 2048 would make every run that long). A ``--max-length`` flag meets the file's
    ``max_new_tokens`` as a ``generate(max_length=...)`` keyword does in transformers: the file's wins. Raises
    ``ValueError`` as GenerationConfig does."""
    cfg = cfg.with_generation_defaults(model_defaults)
    if "max_new_tokens" in model_defaults and "max_new_tokens" not in flags:
        cfg = cfg.replace(max_new_tokens=model_defaults["max_new_tokens"])
    return cfg.replace(**flags)


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The GenerationConfig fields the user's flags set: ``generate(..., **flag_values(args))`` lets them win over
    the model's generation config (as transformers' keyword arguments do), even where they equal a default.
    ``--sequence-bias`` JSON (a list of ``[ids, bias]`` pairs) becomes a dict; ``ValueError`` naming it when malformed,
    and for a ``--stop`` that is not UTF-8 text."""
    from kvgen.generation.config import GenerationConfig
    from kvgen.sampling.ops import normalize_sequence_bias
    from kvgen.tokenizer.tokenizer import lone_surrogate

    values = {f.name: v for f in dataclasses.fields(GenerationConfig) if (v := getattr(args, f.name, None)) is not None}
    for stop in values.get("stop_strings") or ():  # undecodable argv bytes (surrogateescape): the text never holds them
        if lone_surrogate(stop) is not None:
            raise ValueError(f"--stop is not valid UTF-8 text, got {stop!r}")
    temperature = values.get("temperature")
    if temperature is not None and values.get("do_sample") is None:
        values["do_sample"] = temperature > 0
        if temperature == 0:
            values.pop("temperature")
    if isinstance(values.get("sequence_bias"), list):  # checked here: a malformed pair crashed the conversion
        values["sequence_bias"] = normalize_sequence_bias(values["sequence_bias"])
    return values


# kvgen.weights.quantized.QUANTIZATIONS (named here so that the CLI parses without importing torch)
QUANTIZATION_CHOICES = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0")


def _add_model_flags(p: argparse.ArgumentParser, dtype: bool = True, threads: bool = True, model: bool = True) -> None:
    if model:
        p.add_argument("-m", "--model", default="default", help="a .gguf file, a Hugging Face directory, a repo id in the local Hugging Face cache or 'default' (SmolLM2-135M-Instruct)")
    if threads:
        p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: $OMP_NUM_THREADS, else the physical cores)")
    if dtype:
        p.add_argument(
            "--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
            help="auto: a quantized GGUF runs from its blocks through kvgen's CPU kernels; "
            "float32: the exact dequantized reference path",
        )
        p.add_argument(
            "--quantization", default=None, type=str.lower, choices=QUANTIZATION_CHOICES,
            help="encode the model's float matrices at load in this llama.cpp type (--dtype auto): a Hugging Face "
            "checkpoint or a float GGUF then runs through the quantized kernels",
        )


def _add_chat_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--assistant-model", default=None,
                   help="assisted decoding: a smaller model with the same vocabulary (a .gguf file or an HF directory) "
                   "drafts tokens that --model verifies")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_JINJA",
                   help="a Jinja chat template, or a file holding one, replacing the model's")


def add_generate_flags(g: argparse.ArgumentParser) -> None:
    g.add_argument("prompt", nargs="?", default=None, help=f"the prompt text (default: {DEFAULT_PROMPT!r})")
    g.add_argument("-p", "--prompt", dest="prompt_option", default=None, metavar="TEXT",
                   help="the prompt text, as llama.cpp's -p (instead of the positional PROMPT)")
    g.add_argument("-f", "--file", dest="prompt_file", default=None, metavar="FILE",
                   help="read the prompt from FILE ('-': standard input), as llama.cpp's -f")
    _add_model_flags(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user message")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--trace", action="store_true", help="print per-step shapes and latency; plot latency with/without cache")
    g.add_argument("--trace-plot", default=None, help="where --trace saves its PNG (default: kvgen-trace.png)")
    g.add_argument("--negative-prompt", default=None, metavar="TEXT",
                   help="classifier-free guidance: the prompt to steer away from (with --guidance-scale)")
    g.add_argument("--force-word", action="append", default=None, metavar="TEXT",
                   help="constrained beam search: text the output must contain (repeatable; with --num-beams > 1)")
    _add_chat_flags(g)
    add_generation_flags(g)


def add_chat_command_flags(c: argparse.ArgumentParser) -> None:
    _add_model_flags(c)
    c.add_argument("--system", default=None, help="optional system message")
    c.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto",
                   help="the conversation's KV cache: auto (the model's: float16 on the kernels) or int8 (int8 values "
                   "and a scale per token and KV head: about half the memory; a model on the kernels)")
    _add_chat_flags(c)
    add_generation_flags(c)  # --max-new-tokens defaults to 256 per reply here


def add_tokenize_flags(t: argparse.ArgumentParser) -> None:
    t.add_argument("text")
    _add_model_flags(t, dtype=False)


def add_embed_flags(e: argparse.ArgumentParser) -> None:
    e.add_argument("text", nargs="+", help="one embedding per TEXT")
    _add_model_flags(e)
    e.add_argument("--pooling-type", choices=["last", "mean", "cls"], default=None,
                   help="pool the hidden states by the last token, their mean or the first token (default: the model's)")
    e.add_argument("--dimensions", type=int, default=None, help="keep the first N values (Matryoshka embeddings)")
    e.add_argument("--no-normalize", dest="normalize", action="store_false", help="leave the L2 norm as it is")


def add_perplexity_flags(pp: argparse.ArgumentParser) -> None:
    pp.add_argument("file")
    _add_model_flags(pp)
    pp.add_argument("--context-length", type=int, default=512, help="tokens per non-overlapping window")


def add_info_flags(i: argparse.ArgumentParser) -> None:
    _add_model_flags(i, dtype=False)
    i.add_argument("--json", action="store_true")


# kvgen bench SUBCOMMAND -> (module of kvgen.bench, its config class, help); the module has run_X_bench and SIDES
BENCHES = {
    "decode": ("decode", "DecodeBenchConfig", "prefill, batch-1 decode and time to first token vs transformers and llama.cpp"),
    "strategies": ("strategies", "StrategiesBenchConfig", "tokens/s of every decoding strategy vs transformers"),
    "throughput": ("throughput", "ThroughputBenchConfig", "continuous-batching engine throughput vs static batching, transformers, llama.cpp"),
    "perplexity": ("perplexity", "PerplexityBenchConfig", "perplexity of kvgen (default dtype and float32) and llama.cpp on the same tokens"),
    "serve": ("serve", "ServeBenchConfig", "kvgen serve vs llama-cpp-python's OpenAI server at several concurrencies"),
}


def add_bench_flags(b: argparse.ArgumentParser) -> None:
    """``kvgen bench SUBCOMMAND``: flags generated from each bench's config dataclass (kvgen.bench)."""
    import importlib

    from kvgen.fields import add_config_flags

    bsub = b.add_subparsers(dest="bench_command", required=True, parser_class=Parser)
    for name, (module, config_cls, help_text) in BENCHES.items():
        p = bsub.add_parser(name, help=help_text)
        add_config_flags(p, getattr(importlib.import_module(f"kvgen.bench.{module}"), config_cls))
        p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")


def add_serve_flags(s: argparse.ArgumentParser) -> None:
    """``kvgen serve``: the OpenAI-compatible HTTP server and chat page (kvgen.server); flags generated from
    ``EngineArgs`` and ``ServerArgs`` (vLLM's names)."""
    from kvgen.engine.engine_args import EngineArgs
    from kvgen.fields import add_config_flags
    from kvgen.server.launch import ServerArgs

    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as vLLM's `vllm serve MODEL` (instead of --model)")
    _add_model_flags(s, dtype=False, model=False)
    add_config_flags(s.add_argument_group("engine (EngineArgs)"), EngineArgs)
    add_config_flags(s.add_argument_group("server (ServerArgs)"), ServerArgs)
