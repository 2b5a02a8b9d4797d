"""The kvgen CLI: JSON output vs transformers, errors as one line + exit 2, subcommands."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import save_tiny_model_dir

from kvgen.cli import main

MAX_NEW = 24


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _hf_greedy(hf_model, prompt_ids: list[int], tok, n: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                eos_token_id=tok.eos_token_ids, pad_token_id=tok.pad_token_id)
    new = out[0, len(prompt_ids):].tolist()
    while len(new) > 1 and new[-1] == tok.pad_token_id and new[-2] in tok.eos_token_ids + [tok.pad_token_id]:
        new.pop()
    return new


@pytest.mark.parametrize("extra", [[], ["--chat"]])
def test_generate_json_greedy_matches_transformers(capsys, ours_default, hf_default, extra):
    _, tok = ours_default
    code, out, err = _run(capsys, ["generate", "Name a famous painting.", "--temperature", "0", "--json",
                                   "--dtype", "float32", "--max-new-tokens", str(MAX_NEW), *extra])
    assert code == 0, err
    report = json.loads(out)
    assert set(report) >= {"prompt_token_ids", "token_ids", "text", "finish_reason", "timings"}
    assert set(report["timings"]) == {"load_s", "prefill_s", "decode_s", "decode_tokens_per_s", "num_decode_steps"}
    if extra:
        assert report["prompt_token_ids"] == tok.apply_chat_template(
            [{"role": "user", "content": "Name a famous painting."}], add_generation_prompt=True, tokenize=True)
    expected = _hf_greedy(hf_default, report["prompt_token_ids"], tok, MAX_NEW)
    assert report["token_ids"] == expected
    assert report["finish_reason"] == ("stop" if expected[-1] in tok.eos_token_ids else "length")
    assert report["text"] == tok.decode(report["token_ids"], skip_special_tokens=True)


def test_generate_streams_text_to_stdout(capsys, ours_default):
    code, out, _ = _run(capsys, ["generate", "The sky is", "--max-new-tokens", "12"])
    assert code == 0
    code2, out2, _ = _run(capsys, ["generate", "The sky is", "--max-new-tokens", "12", "--json"])
    assert code2 == 0
    assert out.rstrip("\n") == json.loads(out2)["text"]


def test_prompt_option_and_file_are_the_positional_prompt(capsys, tiny_model_dir, tmp_path):
    (prompt_file := tmp_path / "prompt.txt").write_text("The sky is")
    base = ["generate", "--model", str(tiny_model_dir), "--max-new-tokens", "6", "--json"]
    runs = [_run(capsys, [*base, *prompt]) for prompt in (["The sky is"], ["-p", "The sky is"], ["--prompt", "The sky is"],
                                                          ["-f", str(prompt_file)])]
    assert [code for code, _, _ in runs] == [0, 0, 0, 0]
    reports = [json.loads(out) for _, out, _ in runs]
    assert all(r["prompt_token_ids"] == reports[0]["prompt_token_ids"] for r in reports)
    assert all(r["token_ids"] == reports[0]["token_ids"] for r in reports)


def test_generation_config_max_new_tokens_replaces_the_cli_default_length_but_not_a_flag(capsys, tiny_model_dir,
                                                                                         tmp_path):
    """The file's max_new_tokens is the default length (64 otherwise); its max_length is not; -n wins over both."""
    directory = tmp_path / "model"
    shutil.copytree(tiny_model_dir, directory)
    base = ["generate", "The sky is", "--model", str(directory), "--json", "--min-new-tokens", "3"]

    def num_new(config: dict, *flags: str) -> int:
        (directory / "generation_config.json").write_text(json.dumps(config))
        code, out, err = _run(capsys, [*base, *flags])
        assert code == 0, err
        return len(json.loads(out)["token_ids"])

    assert num_new({"max_new_tokens": 3}) == 3
    assert num_new({"max_new_tokens": 3}, "-n", "5") == 5
    assert num_new({"max_new_tokens": 3}, "--max-length", "40") == 3  # transformers: max_new_tokens wins
    assert num_new({"max_length": 6}) > 6  # a file's max_length leaves the CLI's 64 (EOS may end it sooner)


def test_llama_cpp_flag_names_mean_the_same_settings(capsys, tiny_model_dir):
    """-m, -t, -n / --n-predict, --temp, --repeat-penalty and -s (llama-cli's names) and --max-tokens (vLLM's) give the
    same sampled tokens as --model, --threads, --max-new-tokens, --temperature, --repetition-penalty and --seed;
    another seed differs."""
    long = ["--model", str(tiny_model_dir), "--threads", "1", "--max-new-tokens", "9", "--temperature", "1.5",
            "--repetition-penalty", "1.3", "--seed", "11", "--do-sample"]
    short = ["-m", str(tiny_model_dir), "-t", "1", "-n", "9", "--temp", "1.5", "--repeat-penalty", "1.3", "-s", "11",
             "--do-sample"]
    runs = [_run(capsys, ["generate", "The sky is", "--json", *flags]) for flags in
            (long, short, [*short[:4], "--n-predict", "9", *short[6:]], [*short[:-2], "12", "--do-sample"],
             [*short[:4], "--max-tokens", "9", *short[6:]])]
    assert [code for code, _, _ in runs] == [0, 0, 0, 0, 0]
    ids = [json.loads(out)["token_ids"] for _, out, _ in runs]
    assert len(ids[0]) == 9 and ids[1] == ids[0] and ids[2] == ids[0] and ids[4] == ids[0]
    assert ids[3] != ids[0]  # -s reached the seed


