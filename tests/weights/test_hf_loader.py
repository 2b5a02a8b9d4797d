"""HF checkpoint directories: tiny random GPT-2 and Llama saved by transformers, loaded by kvgen.

The reference is the transformers model's own ``state_dict()``, mapped to our
layout independently of kvgen's name maps: GPT-2's ``Conv1D`` modules (found by
type, not by name) are transposed, tied ``lm_head.weight`` is dropped.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import hf_params_in_kvgen_layout, make_tiny_model, model_logits
from safetensors.torch import load_file, save_file
from transformers import GPT2LMHeadModel, LlamaForCausalLM
from transformers.pytorch_utils import Conv1D

from kvgen.errors import (
    ModelFormatError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)
from kvgen.weights.hf_loader import load_hf_directory


def _tiny_gpt2() -> GPT2LMHeadModel:
    """transformers' tiny GPT-2 (vocab 128, 32 positions), every parameter random."""
    return make_tiny_model("gpt2", vocab_size=128, max_position_embeddings=32).ref


def _tiny_llama(tied: bool, bias: bool = False) -> LlamaForCausalLM:
    return make_tiny_model("llama", tie=tied, bias=bias, vocab_size=128, seed=1).ref


def _expected(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The transformers model's parameters in our layout: [out, in] matrices, no tied lm_head."""
    has_conv1d = any(isinstance(m, Conv1D) for m in model.modules())
    assert has_conv1d == isinstance(model, GPT2LMHeadModel)  # the GPT-2 reference exercises the transpose
    return hf_params_in_kvgen_layout(model)


def _assert_same(ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    assert sorted(ours) == sorted(expected)
    for name, want in expected.items():
        assert ours[name].dtype == dtype, name
        assert ours[name].is_contiguous(), name
        if not torch.equal(ours[name], want.to(dtype)):
            torch.testing.assert_close(ours[name], want.to(dtype), rtol=0, atol=0, msg=name)


def _save(model: torch.nn.Module, path: Path, sharded: bool) -> Path:
    kwargs = {"max_shard_size": "50KB"} if sharded else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    if sharded:
        assert (path / "model.safetensors.index.json").is_file() and not (path / "model.safetensors").exists()
        assert len(list(path.glob("model-*.safetensors"))) > 2
    return path


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_gpt2_matches_transformers(tmp_path: Path, sharded: bool) -> None:
    model = _tiny_gpt2()
    config, state = load_hf_directory(_save(model, tmp_path / "gpt2", sharded))
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("gpt2", 64, 2)
    assert config.tie_word_embeddings
    _assert_same(state, _expected(model), torch.float32)
    assert state["transformer.h.0.attn.c_attn.weight"].shape == (3 * 64, 64)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_llama_matches_transformers(tmp_path: Path, tied: bool, sharded: bool) -> None:
    model = _tiny_llama(tied)
    config, state = load_hf_directory(_save(model, tmp_path / "llama", sharded))
    assert config.tie_word_embeddings is tied
    assert ("lm_head.weight" in state) is (not tied)
    _assert_same(state, _expected(model), torch.float32)


def test_llama_with_biases(tmp_path: Path) -> None:
    model = _tiny_llama(tied=True, bias=True)
    config, state = load_hf_directory(_save(model, tmp_path / "llama", sharded=False))
    assert config.attention_bias and config.mlp_bias
    assert "model.layers.1.self_attn.k_proj.bias" in state and "model.layers.0.mlp.down_proj.bias" in state
    _assert_same(state, _expected(model), torch.float32)


def test_phi3_stacked_projections_load_as_stored(tmp_path: Path) -> None:
    """Phi-3 checkpoints hold qkv_proj (rows q, k, v) and gate_up_proj (gate, then up) already stacked: they load
    under those names, shapes checked ([(H + 2 Hkv) D, C], [2I, C]); a split q/k/v or a missing stacked matrix is
    listed."""
    model = make_tiny_model("phi3", kv_heads=2, vocab_size=128, seed=2).ref
    path = _save(model, tmp_path / "phi3", sharded=True)
    config, state = load_hf_directory(path)
    assert config.extra["hf_model_type"] == "phi3" and not config.tie_word_embeddings
    _assert_same(state, _expected(model), torch.float32)
    assert state["model.layers.1.self_attn.qkv_proj.weight"].shape == ((4 + 2 * 2) * 16, 64)
    assert state["model.layers.1.mlp.gate_up_proj.weight"].shape == (2 * 128, 64)
    single = _save(model, tmp_path / "single", sharded=False)
    tensors = load_file(single / "model.safetensors")
    q, k, v = tensors.pop("model.layers.0.self_attn.qkv_proj.weight").split([64, 32, 32])
    tensors |= {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
                "model.layers.0.self_attn.v_proj.weight": v}
    save_file(tensors, single / "model.safetensors", metadata={"format": "pt"})
    missing = r"missing keys \(1\): model.layers.0.self_attn.qkv_proj.weight \| unexpected keys \(3\)"
    with pytest.raises(ModelFormatError, match=missing):
        load_hf_directory(single)


def test_bfloat16(tmp_path: Path) -> None:
    model = _tiny_gpt2()
    _, state = load_hf_directory(_save(model, tmp_path / "gpt2", sharded=True), dtype=torch.bfloat16)
    _assert_same(state, _expected(model), torch.bfloat16)


def test_lm_head_saved_with_tied_embeddings_is_dropped(tmp_path: Path) -> None:
    model = _tiny_llama(tied=True)
    path = _save(model, tmp_path / "llama", sharded=False)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path / "model.safetensors")
    _, state = load_hf_directory(path)
    assert "lm_head.weight" not in state
    _assert_same(state, _expected(model), torch.float32)


def test_openai_style_gpt2_keys_and_buffers(tmp_path: Path) -> None:
    """Keys without ``transformer.`` (as in the original gpt2 checkpoint), with saved mask buffers."""
    model = _tiny_gpt2()
    path = _save(model, tmp_path / "gpt2", sharded=False)
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(path / "model.safetensors").items()}
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    tensors["lm_head.weight"] = tensors["wte.weight"].clone()
    assert "h.0.attn.c_attn.weight" in tensors
    save_file(tensors, path / "model.safetensors")
    _, state = load_hf_directory(path)
    _assert_same(state, _expected(model), torch.float32)



