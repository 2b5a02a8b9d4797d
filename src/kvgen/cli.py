"""The ``kvgen`` command line: generate | chat | tokenize | perplexity | info | serve | bench.

Every user error (bad flag, missing or corrupt model, invalid setting, prompt
too long) is one line on stderr and exit code 2, never a traceback.
``kvgen generate`` flags are generated from :class:`GenerationConfig` fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from kvgen.errors import KvgenError

# Fields with a hand-written flag (or none) in `kvgen generate`.
_CUSTOM_GENERATE_FIELDS = {"use_cache", "cache_implementation", "return_dict_in_generate", "stop_strings"}
_CLI_DEFAULTS = {"max_new_tokens": 64}
_CHAT_DEFAULTS = {"max_new_tokens": 256}
DEFAULT_PROMPT = "The three most useful things to know about the KV cache are"


class CliError(Exception):
    """A user error found by the CLI itself (exit code 2)."""


class _Parser(argparse.ArgumentParser):
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


def _flag_kwargs(name: str, annotation: str) -> dict[str, Any]:
    """argparse keyword arguments for a GenerationConfig field, from its type annotation."""
    from kvgen.sampling.params import PARAM_RULES

    if name == "early_stopping":
        return {"type": _early_stopping}
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
    return {"type": _json_value, "metavar": "JSON"}


def add_generation_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per GenerationConfig field (``--max-new-tokens``, ``--num-beams``, ...), help from the field."""
    from kvgen.generation.config import GenerationConfig

    group = parser.add_argument_group("generation (GenerationConfig fields)")
    for f in dataclasses.fields(GenerationConfig):
        if f.name in _CUSTOM_GENERATE_FIELDS:
            continue
        kwargs = {"dest": f.name, "default": None, "help": f.metadata.get("help", "")}
        kwargs.update(_flag_kwargs(f.name, str(f.type)))
        group.add_argument("--" + f.name.replace("_", "-"), **kwargs)
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


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The GenerationConfig fields the user's flags set: ``generate(..., **flag_values(args))`` lets them win over
    the model's generation config (as transformers' keyword arguments do), even where they equal a default."""
    from kvgen.generation.config import GenerationConfig

    values = {f.name: v for f in dataclasses.fields(GenerationConfig) if (v := getattr(args, f.name, None)) is not None}
    temperature = values.get("temperature")
    if temperature is not None and values.get("do_sample") is None:
        values["do_sample"] = temperature > 0
        if temperature == 0:
            values.pop("temperature")
    if isinstance(values.get("sequence_bias"), list):
        values["sequence_bias"] = {tuple(ids): float(b) for ids, b in values["sequence_bias"]}
    return values


def _add_model_flags(p: argparse.ArgumentParser, dtype: bool = True, threads: bool = True, model: bool = True) -> None:
    if model:
        p.add_argument("--model", default="default", help="a .gguf file, a Hugging Face directory or 'default' (SmolLM2-135M-Instruct)")
    if threads:
        p.add_argument("--threads", type=int, default=None, help="CPU threads (default: $OMP_NUM_THREADS, else the physical cores)")
    if dtype:
        p.add_argument(
            "--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
            help="auto: a quantized GGUF runs from its blocks through kvgen's CPU kernels; "
            "float32: the exact dequantized reference path",
        )


def _add_chat_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--assistant-model", default=None,
                   help="assisted decoding: a smaller model with the same vocabulary (a .gguf file or an HF directory) "
                   "drafts tokens that --model verifies")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_JINJA",
                   help="a Jinja chat template, or a file holding one, replacing the model's")


def _chat_template(args: argparse.Namespace) -> str | None:
    """``--chat-template``'s text, compiled to refuse a bad one before the model loads (``ValueError``)."""
    from kvgen.chat_template import compile_chat_template, read_chat_template

    if args.chat_template is None:
        return None
    compile_chat_template(text := read_chat_template(args.chat_template))
    return text


def _load_for_chat(args: argparse.Namespace) -> tuple[Any, Any, float]:
    """``_load`` with ``--chat-template`` checked first and put in the tokenizer."""
    template = _chat_template(args)
    model, tokenizer, load_s = _load(args)
    if template is not None:
        tokenizer.chat_template = template
    return model, tokenizer, load_s