def test_seed_minus_one_is_a_random_seed_as_in_llama_cpp(capsys, tiny_model_dir):
    """llama-cli's -s -1 (LLAMA_DEFAULT_SEED) draws a fresh seed each run, as llama-cpp-python's seed=-1 (checked: two
    completions at temperature 1.5 differ, seed=5 twice are equal); kvgen seeded the generator with -1, so every
    `-s -1` run gave the same tokens."""
    from kvgen.cli import build_parser
    from kvgen.cli_flags import flag_values

    assert "seed" not in flag_values(build_parser("generate").parse_args(["generate", "-s", "-1"]))
    assert flag_values(build_parser("generate").parse_args(["generate", "--seed", "-2"]))["seed"] == -2
    argv = ["generate", "The sky is", "--json", "-m", str(tiny_model_dir), "-n", "12", "--temp", "1.5", "-s", "-1",
            "--min-new-tokens", "12"]  # a random seed may draw EOS early: 12 tokens whatever it draws
    runs = [_run(capsys, argv) for _ in range(2)]
    assert [code for code, _, _ in runs] == [0, 0]
    first, second = (json.loads(out)["token_ids"] for _, out, _ in runs)
    assert len(first) == 12 and first != second


def test_chat_template_flag_replaces_the_models(capsys, tiny_model_dir, tmp_path):
    from kvgen.tokenizer import Tokenizer

    (template := tmp_path / "t.jinja").write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    code, out, _ = _run(capsys, ["generate", "--model", str(tiny_model_dir), "--chat", "--chat-template", str(template),
                                 "hello there", "--max-new-tokens", "2", "--json"])
    assert code == 0
    tok = Tokenizer.from_pretrained(tiny_model_dir)
    assert json.loads(out)["prompt_token_ids"] == tok.encode("<hello there>", add_special_tokens=False)
    assert json.loads(out)["prompt_token_ids"] != tok.apply_chat_template(
        [{"role": "user", "content": "hello there"}], add_generation_prompt=True, tokenize=True)


def test_num_assistant_tokens_schedule_takes_a_plain_name(capsys, tiny_model_dir):
    """--num-assistant-tokens-schedule constant, as its help names the values; it was refused as "not valid JSON"
    unless written '"constant"'."""
    base = ["generate", "hi", "--model", str(tiny_model_dir), "--assistant-model", str(tiny_model_dir),
            "--max-new-tokens", "3", "--json", "--num-assistant-tokens-schedule"]
    code, out, err = _run(capsys, [*base, "constant"])
    assert code == 0, err
    assert len(json.loads(out)["token_ids"]) == 3
    code, _, err = _run(capsys, [*base, "fast"])
    assert code == 2 and "num_assistant_tokens_schedule must be" in err and len(err.strip().splitlines()) == 1


def test_chat_template_without_chat_is_refused(capsys, tiny_model_dir):
    """README: --chat-template is on generate --chat; without --chat it was read, compiled and silently ignored."""
    code, out, err = _run(capsys, ["generate", "--model", str(tiny_model_dir), "--chat-template", "{{ 'x' }}", "hi",
                                   "--max-new-tokens", "2"])
    assert code == 2 and out == "" and err.count("\n") == 1 and "--chat-template needs --chat" in err


@pytest.mark.parametrize("flags", [["--num-beams", "2"], ["--do-sample", "--best-of", "3", "--seed", "1"]])
def test_strategies_that_pick_at_the_end_print_their_sequence(capsys, tiny_model_dir, flags):
    """Beam search and sample-and-rank cannot stream: the chosen sequence is printed once chosen (the --json text)."""
    base = ["generate", "The sky is", "--model", str(tiny_model_dir), "--max-new-tokens", "5", *flags]
    code, out, err = _run(capsys, base)
    code_json, out_json, _ = _run(capsys, [*base, "--json"])
    assert code == code_json == 0, err
    assert out.rstrip("\n") == json.loads(out_json)["text"] and out.strip()


def test_force_word_and_negative_prompt_reach_generate(capsys, tiny_model_dir):
    """--force-word (constrained beam search) and --negative-prompt (classifier-free guidance) give the tokens of
    generate() with force_words_ids / negative_prompt_ids tokenized the same way."""
    from kvgen.generation import GenerationConfig, generate
    from kvgen.loader import load_model

    model, tok = load_model(str(tiny_model_dir))
    ids = torch.tensor([tok.encode("The sky is")])
    base = ["generate", "The sky is", "--model", str(tiny_model_dir), "--max-new-tokens", "8", "--json"]
    cases = [
        (["--num-beams", "3", "--force-word", " green", "--force-word", " sea"],
         {"num_beams": 3, "force_words_ids": [tok.encode(" green", add_special_tokens=False),
                                              tok.encode(" sea", add_special_tokens=False)]}, {}),
        (["--guidance-scale", "5.0", "--negative-prompt", "The sea is"], {"guidance_scale": 5.0},
         {"negative_prompt_ids": torch.tensor([tok.encode("The sea is")])}),
    ]
    for flags, settings, extra in cases:
        code, out, err = _run(capsys, [*base, *flags])
        assert code == 0, err
        want = generate(model, ids, None, GenerationConfig(max_new_tokens=8, **settings), **extra).new_token_ids[0]
        assert json.loads(out)["token_ids"] == want
        plain = generate(model, ids, None, GenerationConfig(max_new_tokens=8, num_beams=settings.get("num_beams", 1)))
        assert plain.new_token_ids[0] != want  # the flag changed the output
    for flags, message in [(["--negative-prompt", "x"], "--negative-prompt needs --guidance-scale"),
                           (["--force-word", " x"], "needs num_beams > 1"), (["--force-word", "", "--num-beams", "2"],
                                                                             "--force-word must not be empty")]:
        code, _, err = _run(capsys, [*base, *flags])
        assert code == 2 and message in err and err.count("\n") == 1, err


