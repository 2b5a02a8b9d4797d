"""The ``kvgen`` command line: generate | chat | tokenize | embed | perplexity | info | serve | bench.

Every user error (bad flag, missing or corrupt model, invalid setting, prompt
too long) is one line on stderr and exit code 2, never a traceback.
The flags live in :mod:`kvgen.cli_flags` (``kvgen generate``'s from :class:`GenerationConfig` fields); a run builds
only its own subcommand's, so ``kvgen --help`` does not import torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import gc
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from kvgen.cli_flags import (
    BENCHES,
    DEFAULT_PROMPT,
    CliError,
    Parser,
    add_bench_flags,
    add_chat_command_flags,
    add_embed_flags,
    add_generate_flags,
    add_info_flags,
    add_perplexity_flags,
    add_serve_flags,
    add_tokenize_flags,
    flag_values,
    generation_config_from_args,
    with_model_defaults,
)
from kvgen.errors import KvgenError


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
    """The ``--assistant-model`` (loaded as --model's dtype and quantization say), or None."""
    if args.assistant_model is None:
        return None
    from kvgen.loader import load_model

    return load_model(args.assistant_model, dtype=args.dtype, quantization=args.quantization)[0]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``kvgen`` argument parser. With ``command`` (a subcommand name, or "" for none) only that subcommand gets
    its flags, the others their name and help: the flags of generate, chat, serve and bench come from config
    dataclasses whose modules import torch, so ``kvgen --help`` or a mistyped subcommand answers in 0.1 s instead of
    2.6 s. None: every subcommand's flags."""
    parser = Parser(prog="kvgen", description="kvgen: LLM inference with our own KV cache, decoding and engine.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, (help_text, add_flags, _) in _SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if command is None or command == name:
            add_flags(p)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    from kvgen.engine.engine_args import EngineArgs
    from kvgen.fields import config_from_args
    from kvgen.server.launch import ServerArgs, run_server

    if args.model_tag is not None:  # `kvgen serve MODEL`, as `vllm serve MODEL`
        if args.model not in ("default", args.model_tag):
            raise CliError(f"kvgen serve: the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    # an empty --api-key is refused (ServerArgs); an empty $KVGEN_API_KEY counts as unset
    api_key = args.api_key if args.api_key is not None else os.environ.get("KVGEN_API_KEY") or None
    server_args = config_from_args(ServerArgs, args, api_key=api_key)
    return run_server(config_from_args(EngineArgs, args), server_args)


def _load(args: argparse.Namespace) -> tuple[Any, Any, float]:
    from kvgen.loader import load_model

    start = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=getattr(args, "dtype", "auto"),
                                  quantization=getattr(args, "quantization", None))
    load_s = time.perf_counter() - start
    _end_startup()
    return model, tokenizer, load_s


def _end_startup() -> None:
    """Where a command's start-up ends (its imports and model load) in a process of its own (:func:`run` turned the
    garbage collector off): freeze what is alive (``heap.freeze_startup_objects``) and turn collection back on. Called
    in-process (tests, a library caller), it leaves the collector alone."""
    if not gc.isenabled():
        from kvgen.heap import freeze_startup_objects

        freeze_startup_objects()


def _prompt_text(args: argparse.Namespace) -> str:
    """The prompt of ``kvgen generate``: the positional PROMPT, ``-p/--prompt`` or ``-f/--file`` (one of them), else
    the default. Raises ``CliError`` for two of them, an unreadable file or a closed standard input."""
    given = [p for p in (args.prompt, args.prompt_option, args.prompt_file) if p is not None]
    if len(given) > 1:
        raise CliError("kvgen generate: give the prompt once, as PROMPT, -p/--prompt or -f/--file")
    if args.prompt_file is None:
        return given[0] if given else DEFAULT_PROMPT
    if not args.prompt_file:  # Path("") is the working directory: "Is a directory: '.'"
        raise CliError("kvgen generate: -f/--file must not be empty (a file name, or '-' for standard input)")
    if args.prompt_file == "-" and sys.stdin is None:  # started with its standard input closed (`<&-`)
        raise CliError("kvgen generate: -f -: standard input is closed, there is no prompt to read")
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

    cfg, text, plot_path = generation_config_from_args(args), _prompt_text(args), _trace_plot_path(args)
    if args.chat_template is not None and not args.chat:  # a template only a --chat prompt goes through
        raise CliError("--chat-template needs --chat (the prompt is otherwise used as it is)")
    model, tokenizer, load_s = _load_for_chat(args)
    prompt_ids = _prompt_ids(text, args.chat, tokenizer)
    if not prompt_ids:
        raise CliError("the prompt is empty after tokenization")
    input_ids = torch.tensor([prompt_ids])
    assistant = _load_assistant(args)
    # the model's generation config fills what the flags leave unset, as in transformers' generate(); the flags
    # also go to generate() as keyword arguments, which win over it there too
    flags = flag_values(args)
    if args.force_word:  # phrases as tokenized here, after any --force-words-ids
        flags["force_words_ids"] = list(flags.get("force_words_ids") or []) + _force_words(args.force_word, tokenizer)
    cfg = with_model_defaults(cfg, model.generation_defaults, flags)
    negative = None
    if args.negative_prompt is not None:
        if cfg.guidance_scale in (None, 1.0):
            raise CliError("--negative-prompt needs --guidance-scale (a value other than 1)")
        negative = torch.tensor([_prompt_ids(args.negative_prompt, args.chat, tokenizer) or [prompt_ids[-1]]])
    single = cfg.num_return_sequences == 1
    # beams and sample-and-rank pick their sequence at the end: printed then
    streams = not (args.json or args.trace or not single or cfg.strategy in NOT_STREAMABLE)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if streams else None
    if plot_path is not None:
        out = _traced_generate(model, input_ids, cfg, tokenizer, plot_path, flags)
    else:
        out = generate(model, input_ids, torch.ones_like(input_ids), cfg, tokenizer=tokenizer, streamer=streamer,
                       assistant_model=assistant, negative_prompt_ids=negative, **flags)
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in out.new_token_ids]
    if args.json:
        print(json.dumps(_json_report(prompt_ids, out, texts, load_s), ensure_ascii=False))
    elif streamer is None:
        for k, text in enumerate(texts):
            print(text if single else f"--- sequence {k} ---\n{text}")
    return 0


def _trace_plot_path(args: argparse.Namespace) -> str | None:
    """Where ``--trace`` saves its plot (``--trace-plot``, default kvgen-trace.png), checked before anything runs;
    None without ``--trace``. ``CliError`` for ``--trace-plot`` alone, in a directory that does not exist, naming a
    directory or in a format matplotlib does not write (a name without extension gets .png, as savefig gives it)."""
    if not args.trace:
        if args.trace_plot is not None:
            raise CliError("--trace-plot needs --trace")
        return None
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(args.trace_plot or "kvgen-trace.png")
    try:
        has_parent, is_dir = path.parent.is_dir(), path.is_dir()
    except OSError as e:  # a name too long
        raise CliError(f"--trace-plot: cannot write {path}: {e.strerror or e}") from None
    if not has_parent:
        raise CliError(f"--trace-plot: the directory {str(path.parent)!r} does not exist")
    if is_dir:
        raise CliError(f"--trace-plot: {str(path)!r} is a directory, not a file")
    if not path.suffix:  # matplotlib's savefig adds its default format's extension: say where the plot really goes
        path = path.with_name(path.name + ".png")
    if (fmt := path.suffix[1:].lower()) not in (formats := FigureCanvasBase.get_supported_filetypes()):
        raise CliError(f"--trace-plot: cannot save a plot as {fmt!r}, use one of {', '.join(sorted(formats))}")
    return str(path)


def _force_words(texts: list[str], tokenizer: Any) -> list[list[int]]:
    """``--force-word`` texts as id lists (no special tokens); ``CliError`` for one that tokenizes to nothing."""
    words = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    if any(not w for w in words):
        raise CliError(f"--force-word must not be empty, got {texts!r}")
    return words


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
    import torch

    from kvgen.generation import generate
    from kvgen.trace import Tracer, format_step, plot_latencies

    with Tracer(model) as cached:
        out = generate(model, input_ids, torch.ones_like(input_ids), cfg, tokenizer=tokenizer, **flags)
    for i, step in enumerate(cached.steps):
        print(format_step(i, step), file=sys.stderr)
    print("[trace] now the same generation without a KV cache (every step recomputes the sequence):", file=sys.stderr)
    with Tracer(model) as uncached:
        generate(model, input_ids, torch.ones_like(input_ids), cfg.replace(use_cache=False), tokenizer=tokenizer,
                 **flags)
    for i, step in enumerate(uncached.steps):
        print(format_step(i, step), file=sys.stderr)
    try:
        plot_latencies([s.latency_s for s in cached.steps], [s.latency_s for s in uncached.steps], plot_path)
    except OSError as e:  # a file the OS refuses (a name too long, a read-only place): found only by writing it
        raise CliError(f"--trace-plot: cannot write {plot_path}: {e.strerror or e}") from None
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


def cmd_embed(args: argparse.Namespace) -> int:
    """Each TEXT's embedding (``LLM.embed``: pooled final hidden states) as one JSON list of lists on stdout."""
    from kvgen.engine.llm import LLM
    from kvgen.engine.pooling import PoolingParams

    params = PoolingParams(dimensions=args.dimensions, normalize=args.normalize)  # ValueError: one line, exit 2
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, pooling_type=args.pooling_type)
    _end_startup()
    print(json.dumps([out.outputs.embedding for out in llm.embed(list(args.text), params, use_tqdm=False)]))
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

    module_name, config_cls, _ = BENCHES[args.bench_command]
    module = importlib.import_module(f"kvgen.bench.{module_name}")
    config = config_from_args(getattr(module, config_cls), args)
    _end_startup()  # each bench loads its own models
    result = to_json(getattr(module, f"run_{module_name}_bench")(config))
    print(json.dumps(result, indent=2) if args.json else render(result, module.SIDES))
    return 0


