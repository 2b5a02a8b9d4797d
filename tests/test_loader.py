"""kvgen.loader: a GPT-2 checkpoint paired with a BertTokenizer vocab.txt, loaded and generated end to end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import make_tiny_model, save_tiny_model_dir
from tokenizer_cases import WORDPIECE_VOCAB, write_wordpiece_dir
from transformers import BertTokenizer, GPT2LMHeadModel

import kvgen
import kvgen.loader
from kvgen.errors import ModelFormatError, ModelNotFoundError
from kvgen.generation import GenerationConfig
from kvgen.loader import load_model


@pytest.fixture(scope="module")
def gpt2_bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight GPT-2 saved with a vocab.txt and a tokenizer_config naming BertTokenizer."""
    directory = tmp_path_factory.mktemp("gpt2_bert")
    ref = make_tiny_model("gpt2", vocab_size=len(WORDPIECE_VOCAB), max_position_embeddings=64,
                          bos_token_id=None, eos_token_id=None).ref  # GPT2Config's 50256 is outside this vocabulary
    ref.save_pretrained(directory, safe_serialization=True)
    return write_wordpiece_dir(directory, WORDPIECE_VOCAB, do_lower_case=True)


def test_gpt2_with_bert_tokenizer_generates_like_transformers(gpt2_bert_dir: Path) -> None:
    assert not (gpt2_bert_dir / "tokenizer.json").exists()
    assert json.loads((gpt2_bert_dir / "config.json").read_text())["model_type"] == "gpt2"
    model, tokenizer = kvgen.load_model(gpt2_bert_dir)
    ref_tokenizer = BertTokenizer(str(gpt2_bert_dir / "vocab.txt"), do_lower_case=True)
    ref_model = GPT2LMHeadModel.from_pretrained(gpt2_bert_dir).eval()
    for text in ("你好，世界！Hello", "The WEATHER is fine, 天气很不错"):
        ids = tokenizer.encode(text)
        assert ids == ref_tokenizer.encode(text)
        input_ids = torch.tensor([ids])
        out = kvgen.generate(model, input_ids, None, GenerationConfig(max_new_tokens=12, pad_token_id=0))
        with torch.inference_mode():
            expected = ref_model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=12,
                do_sample=False, pad_token_id=ref_tokenizer.pad_token_id,
            )
        assert out.sequences.tolist() == expected.tolist()
        new_ids = expected[0, len(ids) :].tolist()
        for skip in (True, False):
            assert tokenizer.decode(new_ids, skip_special_tokens=skip) == ref_tokenizer.decode(
                new_ids, skip_special_tokens=skip
            )
    assert tokenizer.eos_token_ids == [ref_tokenizer.sep_token_id]