def test_llama_saved_rotary_inv_freq_buffers_are_ignored_as_transformers_ignores_them(tmp_path: Path) -> None:
    """Older Llama checkpoints saved each layer's ``self_attn.rotary_emb.inv_freq``: transformers' from_pretrained
    loads such a directory with the same parameters, and so does kvgen."""
    model = _tiny_llama(tied=False)
    path = _save(model, tmp_path / "llama", sharded=False)
    tensors = load_file(path / "model.safetensors")
    for i in range(model.config.num_hidden_layers):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = model.model.rotary_emb.inv_freq.clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    reloaded = LlamaForCausalLM.from_pretrained(path)
    _, state = load_hf_directory(path)
    _assert_same(state, _expected(reloaded), torch.float32)
    _assert_same(state, _expected(model), torch.float32)

@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_pytorch_model_bin_loads_as_transformers_loads_it(tmp_path: Path, arch: str, sharded: bool) -> None:
    """``pytorch_model.bin`` (and its sharded index), which transformers' from_pretrained falls back to without
    safetensors files, as older checkpoints ship; it was refused."""
    model = _tiny_gpt2() if arch == "gpt2" else _tiny_llama(tied=False)
    model.save_pretrained(tmp_path, safe_serialization=False, **({"max_shard_size": "50KB"} if sharded else {}))
    index = tmp_path / "pytorch_model.bin.index.json"
    assert (index.is_file() and len(list(tmp_path.glob("pytorch_model-*.bin"))) > 2) if sharded else (
        tmp_path / "pytorch_model.bin").is_file()
    assert not list(tmp_path.glob("*.safetensors"))
    reference = type(model).from_pretrained(tmp_path)  # transformers reads the same files
    _, state = load_hf_directory(tmp_path)
    _assert_same(state, _expected(reference), torch.float32)