# kvgen SUBCOMMAND -> (its help, the function adding its flags, the function running it)
_SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "generate": ("generate text from a prompt (streams to stdout)", add_generate_flags, cmd_generate),
    "chat": ("interactive multi-turn chat (/exit or end of input leaves)", add_chat_command_flags, cmd_chat),
    "tokenize": ("print the token ids of TEXT as a JSON list", add_tokenize_flags, cmd_tokenize),
    "embed": ("print the embedding of each TEXT as a JSON list of lists", add_embed_flags, cmd_embed),
    "perplexity": ("perplexity of the model on a text file", add_perplexity_flags, cmd_perplexity),
    "info": ("architecture, sizes, quantization and tokenizer facts", add_info_flags, cmd_info),
    "serve": ("OpenAI-compatible HTTP server with a chat page at /", add_serve_flags, cmd_serve),
    "bench": ("benchmarks (JSON out)", add_bench_flags, cmd_bench),
}


def _set_threads(threads: int | None) -> None:
    """--threads N, else $OMP_NUM_THREADS when set, else the physical cores (``kvgen.threads.set_threads``)."""
    if threads is not None and threads < 1:
        raise CliError(f"--threads must be >= 1, got {threads}")
    from kvgen.threads import set_threads

    set_threads(threads)


def _write_error(e: BaseException) -> str | None:
    """The one line for a write that found no room (``> /dev/full``, a full disk or quota), else None: the output's
    place, not an internal error."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"kvgen: error: cannot write the output: {e.strerror}"
    return None


def _say(message: str) -> None:
    """``message`` on stderr; nothing where stderr cannot be written (``2> /dev/full``), so the exit code stays."""
    try:
        print(message, file=sys.stderr)
    except (OSError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvgen`` script; returns the exit code."""
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        args = build_parser(argv[0] if argv and argv[0] in _SUBCOMMANDS else "").parse_args(argv)
        if "threads" in vars(args):
            _set_threads(args.threads)
        return _SUBCOMMANDS[args.command][2](args)
    except (CliError, KvgenError, ValueError, NotImplementedError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        _say(msg if msg.startswith("kvgen") else f"kvgen: error: {msg}")
        return 2
    except KeyboardInterrupt:
        _say("kvgen: interrupted")
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # an internal error: one line unless KVGEN_DEBUG is set
        if (message := _write_error(e)) is not None:
            _say(message)
            return 2
        if os.environ.get("KVGEN_DEBUG"):
            raise
        _say(f"kvgen: internal error: {type(e).__name__}: {e} (set KVGEN_DEBUG=1 for a traceback)")
        return 1


def run() -> NoReturn:
    """The ``kvgen`` console script (and ``python -m kvgen``, ``python -m kvgen.cli``): :func:`main` in a process of its
    own, which starts with the garbage collector off until :func:`_end_startup` and leaves with ``os._exit`` once
    its output is flushed. ``import torch`` ran full collections over its own ~180,000 objects (0.08 s here, 0.07 s
    more while kvgen's modules imported), and Python's teardown collected and finalized them all again (0.32-0.39 s
    after the last token was printed): ``kvgen generate --max-new-tokens 16 Hello`` took 1.55-1.72 s, 1.08-1.17
    without both (alternating runs). Nothing is lost: every command has finished its work, threads included, when
    ``main`` returns."""
    gc.disable()
    code = main()
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # started with that descriptor closed (`>&-`): print() wrote nothing to it
            continue
        try:
            stream.flush()
        except (OSError, ValueError) as e:  # a reader that went away (`| head -1`), a closed stream
            if stream is sys.stdout and code == 0 and (message := _write_error(e)) is not None:
                _say(message)  # the output's last buffer did not fit (`> /dev/full`): it exited 0, the output lost
                code = 2
    logging.shutdown()  # flushes the server's log handlers
    os._exit(code)


if __name__ == "__main__":
    run()