def _load_assistant(args: argparse.Namespace) -> Any:
    """The ``--assistant-model`` (loaded as --model's dtype says), or None."""
    if args.assistant_model is None:
        return None
    from kvgen.loader import load_model

    return load_model(args.assistant_model, dtype=args.dtype)[0]


def build_parser() -> argparse.ArgumentParser:
    """The full ``kvgen`` argument parser."""
    parser = _Parser(prog="kvgen", description="kvgen: LLM inference with our own KV cache, decoding and engine.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    g.add_argument("prompt", nargs="?", default=None, help=f"the prompt text (default: {DEFAULT_PROMPT!r})")
    g.add_argument("-p", "--prompt", dest="prompt_option", default=None, metavar="TEXT",
                   help="the prompt text, as llama.cpp's -p (instead of the positional PROMPT)")
    g.add_argument("-f", "--file", dest="prompt_file", default=None, metavar="FILE",
                   help="read the prompt from FILE ('-': standard input), as llama.cpp's -f")
    _add_model_flags(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user message")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--trace", action="store_true", help="print per-step shapes and latency; plot latency with/without cache")
    g.add_argument("--trace-plot", default="kvgen-trace.png", help="where --trace saves its PNG")
    _add_chat_flags(g)
    add_generation_flags(g)

    c = sub.add_parser("chat", help="interactive multi-turn chat (/exit or end of input leaves)")
    _add_model_flags(c)
    c.add_argument("--system", default=None, help="optional system message")
    _add_chat_flags(c)
    add_generation_flags(c)  # --max-new-tokens defaults to 256 per reply here

    t = sub.add_parser("tokenize", help="print the token ids of TEXT as a JSON list")
    t.add_argument("text")
    _add_model_flags(t, dtype=False)

    pp = sub.add_parser("perplexity", help="perplexity of the model on a text file")
    pp.add_argument("file")
    _add_model_flags(pp)
    pp.add_argument("--context-length", type=int, default=512, help="tokens per non-overlapping window")

    i = sub.add_parser("info", help="architecture, sizes, quantization and tokenizer facts")
    _add_model_flags(i, dtype=False)
    i.add_argument("--json", action="store_true")

    _add_serve_parser(sub)

    _add_bench_parser(sub)
    return parser


# kvgen bench SUBCOMMAND -> (module of kvgen.bench, its config class, help); the module has run_X_bench and SIDES
_BENCHES = {
    "decode": ("decode", "DecodeBenchConfig", "prefill, batch-1 decode and time to first token vs transformers and llama.cpp"),
    "strategies": ("strategies", "StrategiesBenchConfig", "tokens/s of every decoding strategy vs transformers"),
    "throughput": ("throughput", "ThroughputBenchConfig", "continuous-batching engine throughput vs static batching, transformers, llama.cpp"),
    "perplexity": ("perplexity", "PerplexityBenchConfig", "perplexity of kvgen (default dtype and float32) and llama.cpp on the same tokens"),
    "serve": ("serve", "ServeBenchConfig", "kvgen serve vs llama-cpp-python's OpenAI server at several concurrencies"),
}


def _add_bench_parser(sub: Any) -> None:
    """``kvgen bench SUBCOMMAND``: flags generated from each bench's config dataclass (kvgen.bench)."""
    import importlib

    from kvgen.fields import add_config_flags

    b = sub.add_parser("bench", help="benchmarks (JSON out)")
    bsub = b.add_subparsers(dest="bench_command", required=True, parser_class=_Parser)
    for name, (module, config_cls, help_text) in _BENCHES.items():
        p = bsub.add_parser(name, help=help_text)
        add_config_flags(p, getattr(importlib.import_module(f"kvgen.bench.{module}"), config_cls))
        p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")


def _add_serve_parser(sub: Any) -> None:
    """``kvgen serve``: the OpenAI-compatible HTTP server and chat page (kvgen.server); flags generated from
    ``EngineArgs`` and ``ServerArgs`` (vLLM's names)."""
    from kvgen.engine.engine_args import EngineArgs
    from kvgen.fields import add_config_flags
    from kvgen.server.launch import ServerArgs

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with a chat page at /")
    _add_model_flags(s, dtype=False, model=False)
    add_config_flags(s.add_argument_group("engine (EngineArgs)"), EngineArgs)
    add_config_flags(s.add_argument_group("server (ServerArgs)"), ServerArgs)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvgen.engine.engine_args import EngineArgs
    from kvgen.fields import config_from_args
    from kvgen.server.launch import ServerArgs, run_server

    server_args = config_from_args(ServerArgs, args, api_key=args.api_key or os.environ.get("KVGEN_API_KEY"))
    return run_server(config_from_args(EngineArgs, args), server_args)


def _load(args: argparse.Namespace) -> tuple[Any, Any, float]:
    from kvgen.loader import load_model

    start = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=getattr(args, "dtype", "auto"))
    return model, tokenizer, time.perf_counter() - start