def test_a_pytorch_checkpoint_that_would_run_code_is_refused(tmp_path: Path) -> None:
    """Unpickled weights-only, as transformers reads it: an object whose unpickling calls a function is named, and
    nothing runs."""
    _tiny_gpt2().save_pretrained(tmp_path, safe_serialization=False)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple:
            return (Path.touch, (marker,))

    torch.save({"transformer.wte.weight": torch.zeros(2), "x": Payload()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelFormatError, match="is not a weights-only PyTorch checkpoint") as info:
        load_hf_directory(tmp_path)
    assert "pytorch_model.bin" in str(info.value) and not marker.exists()
    (tmp_path / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(ModelFormatError, match="is not a readable PyTorch checkpoint"):
        load_hf_directory(tmp_path)
    torch.save([torch.zeros(2)], tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelFormatError, match="does not hold a state dict"):
        load_hf_directory(tmp_path)


@pytest.mark.parametrize("zip_format", [False, True])
def test_a_corrupt_pytorch_checkpoint_is_always_a_model_format_error(tmp_path: Path, zip_format: bool) -> None:
    """Bytes of a checkpoint changed one at a time: each load either gives the tensors or a ModelFormatError naming
    the file (transformers: "Unable to load weights from pytorch checkpoint file"). KeyError, AssertionError,
    IndexError and TypeError from the unpickler escaped as internal errors."""
    import io
    import random

    from kvgen.weights.torch_bin import TorchCheckpoint

    state = {"a.weight": torch.arange(6.0).view(2, 3), "b.bias": torch.ones(3)}
    buffer = io.BytesIO()
    torch.save(state, buffer, _use_new_zipfile_serialization=zip_format)
    original, rng, path = buffer.getvalue(), random.Random(1), tmp_path / "pytorch_model.bin"
    num_refused = 0
    for _ in range(300):
        corrupt = bytearray(original)
        corrupt[rng.randrange(min(len(corrupt), 1500))] = rng.randrange(256)
        path.write_bytes(bytes(corrupt))
        try:
            TorchCheckpoint(path)
        except ModelFormatError as e:
            assert str(path) in str(e)
            num_refused += 1
    assert num_refused > 0  # the corruptions reached the unpickler's error paths, not only unread bytes


@pytest.mark.parametrize("sharded", [False, True])
def test_each_pytorch_checkpoint_file_is_unpickled_once_per_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 sharded: bool) -> None:
    """The header, plan and read passes each unpickled every .bin file (a legacy, non-zip one read whole three
    times); one load now unpickles each once, with the same tensors."""
    model = _tiny_gpt2()
    model.save_pretrained(tmp_path, safe_serialization=False, **({"max_shard_size": "50KB"} if sharded else {}))
    calls: list[str] = []
    load = torch.load

    def counted(file, *args, **kwargs):
        calls.append(str(file))
        return load(file, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counted)
    _, state = load_hf_directory(tmp_path)
    assert sorted(calls) == sorted(str(f) for f in tmp_path.glob("pytorch_model*.bin"))
    _assert_same(state, _expected(model), torch.float32)


def test_safetensors_win_over_pytorch_weights_as_in_transformers(tmp_path: Path) -> None:
    model = _tiny_gpt2()
    model.save_pretrained(tmp_path, safe_serialization=True)
    torch.save({"garbage": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    _, state = load_hf_directory(tmp_path)
    _assert_same(state, _expected(model), torch.float32)


# --- bad input ---------------------------------------------------------------


@pytest.fixture()
def gpt2_dir(tmp_path: Path) -> Path:
    return _save(_tiny_gpt2(), tmp_path / "gpt2", sharded=False)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not found") as info:
        load_hf_directory(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(info.value)


def test_file_instead_of_directory(gpt2_dir: Path) -> None:
    with pytest.raises(ModelFormatError, match="not a directory"):
        load_hf_directory(gpt2_dir / "config.json")


def test_missing_config(gpt2_dir: Path) -> None:
    (gpt2_dir / "config.json").unlink()
    with pytest.raises(ModelFormatError, match="no config.json") as info:
        load_hf_directory(gpt2_dir)
    assert str(gpt2_dir / "config.json") in str(info.value)


def test_invalid_config_json(gpt2_dir: Path) -> None:
    (gpt2_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="cannot read .*config.json"):
        load_hf_directory(gpt2_dir)


def test_unsupported_model_type(gpt2_dir: Path) -> None:
    cfg = json.loads((gpt2_dir / "config.json").read_text())
    cfg["model_type"] = "falcon"
    (gpt2_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="falcon"):
        load_hf_directory(gpt2_dir)


def test_missing_weights(gpt2_dir: Path) -> None:
    (gpt2_dir / "model.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="has no weights") as info:
        load_hf_directory(gpt2_dir)
    assert str(gpt2_dir) in str(info.value) and "model.safetensors" in str(info.value)


@pytest.mark.parametrize("how", ["garbage", "truncated_header", "truncated_data"])
def test_corrupt_safetensors(gpt2_dir: Path, how: str) -> None:
    path = gpt2_dir / "model.safetensors"
    data = path.read_bytes()
    if how == "garbage":
        path.write_bytes(b"this is not a safetensors file at all" * 10)
    elif how == "truncated_header":
        path.write_bytes(data[:100])
    else:
        path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelFormatError) as info:
        load_hf_directory(gpt2_dir)
    assert str(path) in str(info.value)


def test_missing_and_unexpected_keys_are_listed(gpt2_dir: Path) -> None:
    path = gpt2_dir / "model.safetensors"
    tensors = load_file(path)
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    del tensors["transformer.ln_f.weight"]
    tensors["transformer.h.0.attn.extra.weight"] = torch.zeros(3)
    save_file(tensors, path)
    with pytest.raises(ModelFormatError) as info:
        load_hf_directory(gpt2_dir)
    msg = str(info.value)
    assert "missing keys (2): transformer.h.1.mlp.c_fc.bias, transformer.ln_f.weight" in msg
    assert "unexpected keys (1): transformer.h.0.attn.extra.weight" in msg
    assert str(gpt2_dir) in msg


def test_untied_llama_without_lm_head(tmp_path: Path) -> None:
    path = _save(_tiny_llama(tied=False), tmp_path / "llama", sharded=False)
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelFormatError, match=r"missing keys \(1\): lm_head.weight"):
        load_hf_directory(path)


def test_shape_mismatch(gpt2_dir: Path) -> None:
    path = gpt2_dir / "model.safetensors"
    tensors = load_file(path)
    tensors["transformer.wpe.weight"] = torch.zeros(16, 64)
    save_file(tensors, path)
    with pytest.raises(ModelFormatError, match=r"transformer.wpe.weight: expected \[32, 64\], got \[16, 64\]"):
        load_hf_directory(gpt2_dir)


def test_index_with_missing_shard(tmp_path: Path) -> None:
    path = _save(_tiny_gpt2(), tmp_path / "gpt2", sharded=True)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelFormatError, match="shards that do not exist") as info:
        load_hf_directory(path)
    assert str(shard) in str(info.value)


def test_index_naming_a_key_the_shard_lacks(tmp_path: Path) -> None:
    path = _save(_tiny_gpt2(), tmp_path / "gpt2", sharded=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["transformer.wte.weight"]
    index["weight_map"]["transformer.h.9.ln_1.weight"] = shard
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match="transformer.h.9.ln_1.weight") as info:
        load_hf_directory(path)
    assert shard in str(info.value)


def test_only_listed_shards_are_read(tmp_path: Path) -> None:
    """A stray safetensors file next to the index (e.g. an older export) is not loaded."""
    model = _tiny_gpt2()
    path = _save(model, tmp_path / "gpt2", sharded=True)
    shutil.copy(next(path.glob("model-*.safetensors")), path / "stray.safetensors")
    save_file({"transformer.h.0.bogus": torch.zeros(1)}, path / "model-99999-of-99999.safetensors")
    _, state = load_hf_directory(path)
    _assert_same(state, _expected(model), torch.float32)


def _edit_config(directory: Path, **changes: object) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(cfg | changes))


@pytest.mark.parametrize(("model_type", "key"), [("gpt2", "n_layer"), ("llama", "num_hidden_layers"),
                                                 ("smollm3", "num_hidden_layers")])
def test_a_layer_count_beyond_the_checkpoint_is_refused_before_building_layers(tmp_path: Path, model_type: str,
                                                                              key: str) -> None:
    """10^9 layers ran into MemoryError (smollm3: building its per-layer NoPE flags) instead of a clean error."""
    directory = _save(_tiny_gpt2() if model_type == "gpt2" else _tiny_llama(tied=False), tmp_path / "m", False)
    _edit_config(directory, **{key: 10**9} | ({"model_type": model_type} if model_type != "gpt2" else {}))
    with pytest.raises(ModelFormatError, match=rf"config.json {key} must be at most the 2 layers whose tensors "
                                               rf".* holds, got 1000000000"):
        load_hf_directory(directory)


@pytest.mark.parametrize("shard", [5, None, "", "../outside.safetensors", "OUTSIDE"], ids=["int", "null", "empty",
                                                                                           "dotdot", "absolute"])
def test_index_shards_must_be_files_inside_the_directory(tmp_path: Path, shard: object) -> None:
    """A non-string shard escaped as TypeError; a shard outside the directory (a valid copy of the real one here)
    was read."""
    path = _save(_tiny_gpt2(), tmp_path / "gpt2", sharded=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    real = path / index["weight_map"]["transformer.wte.weight"]
    shutil.copy(real, tmp_path / "outside.safetensors")
    shard = str(tmp_path / "outside.safetensors") if shard == "OUTSIDE" else shard
    for key, name in index["weight_map"].items():
        if name == real.name:
            index["weight_map"][key] = shard
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match=r"weight_map\[.*\] must name a file inside .*gpt2, got ") as info:
        load_hf_directory(path)
    assert repr(shard) in str(info.value)


def test_a_shard_linked_from_elsewhere_loads(tmp_path: Path) -> None:
    """The Hugging Face cache's layout: the snapshot's shards are links to blobs outside it."""
    model = _tiny_gpt2()
    path = _save(model, tmp_path / "gpt2", sharded=True)
    (tmp_path / "blobs").mkdir()
    for shard in path.glob("model-*.safetensors"):
        shard.rename(tmp_path / "blobs" / shard.name)
        shard.symlink_to(tmp_path / "blobs" / shard.name)
    _, state = load_hf_directory(path)
    _assert_same(state, _expected(model), torch.float32)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool, torch.complex64])