def test_max_length_counts_the_prompt(capsys, tiny_model_dir):
    """transformers' max_length: prompt plus new tokens (without --max-new-tokens, whose CLI default would win)."""
    code, out, _ = _run(capsys, ["generate", "Hi", "--model", str(tiny_model_dir), "--max-length", "9",
                                 "--eos-token-id", "0", "--json"])
    report = json.loads(out)
    assert code == 0 and len(report["prompt_token_ids"]) < 8
    assert len(report["prompt_token_ids"]) + len(report["token_ids"]) == 9


def test_quantization_flag_runs_the_quantized_model(capsys, tiny_model_dir):
    """--quantization q4_0 (any case) gives the tokens of load_model(quantization="q4_0") and generate()."""
    from kvgen.generation import GenerationConfig, generate
    from kvgen.loader import load_model

    code, out, err = _run(capsys, ["generate", "Water boils at", "--model", str(tiny_model_dir), "--quantization",
                                   "Q4_0", "--max-new-tokens", "8", "--json"])
    assert code == 0, err
    report = json.loads(out)
    model, _ = load_model(tiny_model_dir, quantization="q4_0")
    want = generate(model, torch.tensor([report["prompt_token_ids"]]), None,
                    GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=model.generation_defaults.get(
                        "eos_token_id", [])))
    assert report["token_ids"] == want.new_token_ids[0][: len(report["token_ids"])]
    from kvgen.models.quant_linear import QuantEmbedding

    assert isinstance(model.model.embed_tokens, QuantEmbedding)  # the float32 checkpoint became quantized blocks


def _model_args(request: pytest.FixtureRequest, model: str) -> list[str]:
    """CLI flags naming ``model``: "default" (the real model, no flag) or "tiny" (``tiny_model_dir``)."""
    return [] if model == "default" else ["--model", str(request.getfixturevalue("tiny_model_dir"))]


ON_BOTH_MODELS = pytest.mark.parametrize("model", [pytest.param("default", marks=pytest.mark.slow), "tiny"])


@ON_BOTH_MODELS
def test_no_cache_and_static_cache_flags_agree(capsys, request, model):
    runs = []
    for flags in (["--no-cache"], ["--cache", "dynamic"], ["--cache", "static"]):
        argv = ["generate", "Water boils at", "--max-new-tokens", "10", "--json", *flags, *_model_args(request, model)]
        code, out, err = _run(capsys, argv)
        assert code == 0, err
        runs.append(json.loads(out)["token_ids"])
    assert runs[0] == runs[1] == runs[2]


def test_assistant_model_drafts_the_same_tokens_in_fewer_forwards(capsys, tiny_model_dir, tmp_path):
    base = ["generate", "Water boils at", "--max-new-tokens", "16", "--json", "--model", str(tiny_model_dir)]
    code, out, err = _run(capsys, base)
    assert code == 0, err
    plain = json.loads(out)
    code, out, err = _run(capsys, [*base, "--assistant-model", str(tiny_model_dir), "--num-assistant-tokens", "5"])
    assert code == 0, err
    assisted = json.loads(out)
    assert assisted["token_ids"] == plain["token_ids"]
    assert plain["timings"]["num_decode_steps"] == len(plain["token_ids"]) - 1
    assert assisted["timings"]["num_decode_steps"] < plain["timings"]["num_decode_steps"] / 2  # the model drafts itself
    code, _, err = _run(capsys, [*base, "--assistant-model", str(tmp_path / "missing.gguf")])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "missing.gguf" in err


@pytest.mark.slow  # the default model
def test_trace_shows_prefill_once_then_cache_growing_and_saves_plot(capsys, tmp_path):
    plot = tmp_path / "trace.png"
    code, _, err = _run(capsys, ["generate", "Hello there", "--max-new-tokens", "5", "--trace", "--trace-plot", str(plot)])
    assert code == 0
    lines = [l for l in err.splitlines() if l.startswith("[trace] step")]
    cached, uncached = lines[:5], lines[5:]
    assert "prefill" in cached[0] and "input [1, 2]" in cached[0] and "K [1, 3, 2, 64]" in cached[0]
    for i, line in enumerate(cached[1:], start=1):
        assert "input [1, 1]" in line and f"K [1, 3, {2 + i}, 64]" in line
    assert len(uncached) == 5 and "no cache" in uncached[-1] and "input [1, 6]" in uncached[-1]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("name", "message"), [
    (".", "is a directory, not a file"),  # matplotlib wrote <dir>.png and kvgen said it saved <dir>
    ("plot.txt", "cannot save a plot as 'txt', use one of "),  # was refused by savefig only after both runs
    ("a" * 300 + ".png", "cannot write"),  # OSError from savefig: an internal error, exit 1
])
def test_trace_plot_paths_that_cannot_hold_the_plot_are_one_line_and_exit_2(capsys, tiny_model_dir, tmp_path, name,
                                                                              message):
    code, _, err = _run(capsys, ["generate", "hi", "--model", str(tiny_model_dir), "--max-new-tokens", "2", "--trace",
                                 "--trace-plot", str(tmp_path / name)])
    lines = [line for line in err.splitlines() if not line.startswith("[trace]")]
    assert code == 2 and len(lines) == 1 and message in lines[0] and "Traceback" not in err, err


def test_trace_plot_without_an_extension_reports_the_png_it_saved(capsys, tiny_model_dir, tmp_path):
    code, _, err = _run(capsys, ["generate", "hi", "--model", str(tiny_model_dir), "--max-new-tokens", "2", "--trace",
                                 "--trace-plot", str(tmp_path / "plot")])
    assert code == 0 and f"saved to {tmp_path / 'plot.png'}\n" in err
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tokenize_prints_ids(capsys, ours_default):
    _, tok = ours_default
    code, out, _ = _run(capsys, ["tokenize", "Hello <|im_end|> wörld 🙂"])
    assert code == 0 and json.loads(out) == tok.encode("Hello <|im_end|> wörld 🙂")


