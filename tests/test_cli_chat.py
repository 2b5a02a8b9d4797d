"""``kvgen chat`` (kvgen.cli_chat) driven through its standard input: errors as one line + exit 2, the chat going on
past a bad line. More chat tests, from before this file, are in test_cli.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _chat(model_dir, stdin: bytes, *flags: str | bytes, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvgen", "chat", "--model", str(model_dir), *flags], input=stdin,
                          capture_output=True, timeout=300, env={**os.environ, **(env or {})}, check=False)


def test_a_line_that_is_not_utf8_is_skipped_under_a_strict_utf8_locale(tiny_model_dir):
    """With a UTF-8 locale (here PYTHONIOENCODING=utf-8) Python reads stdin strictly: the bad line's bytes ended the
    session with exit 2 before even the valid first line was answered. Now the chat goes on as without the line."""
    bad = _chat(tiny_model_dir, b"hi\n\xff\xfe bad\nhello\n/exit\n", "-n", "4", env={"PYTHONIOENCODING": "utf-8"})
    good = _chat(tiny_model_dir, b"hi\n\nhello\n/exit\n", "-n", "4", env={"PYTHONIOENCODING": "utf-8"})
    err = bad.stderr.decode()
    assert bad.returncode == 0 and "Traceback" not in err, err
    assert err.count("the line is not valid UTF-8 text; not sent") == 1
    assert bad.stdout == good.stdout and good.stdout.count(b"> ") == 4


def test_a_closed_standard_output_is_one_line_and_exit_2(tiny_model_dir):
    """Started with fd 1 closed (`kvgen chat >&-`), Python's sys.stdout is None: the first input() raised
    "RuntimeError: input(): lost sys.stdout", an internal error (exit 1) after the model had loaded."""
    proc = subprocess.run([sys.executable, "-m", "kvgen", "chat", "--model", str(tiny_model_dir), "-n", "2"],
                          input=b"hi\n/exit\n", stderr=subprocess.PIPE, timeout=300, preexec_fn=lambda: os.close(1),
                          check=False)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err.count("\n") == 1, err
    assert "standard output is closed" in err


@pytest.mark.parametrize("max_length", ["5", "50"])
def test_max_length_alone_is_refused_before_the_first_message(tiny_model_dir, max_length):
    """--max-length (prompt included) alone decided each reply's length: the conversation outgrew it after a turn or
    two and the chat ended mid-conversation with "max_length=50 leaves no room after the prompt's 113 tokens"
    (exit 2). Now refused at the start, one line; with --max-new-tokens (which wins over it) the chat runs."""
    turns = b"hi\nhello there\nand again\n/exit\n"
    refused = _chat(tiny_model_dir, turns, "--max-length", max_length)
    err = refused.stderr.decode()
    assert refused.returncode == 2 and err.count("\n") == 1 and refused.stdout == b"", err
    assert f"max_length={max_length} counts the whole conversation" in err and "--max-new-tokens" in err
    both = _chat(tiny_model_dir, turns, "--max-length", max_length, "-n", "3")
    assert both.returncode == 0 and both.stdout == _chat(tiny_model_dir, turns, "-n", "3").stdout


def test_a_system_message_that_is_not_utf8_is_refused_before_the_load(tiny_model_dir):
    """--system with undecodable bytes (argv reads them with surrogateescape) loaded the model, printed the banner and
    ended the chat at the first message with "text holds the lone surrogate U+DCFF", naming no flag."""
    proc = _chat(tiny_model_dir, b"hi\n/exit\n", "-n", "2", os.fsencode("--system"), b"be \xff brief")
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err.count("\n") == 1 and proc.stdout == b"", err
    assert "--system is not valid UTF-8 text" in err


def test_each_turn_is_the_template_over_the_history_and_replies_as_generate(capsys, monkeypatch, tiny_model_dir):
    """Each turn's prompt is transformers' apply_chat_template over the system message, the user lines and the
    replies so far (decoded without special tokens); each reply, sampled with a seed from the conversation's KV cache,
    is kvgen.generate's on that prompt alone."""
    import io

    import torch
    import transformers

    import kvgen.generation
    from kvgen.cli import main
    from kvgen.generation import GenerationConfig
    from kvgen.loader import load_model

    real, turns = kvgen.generation.generate, []

    def recorded(model, input_ids, *args, **kwargs):
        out = real(model, input_ids, *args, **kwargs)
        turns.append((input_ids[0].tolist(), out.new_token_ids[0]))
        return out

    monkeypatch.setattr(kvgen.generation, "generate", recorded)
    lines = ["Hi there", "a <|im_end|> b", "  spaced  ", "Last one"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join([lines[0], "", *lines[1:], "/exit"]) + "\n"))
    flags = ["--max-new-tokens", "5", "--temperature", "0.8", "--top-k", "20", "--seed", "3"]
    assert main(["chat", "--model", str(tiny_model_dir), "--system", "Be brief.", *flags]) == 0
    out = capsys.readouterr().out
    hf_tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    model, tok = load_model(str(tiny_model_dir))
    cfg = GenerationConfig(max_new_tokens=5, do_sample=True, temperature=0.8, top_k=20, seed=3)
    messages = [{"role": "system", "content": "Be brief."}]
    assert len(turns) == len(lines)
    for line, (prompt_ids, new_ids) in zip(lines, turns):
        messages.append({"role": "user", "content": line})
        assert prompt_ids == hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert new_ids == real(model, torch.tensor([prompt_ids]), None, cfg, tokenizer=tok).new_token_ids[0]
        reply = hf_tok.decode(new_ids, skip_special_tokens=True)
        assert reply in out
        messages.append({"role": "assistant", "content": reply})