def test_weights_stored_as_non_floats_are_refused(gpt2_dir: Path, dtype: torch.dtype) -> None:
    """They were cast to float32 and loaded (complex64 with a warning only)."""
    tensors = load_file(gpt2_dir / "model.safetensors")
    tensors["transformer.h.0.attn.c_attn.weight"] = torch.ones(tensors["transformer.h.0.attn.c_attn.weight"].shape, dtype=dtype)
    save_file(tensors, gpt2_dir / "model.safetensors")
    with pytest.raises(ModelFormatError, match=r"tensor 'transformer.h.0.attn.c_attn.weight' is stored as (I8|I64|BOOL|C64); "):
        load_hf_directory(gpt2_dir)


def test_a_shard_holding_a_tensor_the_index_places_in_another_is_refused(tmp_path: Path) -> None:
    """Two copies of a tensor: kvgen read the index's shard, transformers (whole shards, the last one winning) the
    other's, and the two gave different logits without a word."""
    model = _tiny_gpt2()
    path = _save(model, tmp_path / "gpt2", sharded=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    first, second = sorted(set(index["weight_map"].values()))[:2]
    key = next(k for k, shard in index["weight_map"].items() if shard == first)
    tensors = load_file(path / second)
    tensors[key] = load_file(path / first)[key] * 0
    save_file(tensors, path / second, metadata={"format": "pt"})
    ref = GPT2LMHeadModel.from_pretrained(path)
    assert not torch.equal(ref.state_dict()[key], model.state_dict()[key])  # transformers took the stray copy
    with pytest.raises(ModelFormatError, match=rf"{second} also holds tensors that model.safetensors.index.json "
                                               rf"places in another shard: '{key}' \(placed in .*{first}\)"):
        load_hf_directory(path)


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "mixtral"])
def test_a_base_model_checkpoint_without_the_model_prefix_loads_as_transformers_does(tmp_path: Path,
                                                                                     model_type: str) -> None:
    """A ``LlamaModel``'s save (keys ``embed_tokens.weight``, ``layers.0...``, ``norm.weight``, tied head): transformers
    loads it into its ForCausalLM, kvgen listed every key as missing and unexpected."""
    from transformers import AutoModelForCausalLM

    from kvgen.models import build_model

    kwargs = {"attn_implementation": "eager"} if model_type == "gemma2" else {}
    make_tiny_model(model_type, tie=True, vocab_size=128, seed=4).ref.model.save_pretrained(tmp_path)
    assert not any(k.startswith("model.") for k in load_file(tmp_path / "model.safetensors"))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, **kwargs).eval()
    config, state = load_hf_directory(tmp_path)
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])  # [1, T]
    with torch.no_grad():
        want = ref(ids).logits  # [1, T, V]
    torch.testing.assert_close(model_logits(build_model(config, state), ids), want, rtol=1e-4, atol=1e-4)