def test_perplexity_matches_transformers_nll(capsys, tmp_path, ours_default, hf_default):
    _, tok = ours_default
    text = ("The quick brown fox jumps over the lazy dog. " * 3 + "Paris is the capital of France. ") * 6
    path = tmp_path / "text.txt"
    path.write_text(text)
    code, out, err = _run(capsys, ["perplexity", str(path), "--context-length", "64", "--dtype", "float32"])
    assert code == 0, err
    report = json.loads(out)
    ids = tok.encode(text, add_special_tokens=False)
    windows = [ids[i:i + 64] for i in range(0, len(ids), 64)]
    windows = [w for w in windows if len(w) >= 2]
    nll, count = 0.0, 0
    with torch.inference_mode():
        for w in windows:
            logits = hf_default(torch.tensor([w])).logits[0, :-1]
            nll += float(F.cross_entropy(logits, torch.tensor(w[1:]), reduction="sum"))
            count += len(w) - 1
    assert report["num_windows"] == len(windows) and report["num_tokens_scored"] == count
    assert report["mean_nll"] == pytest.approx(nll / count, rel=1e-4)
    assert report["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-4)


@pytest.mark.parametrize("content,flags,message", [
    (None, [], "cannot read"),  # a directory: Is a directory
    (b"", [], "need at least 2 tokens to compute perplexity, got 0"),
    (b"\xff\xfe hello", [], "cannot read"),  # not UTF-8
    (b"hello world " * 20, ["--context-length", "1"], "context_length must be >= 2, got 1"),
    (b"hello world " * 20, ["--context-length", "-3"], "context_length must be >= 2, got -3"),
    (b"hello world " * 20, ["--context-length", "2049"], "context_length must be <= the model's context window (2048)"),
    (b"hello world " * 20, ["--context-length", "8.5"], "argument --context-length: invalid int value: '8.5'"),
])
def test_perplexity_bad_input_is_one_line_and_exit_2(capsys, tmp_path, tiny_model_dir, content, flags, message):
    path = tmp_path / "text.txt"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    code, out, err = _run(capsys, ["perplexity", str(path), "--model", str(tiny_model_dir), *flags])
    assert (code, out) == (2, "") and err.count("\n") == 1 and message in err and "Traceback" not in err, err


def test_info_reports_architecture_and_quantization(capsys, hf_default):
    code, out, _ = _run(capsys, ["info", "--json"])
    assert code == 0
    info = json.loads(out)
    cfg = hf_default.config
    assert info["architecture"] == "llama"
    assert info["num_hidden_layers"] == cfg.num_hidden_layers and info["hidden_size"] == cfg.hidden_size
    assert info["num_key_value_heads"] == cfg.num_key_value_heads
    assert info["num_parameters"] == sum(p.numel() for p in hf_default.parameters())
    assert set(info["storage_types"]) == {"Q4_1", "Q8_0", "F32"}


@pytest.mark.parametrize("model_type", ["qwen3", "mistral"])
def test_info_names_the_checkpoints_own_architecture(tmp_path, model_type):
    """A directory whose model runs on kvgen's Llama decoder is reported as its own model_type, the decoder beside."""
    from kvgen.info import describe_model

    info = describe_model(str(save_tiny_model_dir(tmp_path / model_type, model_type=model_type)))
    assert (info["architecture"], info["decoder"]) == (model_type, "llama")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "hi", "--model", "/nonexistent/model.gguf"], "model not found: /nonexistent/model.gguf"),
        (["generate", "hi", "--model", ""], "model path must not be empty"),  # was the working directory
        (["generate", "hi", "--top-p", "1.5", "--temperature", "1"], "top_p must be in (0, 1], got 1.5"),
        (["generate", "hi", "--max-new-tokens", "0"], "max_new_tokens must be an int in [1, 2147483647], got 0"),
        (["generate", "hi", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
        # a prefix of a longer flag is not that flag (argparse's allow_abbrev would read --prompt-lookup-num-tokens)
        (["generate", "--max-new", "4", "hi"], "unrecognized arguments: --max-new"),
        (["generate", "hi", "-p", "ho"], "give the prompt once, as PROMPT, -p/--prompt or -f/--file"),
        (["generate", "hi", "--dola-layers", "middle"], "dola_layers must be 'low', 'high' or a non-empty list"),
        (["generate", "hi", "--dola-layers", "high", "--num-beams", "2"], "dola_layers works with greedy search"),
        (["generate", "-f", "/no/such/prompt.txt"], "cannot read the prompt file /no/such/prompt.txt"),
        (["generate", "-f", ""], "kvgen generate: -f/--file must not be empty"),  # was "Is a directory: '.'"
        (["chat", "--chat-template", "/no/such.jinja"], "chat_template: '/no/such.jinja' is neither a file nor"),
        pytest.param(["generate", "hi", "--max-new-tokens", "9000"], "exceeds the context window of 8192 tokens",
                     marks=pytest.mark.slow),  # loads the default model to learn its context window
        (["perplexity", "/nonexistent.txt"], "cannot read /nonexistent.txt"),
        (["generate", "hi", "--quantization", "q3_k"], "invalid choice: 'q3_k'"),
        (["generate", "hi", "--quantization", "q8_0", "--dtype", "float32"], "quantization='q8_0' needs dtype 'auto'"),
        (["serve", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype must be one of auto, int8, got 'fp8'"),
        (["serve", "--api-key", ""], "api_key must not be empty"),  # was: no key at all
        (["serve", "-m", "/no/such/model.gguf"], "model not found: /no/such/model.gguf"),  # -m as llama-server's
        (["bench", "serve", "--no-llama-cpp", "--dtype", "bogus"], "--dtype must be one of auto"),  # exited 0
        (["bench", "serve", "--no-llama-cpp", "--quantization", "bogus"], "--quantization must be one of q8_0"),
        # refused before the bench's progress lines and model load (it was the third line on stderr)
        (["bench", "perplexity", "--no-llama-cpp", "--context-length", "1"], "--context-length must be an int >= 2"),
        # it scored the default text, reported as "is_default_text": false
        (["bench", "perplexity", "--no-llama-cpp", "--file", ""], "--file must not be empty, got ''"),
        # the engine's flags: refused after the bench's first progress line, named by their field
        (["bench", "throughput", "--no-transformers", "--no-llama-cpp", "--max-num-seqs", "0"],
         "kvgen: error: --max-num-seqs must be an int >= 1, got 0"),
        (["bench", "throughput", "--no-transformers", "--no-llama-cpp", "--kv-cache-dtype", "fp8"],
         "kvgen: error: --kv-cache-dtype must be one of auto, int8, got 'fp8'"),
        (["serve", "--kv-cache-dtype", "int8", "--dtype", "float32"], "kv_cache_dtype='int8' needs dtype 'auto'"),
        (["generate", "hi", "--threads", "100000"], "num_threads must be in [1, 512], got 100000"),
        (["generate", "hi", "--trace", "--trace-plot", "/no/such/dir/x.png"], "the directory '/no/such/dir' does not"),
        (["generate", "hi", "--trace-plot", "x.png"], "--trace-plot needs --trace"),
        (["generate", "hi", "--do-sample", "--best-of", "1", "--num-return-sequences", "2"],
         "num_return_sequences=2 conflicts with best_of=1"),
        (["generate", "hi", "--bad-words-ids", "[[-1]]"], "bad_words_ids entries must be non-empty sequences of ids"),
        # bytes that are not UTF-8 (`--stop $'\xff'`, read with surrogateescape): a stop no text can hold, accepted
        (["generate", "hi", "--stop", "a\udcff"], "--stop is not valid UTF-8 text, got 'a\\udcff'"),
        # malformed [ids, bias] pairs: were internal errors (TypeError, exit 1) or a message naming no setting
        (["generate", "hi", "--sequence-bias", "[1]"], "sequence_bias must be a dict or a list of [ids, bias] pairs"),
        (["generate", "hi", "--sequence-bias", "[[[1], null]]"], "sequence_bias values must be finite numbers"),
        (["generate", "hi", "--sequence-bias", '[[[1], "x"]]'], "sequence_bias values must be finite numbers"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(capsys, argv, message):
    code, _, err = _run(capsys, argv)
    assert code == 2
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


@pytest.mark.parametrize("argv,message", [
    (["--forced-bos-token-id", "99999999"], "forced_bos_token_id must be a token id in [0, "),
    (["--forced-eos-token-id", "99999999"], "forced_eos_token_id must be a token id in [0, "),
    (["--chat", "--chat-template", "{% for i in range(100000000) %}x{% endfor %}"], "OverflowError: Range too big"),
    (["--chat", "--chat-template", "{{ 1 / 0 }}"], "ZeroDivisionError: division by zero"),
])
def test_settings_the_model_refuses_are_one_line_and_exit_2(capsys, tiny_model_dir, argv, message):
    """Forced ids past the vocabulary (they forced token 0) and chat templates that fail with any Python error."""
    code, _, err = _run(capsys, ["generate", "hi", "--model", str(tiny_model_dir), "--max-new-tokens", "2", *argv])
    assert code == 2 and err.count("\n") == 1 and message in err and "Traceback" not in err, err


@pytest.mark.parametrize("config,message", [
    ({"model_type": "llama"}, "lacks required fields 'vocab_size', 'hidden_size', 'num_hidden_layers', "
                              "'num_attention_heads'"),
    ({"model_type": "llama", "vocab_size": 10, "hidden_size": "big", "num_hidden_layers": 1, "num_attention_heads": 1},
     "hidden_size must be an integer, got 'big'"),
    ({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
      "hidden_act": "gelu"}, "hidden_act 'gelu' is not supported by the Llama-family decoder"),  # it ran SiLU
    ({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
      "rope_scaling": "x"}, "rope_scaling must be an object (or null), got 'x'"),
    ({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
      "eos_token_id": "x"}, "eos_token_id must be a token id or a list of them (ints >= 0), got 'x'"),
])
def test_a_config_json_missing_or_mistyping_fields_exits_2(capsys, tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, _, err = _run(capsys, ["info", "--model", str(tmp_path)])
    assert code == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("bench", ["decode", "strategies", "throughput", "perplexity", "serve"])
def test_bench_takes_llama_bench_model_and_threads_flags(bench):
    """-m and -t (llama-bench's, and every other kvgen subcommand's) are --model and --threads; they were refused
    as unrecognized arguments by every bench."""
    import importlib

    from kvgen.cli import build_parser
    from kvgen.cli_flags import BENCHES
    from kvgen.fields import config_from_args

    module, config_cls, _ = BENCHES[bench]
    cls = getattr(importlib.import_module(f"kvgen.bench.{module}"), config_cls)
    parse = build_parser("bench").parse_args
    short = config_from_args(cls, parse(["bench", bench, "-m", "some.gguf", "-t", "3"]))
    long = config_from_args(cls, parse(["bench", bench, "--model", "some.gguf", "--threads", "3"]))
    assert short == long and (short.model, short.num_threads) == ("some.gguf", 3)


def test_bench_decode_refuses_a_prompt_past_the_context_window(capsys, tiny_model_dir):
    """Every timed run would fail, and the step breakdown then ran on the whole prompt for minutes."""
    code, _, err = _run(capsys, ["bench", "decode", "--model", str(tiny_model_dir), "--no-transformers",
                                 "--no-llama-cpp", "--prompt-tokens", "100000"])
    assert code == 2 and err.splitlines()[-1] == ("kvgen: error: prompt_tokens + new_tokens must be <= the model's "
                                                  "context window (2048), got 100000 + 128"), err


def test_bench_decode_refuses_no_cache_tokens_past_the_context_window(capsys, tiny_model_dir):
    """The no-cache runs failed alone: their error sat in the report, the bench went on and exited 0."""
    code, out, err = _run(capsys, ["bench", "decode", "--model", str(tiny_model_dir), "--no-transformers",
                                   "--no-llama-cpp", "--prompt-tokens", "8", "--new-tokens", "4",
                                   "--no-cache-new-tokens", "5000"])
    assert code == 2 and out == "" and err.splitlines()[-1] == (
        "kvgen: error: prompt_tokens + no_cache_new_tokens must be <= the model's context window (2048), got 8 + 5000"), err


def test_truncated_gguf_exits_2_from_the_real_script(tmp_path, default_gguf_path):
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(default_gguf_path.read_bytes()[:1_000_000])
    proc = subprocess.run([sys.executable, "-m", "kvgen.cli", "generate", "hi", "--model", str(bad)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "truncated or corrupt" in proc.stderr and "Traceback" not in proc.stderr


def test_python_dash_m_kvgen_is_the_kvgen_command(tiny_model_dir, capsys):
    proc = subprocess.run([sys.executable, "-m", "kvgen", "tokenize", "--model", str(tiny_model_dir), "hello there"],
                          capture_output=True, text=True, timeout=120, check=False)
    expected = _run(capsys, ["tokenize", "--model", str(tiny_model_dir), "hello there"])[1]
    assert (proc.returncode, proc.stdout) == (0, expected)
    bad = subprocess.run([sys.executable, "-m", "kvgen", "nonsense"], capture_output=True, text=True, timeout=120,
                         check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def test_chat_two_turns_then_exit(ours_default):
    model, tok = ours_default
    proc = subprocess.run([sys.executable, "-m", "kvgen.cli", "chat", "--max-new-tokens", "12"],
                          input="What is 2+2?\nAnd 3+3?\n/exit\n", capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    # Reference: the same two turns through generate() with the chat template.
    from kvgen.generation import GenerationConfig, generate

    messages, replies = [], []
    for question in ["What is 2+2?", "And 3+3?"]:
        messages.append({"role": "user", "content": question})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out = generate(model, torch.tensor([ids]), None, GenerationConfig(max_new_tokens=12))
        reply = tok.decode(out.new_token_ids[0], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
    for reply in replies:
        assert reply.strip() and reply.strip() in proc.stdout


def test_chat_with_contrastive_search_prefills_each_turn_whole(tiny_model_dir):
    """Contrastive search takes no cache from earlier turns; two turns still reply."""
    proc = subprocess.run([sys.executable, "-m", "kvgen.cli", "chat", "--model", str(tiny_model_dir), "--max-new-tokens",
                           "6", "--penalty-alpha", "0.6", "--top-k", "4"], input="Hi\nAgain\n/exit\n",
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.count("> ") == 3 and len(proc.stdout.strip()) > 10


def test_chat_drops_the_oldest_exchange_when_the_context_is_full(tiny_model_dir):
    """A conversation outgrowing the 2048-token window loses its oldest exchange (as llama.cpp shifts its context);
    a message too long alone is not sent; the chat goes on."""
    long_message = "word " * 400  # ~800 tokens of the tiny tokenizer
    turns = f"{long_message}\n{long_message}\n{long_message}\n{'word ' * 1200}\nhi\n/exit\n"
    proc = subprocess.run([sys.executable, "-m", "kvgen.cli", "chat", "--model", str(tiny_model_dir), "--max-new-tokens",
                           "8"], input=turns, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("dropped the oldest exchange") == 1 and proc.stderr.count("not sent") == 1
    assert proc.stdout.count("> ") == 6


@pytest.mark.parametrize("max_new_tokens", ["2048", "9000"])
def test_chat_refuses_a_reply_length_that_leaves_no_room_for_a_message(capsys, monkeypatch, tiny_model_dir,
                                                                       max_new_tokens):
    """--max-new-tokens at or over the 2048-token window is one line and exit 2 before the first message (as kvgen
    generate refuses it); the chat used to start and refuse every message as 'over the -6952' tokens left."""
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n/exit\n"))
    code, out, err = _run(capsys, ["chat", "--model", str(tiny_model_dir), "--max-new-tokens", max_new_tokens])
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"max_new_tokens={max_new_tokens} leaves no room for a message in the context window of 2048 tokens" in err


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(capsys, monkeypatch, tiny_model_dir):
    """As llama.cpp's chat: Ctrl-C during a reply ends the reply (its message dropped), not the program; the next
    turn's prompt does not hold the dropped message."""
    import io

    import kvgen.generation

    real, prompts = kvgen.generation.generate, []

    def interrupted_once(model, input_ids, *args, **kwargs):
        prompts.append(input_ids[0].tolist())
        if len(prompts) == 1:
            raise KeyboardInterrupt
        return real(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(kvgen.generation, "generate", interrupted_once)
    monkeypatch.setattr("sys.stdin", io.StringIO("Stop me\nName three colours.\n/exit\n"))
    code, _, err = _run(capsys, ["chat", "--model", str(tiny_model_dir), "--max-new-tokens", "4"])
    assert code == 0 and "reply interrupted" in err
    from kvgen.tokenizer import Tokenizer

    want = Tokenizer.from_pretrained(tiny_model_dir).apply_chat_template(
        [{"role": "user", "content": "Name three colours."}], add_generation_prompt=True, tokenize=True)
    assert len(prompts) == 2 and prompts[1] == want


def test_chat_with_an_assistant_model_replies_as_without(tiny_model_dir):
    """Assisted decoding in chat: the same greedy replies (the model drafting for itself)."""
    base = [sys.executable, "-m", "kvgen.cli", "chat", "--model", str(tiny_model_dir), "--max-new-tokens", "10"]
    turns = "Name three colours.\nAnd three more?\n/exit\n"
    plain, assisted = (subprocess.run(cmd, input=turns, capture_output=True, text=True, timeout=120, check=False)
                       for cmd in (base, [*base, "--assistant-model", str(tiny_model_dir)]))
    assert plain.returncode == assisted.returncode == 0, assisted.stderr
    assert assisted.stdout == plain.stdout and len(plain.stdout.strip()) > 10


@ON_BOTH_MODELS
def test_chat_ends_cleanly_on_end_of_input(request, model):
    proc = subprocess.run([sys.executable, "-m", "kvgen.cli", "chat", *_model_args(request, model)], input="",
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv", [["chat"], ["generate", "-f", "-"]], ids=["chat", "generate-f-stdin"])
def test_a_closed_standard_input_is_one_line_and_exit_2(capsys, monkeypatch, tiny_model_dir, argv):
    """Started with fd 0 closed (`kvgen chat <&-`), Python's sys.stdin is None: input() raised RuntimeError and
    sys.stdin.read() AttributeError, both internal errors (exit 1)."""
    monkeypatch.setattr(sys, "stdin", None)
    code, out, err = _run(capsys, [*argv, "--model", str(tiny_model_dir), "--max-new-tokens", "2"])
    assert code == 2 and out == "" and err.count("\n") == 1 and "standard input is closed" in err, err


@pytest.mark.parametrize(
    "flags,hf_kwargs",
    [
        (["--num-beams", "4"], {"num_beams": 4}),
        (["--num-beams", "4", "--num-return-sequences", "2"], {"num_beams": 4, "num_return_sequences": 2}),
        (["--penalty-alpha", "0.6", "--top-k", "4"], {"penalty_alpha": 0.6, "top_k": 4}),
    ],
)
def test_generate_strategies_from_cli_match_transformers(capsys, ours_default, hf_default, flags, hf_kwargs):
    _, tok = ours_default
    code, out, err = _run(capsys, ["generate", "The best way to learn a language is", "--json", "--dtype", "float32",
                                   "--max-new-tokens", "16", *flags])
    assert code == 0, err
    report = json.loads(out)
    ids = torch.tensor([report["prompt_token_ids"]])
    with torch.inference_mode():
        ref = hf_default.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                  eos_token_id=tok.eos_token_ids, pad_token_id=tok.pad_token_id, **hf_kwargs)
    expected = [row[ids.shape[1]:].tolist() for row in ref]
    got = [s["token_ids"] for s in report["sequences"]] if "sequences" in report else [report["token_ids"]]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g == e[: len(g)] and all(t == tok.pad_token_id for t in e[len(g):])
    if "sequences" in report:
        scores = [s["score"] for s in report["sequences"]]
        assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "hi", "--temperature", "-1"], "temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
        (["generate", "hi", "--top-k", str(2**70)], "top_k must be an int in [0, 2147483647] (0 = off), got"),
        (["generate", "hi", "--repetition-penalty", "5e-324"], "repetition_penalty must be in [1e-06, 1000000], got 5e-324"),
        (["generate", "hi", "--top-k", "many"], "top_k must be an int, got 'many'"),
        (["chat", "--temperature", "-1"], "temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
        (["chat", "--min-p", "2"], "min_p must be in [0, 1], got 2.0"),
        (["chat", "--num-beams", "2"], "beam_search cannot stream"),
        (["generate", "hi", "--do-sample", "--temperature", "0.000001"], "temperature=1e-06 conflicts with do_sample=True"),
    ],
)
def test_bad_sampling_values_are_refused_before_loading(capsys, monkeypatch, argv, message):
    import kvgen.cli

    def no_load(args):  # the refusal must come from flag parsing / validation, before any model is read
        raise AssertionError("model loaded despite a bad flag")

    monkeypatch.setattr(kvgen.cli, "_load", no_load)
    code, out, err = _run(capsys, argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["--help"], ["genrate", "hi"], []])
def test_help_and_a_mistyped_subcommand_do_not_import_torch(argv):
    """``kvgen --help``, ``kvgen`` alone and a mistyped subcommand build only the subcommands' names: no torch import
    (1.5 s of 2.6 s before); the subcommands' own flags come when one is named."""
    code = ("import sys, kvgen.cli\n"
            f"try:\n    code = kvgen.cli.main({argv!r})\nexcept SystemExit as e:\n    code = e.code\n"
            "print(code, 'torch' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    code_seen, torch_imported = done.stderr.strip().splitlines()[-1].split()
    assert (code_seen, torch_imported) == ("0" if argv == ["--help"] else "2", "False")
    if argv == ["--help"]:
        assert all(name in done.stdout for name in ("generate", "chat", "serve", "bench"))
    else:
        assert "invalid choice: 'genrate'" in done.stderr if argv else "required: command" in done.stderr


def test_parser_does_not_import_the_http_stack():
    """Every command builds the full parser, ``kvgen serve``'s flags included; the server's FastAPI / pydantic
    modules load only when ``kvgen serve`` runs (they were 0.36 s of each ``kvgen generate``)."""
    code = ("import sys, kvgen.cli; kvgen.cli.build_parser(); "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'kvgen.server.app', 'kvgen.server.protocol') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_embed_prints_transformers_pooled_hidden_states(capsys, tiny_model_dir):
    """``kvgen embed`` on a Hugging Face directory: each text's last-token hidden state after the final norm,
    normalized (cut to --dimensions), as transformers computes it; --pooling-type mean and --no-normalize change it
    as they should; a bad --dimensions is one line and exit 2."""
    import transformers

    from kvgen.tokenizer import Tokenizer

    texts = ["The capital of France is", "hi"]
    ids = [Tokenizer.from_pretrained(tiny_model_dir).encode(t) for t in texts]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        hidden = [hf.model(torch.tensor([i])).last_hidden_state[0] for i in ids]  # [T, C] each
    code, out, err = _run(capsys, ["embed", *texts, "--model", str(tiny_model_dir), "--dimensions", "16"])
    assert code == 0, err
    for got, h in zip(json.loads(out), hidden, strict=True):
        torch.testing.assert_close(torch.tensor(got), F.normalize(h[-1, :16], dim=0), rtol=1e-5, atol=1e-5)
    code, out, err = _run(capsys, ["embed", texts[0], "--model", str(tiny_model_dir), "--pooling-type", "mean",
                                   "--no-normalize"])
    assert code == 0, err
    torch.testing.assert_close(torch.tensor(json.loads(out)[0]), hidden[0].mean(0), rtol=1e-5, atol=1e-5)
    code, _, err = _run(capsys, ["embed", "a", "--model", str(tiny_model_dir), "--dimensions", "0"])
    assert code == 2 and err.strip().splitlines() == ["kvgen: error: dimensions must be an int >= 1, got 0"]


def test_the_script_leaves_with_every_byte_of_output_and_mains_exit_code(tiny_model_dir):
    """``run`` (the console script) leaves with ``os._exit``: the output it printed still arrives whole (its last
    newline stays in stdout's buffer until a flush), and the exit code is ``main``'s (2 for a bad value)."""
    from kvgen.tokenizer import Tokenizer

    import os

    text = "hello world, " * 6_000  # ~100 kB of JSON ids
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout into a pipe: block-buffered
    proc = subprocess.run([sys.executable, "-m", "kvgen.cli", "tokenize", "--model", str(tiny_model_dir), text],
                          capture_output=True, text=True, timeout=120, check=False, env=env)
    assert proc.returncode == 0, proc.stderr
    ids = Tokenizer.from_pretrained(tiny_model_dir).encode(text)
    assert len(proc.stdout) > 65_536 and proc.stdout == json.dumps(ids) + "\n"  # the newline sat in the buffer
    bad = subprocess.run([sys.executable, "-m", "kvgen.cli", "generate", "hi", "--model", str(tiny_model_dir),
                          "--top-p", "1.5"], capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "top_p" in bad.stderr, bad.stderr


@pytest.mark.parametrize("closed", [1, 2], ids=["stdout", "stderr"])
def test_the_script_started_with_stdout_or_stderr_closed_leaves_without_a_traceback(tiny_model_dir, closed):
    """With fd 1 or 2 closed (`kvgen info >&-`) Python's sys.stdout / sys.stderr is None: ``run``'s final flush
    raised AttributeError, a traceback and exit 1 after the command had succeeded."""
    import os

    proc = subprocess.run([sys.executable, "-m", "kvgen.cli", "tokenize", "--model", str(tiny_model_dir), "hi"],
                          capture_output=True, text=True, timeout=120, check=False, preexec_fn=lambda: os.close(closed))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.stderr == "" and (proc.stdout == "" if closed == 1 else json.loads(proc.stdout))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("unbuffered", ["", "1"], ids=["buffered", "unbuffered"])
def test_output_that_cannot_be_written_is_one_line_and_exit_2(tiny_model_dir, unbuffered):
    """``> /dev/full``: block-buffered, the failed last flush was ignored (exit 0, the output lost); unbuffered, an
    "internal error" and exit 1. ``2> /dev/full``: the exit code of a bad flag became 1 (its message failed)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"} | {"PYTHONUNBUFFERED": unbuffered}
    argv = [sys.executable, "-m", "kvgen.cli", "tokenize", "--model", str(tiny_model_dir), "hi"]
    with open("/dev/full", "w") as full:
        proc = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120, env=env, check=False)
        bad = subprocess.run([*argv, "--bogus"], stdout=subprocess.PIPE, stderr=full, timeout=120, env=env, check=False)
    assert proc.returncode == 2 and proc.stderr == "kvgen: error: cannot write the output: No space left on device\n"
    assert bad.returncode == 2 and bad.stdout == b""


def test_the_script_collects_garbage_again_once_the_model_is_loaded(tiny_model_dir):
    """Start-up (imports, the load) runs with the collector off; once the model is loaded, what is alive is frozen
    and collection resumes, so the decode loop's garbage cycles are still freed."""
    probe = ("import gc, sys\nfrom kvgen import cli\nend = cli._end_startup\n"
             "def seen():\n    print('before', gc.isenabled(), file=sys.stderr)\n    end()\n"
             "    print('after', gc.isenabled(), gc.get_freeze_count(), file=sys.stderr)\n"
             "cli._end_startup = seen\nsys.argv = ['kvgen', *sys.argv[1:]]\ncli.run()\n")
    proc = subprocess.run([sys.executable, "-c", probe, "generate", "hi", "--model", str(tiny_model_dir),
                           "--max-new-tokens", "3"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    before, after = (line.split() for line in proc.stderr.splitlines() if line.startswith(("before", "after")))
    assert before == ["before", "False"] and after[:2] == ["after", "True"] and int(after[2]) > 10_000, proc.stderr


def test_end_startup_leaves_a_library_callers_collector_alone():
    """Called in-process with the collector on (tests, ``main`` from a library), nothing is frozen."""
    import gc

    from kvgen.cli import _end_startup

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    _end_startup()
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_chat_skips_a_line_that_is_not_utf8_and_goes_on(tiny_model_dir):
    """Undecodable bytes on stdin (read with surrogateescape) are reported and skipped, as an over-long message is;
    they ended the session with a "lone surrogate" error before."""
    proc = subprocess.run([sys.executable, "-m", "kvgen.cli", "chat", "--model", str(tiny_model_dir), "-n", "2"],
                          input=b"hi\n\xff\xfe bad\nhello\n/exit\n", capture_output=True, timeout=300)
    err = proc.stderr.decode()
    assert proc.returncode == 0 and "the line is not valid UTF-8 text; not sent" in err and "Traceback" not in err
    assert proc.stdout.decode().count("> ") >= 3  # the prompt came back after the bad line