def _prompt_text(args: argparse.Namespace) -> str:
    """The prompt of ``kvgen generate``: the positional PROMPT, ``-p/--prompt`` or ``-f/--file`` (one of them), else
    the default. Raises ``CliError`` for two of them or an unreadable file."""
    given = [p for p in (args.prompt, args.prompt_option, args.prompt_file) if p is not None]
    if len(given) > 1:
        raise CliError("kvgen generate: give the prompt once, as PROMPT, -p/--prompt or -f/--file")
    if args.prompt_file is None:
        return given[0] if given else DEFAULT_PROMPT
    try:
        return sys.stdin.read() if args.prompt_file == "-" else Path(args.prompt_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"kvgen generate: cannot read the prompt file {args.prompt_file}: {e}") from None


def _prompt_ids(text: str, is_chat: bool, tokenizer: Any) -> list[int]:
    if is_chat:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return tokenizer.encode(text)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from kvgen.generation import generate
    from kvgen.generation.generate import NOT_STREAMABLE
    from kvgen.generation.streamers import TextStreamer

    cfg, text = generation_config_from_args(args), _prompt_text(args)
    model, tokenizer, load_s = _load_for_chat(args)
    prompt_ids = _prompt_ids(text, args.chat, tokenizer)
    if not prompt_ids:
        raise CliError("the prompt is empty after tokenization")
    input_ids = torch.tensor([prompt_ids])
    assistant = _load_assistant(args)
    # the model's generation config fills what the flags leave unset, as in transformers' generate(); the flags
    # also go to generate() as keyword arguments, which win over it there too
    flags = flag_values(args)
    cfg = cfg.with_generation_defaults(model.generation_defaults).replace(**flags)
    single = cfg.num_return_sequences == 1
    # beams and sample-and-rank pick their sequence at the end: printed then
    streams = not (args.json or args.trace or not single or cfg.strategy in NOT_STREAMABLE)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if streams else None
    if args.trace:
        out = _traced_generate(model, input_ids, cfg, tokenizer, args.trace_plot, flags)
    else:
        out = generate(model, input_ids, None, cfg, tokenizer=tokenizer, streamer=streamer, assistant_model=assistant,
                       **flags)
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in out.new_token_ids]
    if args.json:
        print(json.dumps(_json_report(prompt_ids, out, texts, load_s), ensure_ascii=False))
    elif streamer is None:
        for k, text in enumerate(texts):
            print(text if single else f"--- sequence {k} ---\n{text}")
    return 0


def _json_report(prompt_ids: list[int], out: Any, texts: list[str], load_s: float) -> dict[str, Any]:
    decoded = len(out.new_token_ids[0]) - 1  # the first new token comes from the prefill
    decode_s = out.timings.decode_s
    report: dict[str, Any] = {
        "prompt_token_ids": prompt_ids,
        "token_ids": out.new_token_ids[0],
        "text": texts[0],
        "finish_reason": out.finish_reasons[0],
        "timings": {
            "load_s": round(load_s, 4),
            "prefill_s": round(out.timings.prefill_s, 4),
            "decode_s": round(decode_s, 4),
            "decode_tokens_per_s": round(decoded / decode_s, 2) if decode_s > 0 else None,
            "num_decode_steps": out.timings.num_decode_steps,  # model forwards after the prefill
        },
    }
    if len(texts) > 1:
        scores = out.sequences_scores.tolist() if out.sequences_scores is not None else [None] * len(texts)
        report["sequences"] = [
            {"token_ids": ids, "text": text, "finish_reason": reason, "score": score}
            for ids, text, reason, score in zip(out.new_token_ids, texts, out.finish_reasons, scores)
        ]
    return report