def test_engine_on_gpt2_with_bert_tokenizer_matches_generate(gpt2_bert_dir: Path) -> None:
    """The engine's streamed text (IncrementalDetokenizer with clean-up) equals BertTokenizer's decode."""
    model, tokenizer = kvgen.load_model(gpt2_bert_dir)
    ref_tokenizer = BertTokenizer(str(gpt2_bert_dir / "vocab.txt"), do_lower_case=True)
    ids = tokenizer.encode("it's fine, 你好", add_special_tokens=False)
    llm = kvgen.LLM(model, tokenizer)
    params = kvgen.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    (output,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    completion = output.outputs[0]
    reference = kvgen.generate(model, torch.tensor([ids]), None, GenerationConfig(max_new_tokens=12, pad_token_id=0))
    assert completion.token_ids == reference.sequences[0, len(ids) :].tolist()
    expected = ref_tokenizer.decode(ids + completion.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    head = ref_tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert completion.text == BertTokenizer.clean_up_tokenization(expected[len(head) :])


# phi3: qkv_proj / gate_up_proj stacked in the checkpoint; smollm3: layer 1 without RoPE (the kernels' use_rope flags)
@pytest.mark.parametrize("model_type", ["llama", "phi3", "smollm3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_16_bit_llama_checkpoint_runs_its_matrices_as_stored(tmp_path: Path, dtype: torch.dtype,
                                                               model_type: str) -> None:
    """A float16 / bfloat16 checkpoint (as most on the Hub) loads with ``dtype="auto"`` onto the 16-bit kernels, its
    matrices as stored; the logits are transformers' on the same (16-bit) weights within float rounding, and
    ``dtype="float32"`` is still the dense reference path. A float32 checkpoint stays dense under auto."""
    import transformers

    from kvgen.generation.runner import make_cache
    from kvgen.kernels import BF16, F16
    from kvgen.models.quant_linear import QuantLinear

    src = save_tiny_model_dir(tmp_path / "f32", model_type=model_type, std=0.5)
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, torch_dtype=dtype)
    ref.save_pretrained(tmp_path / "half", safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / "half" / name)
    model, tok = load_model(tmp_path / "half")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.weight_type == (F16 if dtype == torch.float16 else BF16)
    dense, _ = load_model(tmp_path / "half", dtype="float32")
    assert not isinstance(dense.model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert not isinstance(load_model(src)[0].model.layers[0].self_attn.qkv_proj, QuantLinear)
    ids = torch.tensor([tok.encode("Name three colours: red, green and blue.")])
    with torch.inference_mode():
        want = ref.float()(input_ids=ids).logits[0]
        got = model.compute_logits(model(ids, torch.arange(ids.shape[1])[None]))[0]
        exact = dense.compute_logits(dense(ids, torch.arange(ids.shape[1])[None]))[0]
    torch.testing.assert_close(exact, want, rtol=1e-4, atol=1e-4)  # the reference path: the 16-bit weights, exactly
    # the kernels: the same weights, K and V at fp16 precision
    assert float((got - want).abs().max()) < 0.01 * float(want.abs().max())
    # with a static cache every layer runs in one op (NoPE flags included): the layer-by-layer path's bits
    assert model._decoder_operands is not None
    assert model._decoder_operands.layer_args == ([1, 0, 0, 0] if model_type == "smollm3" else [])
    runs = []
    for one_op in (True, False):
        model.one_op_decoder, cache = one_op, make_cache(model, "static", 1, ids.shape[1] + 1)
        with torch.inference_mode():
            runs.append(model(ids, torch.arange(ids.shape[1])[None], cache))
    model.one_op_decoder = True
    assert torch.equal(*runs)
    torch.testing.assert_close(model.compute_logits(runs[0])[0], got, rtol=0, atol=0.01 * float(want.abs().max()))


def test_the_load_runs_in_a_thread_that_has_ended_when_it_returns(tiny_model_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The load's OpenMP team ends with its thread (see load_model); its errors reach the caller unchanged."""
    built_in: list[threading.Thread] = []
    build = kvgen.loader.build_model
    monkeypatch.setattr(kvgen.loader, "build_model", lambda *a: built_in.append(threading.current_thread()) or build(*a))
    model, _ = load_model(tiny_model_dir)
    assert len(built_in) == 1 and built_in[0] is not threading.current_thread() and not built_in[0].is_alive()
    assert model.config.vocab_size > 0
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        load_model(tiny_model_dir / "no-such-model.gguf")


def test_ctrl_c_during_a_load_does_not_wait_for_the_load() -> None:
    """The load thread is a daemon and the wait is interruptible: SIGINT ends a 60-s load at once."""
    code = ("import sys, time\nimport kvgen.loader\nkvgen.loader._load_model = lambda *a: time.sleep(60)\n"
            "print('loading', flush=True)\ntry:\n    kvgen.loader.load_model('default')\n"
            "except KeyboardInterrupt:\n    sys.exit(3)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "loading"
        time.sleep(0.5)  # into thread.join()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 3  # not the load's 60 s
    finally:
        proc.kill()


def test_freed_heap_memory_goes_back_to_the_os() -> None:
    """kvgen.heap.return_freed_memory (run while a model loads) gives back the holes that freed blocks leave between
    kept ones: 100 MiB freed in 100 kB pieces (below malloc's mmap threshold, so on the heap) stays resident until it
    runs."""
    code = """
import psutil
from kvgen.heap import return_freed_memory
rss = lambda: psutil.Process().memory_info().rss
blocks = [bytearray(b"x" * 100_000) for _ in range(2000)]  # 200 MB, written (resident)
del blocks[::2]  # every other one freed: 100 MB of holes between the kept ones
before = rss()
print(return_freed_memory(), (before - rss()) / 2**20)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    if out[0] == "False":
        pytest.skip("no malloc_trim in this C library")
    assert float(out[1]) > 50, f"only {out[1]} MiB went back"


def test_trims_wait_for_16_mib_of_freed_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Callers that say what they freed trim once 16 MiB have been (a load of many small expert matrices would
    otherwise spend a tenth of its time trimming); a call without a count trims at once."""
    from kvgen import heap

    if not heap.return_freed_memory():
        pytest.skip("no malloc_trim in this C library")
    assert not heap.return_freed_memory(10 << 20) and not heap.return_freed_memory(5 << 20)  # 15 MiB so far
    assert heap.return_freed_memory(2 << 20)  # 17 MiB: trimmed, the count starts again
    assert not heap.return_freed_memory(1 << 20)
    assert heap.return_freed_memory()


# --- model paths that are not a file or a directory -------------------------------------------------------------------


def _load_in_thread(path: Path, seconds: float = 20.0) -> BaseException | None:
    """load_model(path) in a daemon thread: the error it raised (None if it loaded); fails if it is still running
    after ``seconds`` (a FIFO blocks in open() until a writer comes, which one then does to end the thread)."""
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            load_model(path)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 -- handed to the test
            outcome.append(e)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # a writer: the blocked open() returns
        pytest.fail(f"load_model({path}) was still running after {seconds} s")
    return outcome[0]


def test_a_fifo_is_refused_without_opening_it(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "m.gguf")
    error = _load_in_thread(tmp_path / "m.gguf")
    assert isinstance(error, ModelFormatError), error
    assert str(tmp_path / "m.gguf") in str(error) and "neither a regular file nor a directory" in str(error)


def test_a_unix_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.gguf"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        with pytest.raises(ModelFormatError, match="neither a regular file nor a directory") as info:
            load_model(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(("make", "message"), [
    (lambda d: d / ("a" * 300 + ".gguf"), "cannot be read: File name too long"),
    (lambda d: d / "/".join(["b" * 200] * 30), "cannot be read: File name too long"),
    (lambda d: (d / "loop").symlink_to(d / "loop") or d / "loop", "is a symlink loop"),
], ids=["name-too-long", "path-too-long", "symlink-loop"])
def test_paths_the_os_cannot_look_up_are_named(tmp_path: Path, make, message: str) -> None:
    path = make(tmp_path)
    with pytest.raises(ModelFormatError, match=message) as info:
        kvgen.loader.resolve_model_path(path)
    assert str(path) in str(info.value)


def test_a_missing_path_is_still_not_found(tmp_path: Path) -> None:
    (tmp_path / "dangling").symlink_to(tmp_path / "absent")
    for path in (tmp_path / "absent.gguf", tmp_path / "dangling", tmp_path / "absent" / "x.gguf"):
        with pytest.raises(ModelNotFoundError, match="model not found"):
            kvgen.loader.resolve_model_path(path)


def test_an_empty_path_is_refused_not_the_working_directory(tiny_model_dir: Path, monkeypatch) -> None:
    """Path("") is "."; `kvgen generate -m ""` in a model's directory loaded that model (transformers'
    from_pretrained("") refuses the empty name)."""
    monkeypatch.chdir(tiny_model_dir)
    with pytest.raises(ModelNotFoundError, match="model path must not be empty"):
        kvgen.loader.resolve_model_path("")


@pytest.mark.parametrize("bad", [None, 5, b"default"])
def test_a_path_that_is_no_str_or_path_is_named(bad: object) -> None:
    """load_model(None) died with pathlib's TypeError ("expected str, bytes or os.PathLike object")."""
    with pytest.raises(ValueError, match=f"path_or_name must be 'default', .*got {bad!r}"):
        kvgen.load_model(bad)  # type: ignore[arg-type]


def test_a_repo_id_in_the_local_hugging_face_cache_loads_its_snapshot(tiny_model_dir: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvgen generate -m org/name`` finds a model transformers or vLLM cached before, as their from_pretrained
    does offline; it was "model not found". A repo id the cache lacks is still not found, a local directory of that
    name wins, and nothing touches the network (every connection refused here)."""
    import huggingface_hub.constants
    from transformers import AutoConfig

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(tiny_model_dir, snapshot)
    (snapshot / "1_Pooling").mkdir()  # sentence-transformers' pooling, read from the snapshot too
    (snapshot / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    reference = AutoConfig.from_pretrained("org/tiny", cache_dir=tmp_path / "hub", local_files_only=True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a network connection was attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    assert kvgen.loader.resolve_model_path("org/tiny") == snapshot
    model, tok = load_model("org/tiny")
    assert model.config.vocab_size == reference.vocab_size
    assert tok.encode("hello") == load_model(tiny_model_dir)[1].encode("hello")
    with pytest.raises(ModelNotFoundError, match="not found: org/absent .*local Hugging Face cache"):
        kvgen.loader.resolve_model_path("org/absent")
    llm = kvgen.LLM("org/tiny", tokenizer="org/tiny", num_blocks=16)  # vLLM's tokenizer= takes a repo id too
    assert llm.get_tokenizer() is not None and llm.get_tokenizer().encode("hello") == tok.encode("hello")
    assert llm.llm_engine.pooling_type == "mean"  # it was "last": the engine looked for 1_Pooling under "org/tiny"
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_model_dir, tmp_path / "org" / "tiny")
    assert kvgen.loader.resolve_model_path("org/tiny") == Path("org/tiny")


def test_subpackages_are_reachable_after_a_plain_import_kvgen():
    """README names kvgen.generation.make_cache, kvgen.kernels.kernel_isa() and kvgen.engine after ``import kvgen``;
    the lazy package raised "module 'kvgen' has no attribute 'generation'" until something imported them."""
    code = ("import kvgen\n"
            "print(kvgen.generation.make_cache.__name__, kvgen.kernels.kernel_isa.__name__, "
            "kvgen.engine.StructuredOutputsParams.__name__)\n"
            "try:\n    kvgen.no_such_name\nexcept AttributeError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["make_cache kernel_isa StructuredOutputsParams",
                                        "module 'kvgen' has no attribute 'no_such_name'"]
