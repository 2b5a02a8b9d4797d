"""DoLa decoding on the default model: transformers' tokens on the float32 path, and the kernel path's one-op decoder
left as it was (DoLa runs its layers one by one to read their inputs)."""

from __future__ import annotations

import torch

from kvgen.generation import generate

PROMPT = "The capital of France is"


def test_dola_float32_matches_transformers_on_the_default_model(ours_default, hf_default):
    model, tokenizer = ours_default
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    kwargs = {"max_new_tokens": 12, "dola_layers": "high", "repetition_penalty": 1.2}
    with torch.inference_mode():
        want = hf_default.generate(ids, do_sample=False, pad_token_id=0, **kwargs)[0, ids.shape[1]:].tolist()
    assert generate(model, ids, None, do_sample=False, pad_token_id=0, **kwargs).new_token_ids[0] == want


def test_dola_on_the_kernel_path_restores_the_one_op_decoder(ours_default_auto):
    model, tokenizer = ours_default_auto
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    plain = generate(model, ids, None, max_new_tokens=12, repetition_penalty=1.2, cache_implementation="static")
    dola = [generate(model, ids, None, max_new_tokens=12, repetition_penalty=1.2, cache_implementation="static",
                     dola_layers=[4, 8, 12]).new_token_ids[0] for _ in range(2)]
    assert dola[0] == dola[1] and dola[0] != plain.new_token_ids[0]
    assert model.one_op_decoder and all("forward_kernels" not in vars(layer) for layer in model.model.layers)
    assert generate(model, ids, None, max_new_tokens=12, repetition_penalty=1.2,
                    cache_implementation="static").new_token_ids == plain.new_token_ids