def _traced_generate(model: Any, input_ids: Any, cfg: Any, tokenizer: Any, plot_path: str, flags: dict[str, Any]
                     ) -> Any:
    from kvgen.generation import generate
    from kvgen.trace import Tracer, format_step, plot_latencies

    with Tracer(model) as cached:
        out = generate(model, input_ids, None, cfg, tokenizer=tokenizer, **flags)
    for i, step in enumerate(cached.steps):
        print(format_step(i, step), file=sys.stderr)
    print("[trace] now the same generation without a KV cache (every step recomputes the sequence):", file=sys.stderr)
    with Tracer(model) as uncached:
        generate(model, input_ids, None, cfg.replace(use_cache=False), tokenizer=tokenizer, **flags)
    for i, step in enumerate(uncached.steps):
        print(format_step(i, step), file=sys.stderr)
    plot_latencies([s.latency_s for s in cached.steps], [s.latency_s for s in uncached.steps], plot_path)
    print(f"[trace] latency plot saved to {plot_path}", file=sys.stderr)
    return out


def cmd_chat(args: argparse.Namespace) -> int:
    from kvgen.cli_chat import run_chat

    return run_chat(args)


def cmd_tokenize(args: argparse.Namespace) -> int:
    from kvgen.loader import resolve_model_path
    from kvgen.tokenizer import Tokenizer

    path = resolve_model_path(args.model)
    if path.is_dir():
        tokenizer = Tokenizer.from_pretrained(path)
    else:
        from kvgen.weights.gguf_file import gguf_metadata, open_gguf

        tokenizer = Tokenizer.from_gguf(gguf_metadata(open_gguf(path)))
    print(json.dumps(tokenizer.encode(args.text)))
    return 0


def cmd_perplexity(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvgen.perplexity import perplexity

    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"cannot read {args.file}: {e.strerror if isinstance(e, OSError) else e}") from None
    model, tokenizer, _ = _load(args)
    ids = tokenizer.encode(text, add_special_tokens=False)
    progress = lambda chunks: tqdm(chunks, desc="perplexity", unit="window", file=sys.stderr)
    result = perplexity(model, ids, args.context_length, progress=progress)
    print(json.dumps(dataclasses.asdict(result)))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from kvgen.info import describe_model, format_info

    info = describe_model(args.model)
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    from kvgen.bench.harness import render, to_json
    from kvgen.fields import config_from_args

    module_name, config_cls, _ = _BENCHES[args.bench_command]
    module = importlib.import_module(f"kvgen.bench.{module_name}")
    config = config_from_args(getattr(module, config_cls), args)
    result = to_json(getattr(module, f"run_{module_name}_bench")(config))
    print(json.dumps(result, indent=2) if args.json else render(result, module.SIDES))
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "generate": cmd_generate,
    "chat": cmd_chat,
    "tokenize": cmd_tokenize,
    "perplexity": cmd_perplexity,
    "info": cmd_info,
    "serve": cmd_serve,
    "bench": cmd_bench,
}


def _set_threads(threads: int | None) -> None:
    """--threads N, else $OMP_NUM_THREADS when set, else the physical cores (``kvgen.threads.set_threads``)."""
    if threads is not None and threads < 1:
        raise CliError(f"--threads must be >= 1, got {threads}")
    from kvgen.threads import set_threads

    set_threads(threads)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvgen`` script; returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
        if "threads" in vars(args):
            _set_threads(args.threads)
        return COMMANDS[args.command](args)
    except (CliError, KvgenError, ValueError, NotImplementedError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(msg if msg.startswith("kvgen") else f"kvgen: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvgen: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # an internal error: one line unless KVGEN_DEBUG is set
        if os.environ.get("KVGEN_DEBUG"):
            raise
        print(f"kvgen: internal error: {type(e).__name__}: {e} (set KVGEN_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
