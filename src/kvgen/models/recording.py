"""What a forward computes on the way to its output: each decoder layer's input hidden states and attention
weights (transformers' ``output_hidden_states`` / ``output_attentions``; DoLa's early exits).

A :class:`ForwardRecorder` is opened around a stretch of generation (``with recorder:``) and records only the
forwards run inside ``recorder.forward()``, so a model call made meanwhile for another purpose (classifier-free
guidance's unconditional branch) leaves no trace. Hidden states come from hooks on the decoder layers (the kernel
path's ``forward_kernels`` included; the one-op decoder is off while a recorder is open, its numbers are the same);
attention weights from :func:`kvgen.models.attention.attend` / ``attend_rows``, which ask :data:`RECORDER` after
storing the keys.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvgen.kv_cache.sdpa import attention_probs

if TYPE_CHECKING:  # models.base imports models.attention, which imports this module
    from kvgen.models.base import CausalLM


@dataclass
class ForwardRecord:
    """One forward's recordings, each tensor's rows in the batch order of that forward.

    hidden_states: layer index i -> the hidden state entering layer i, [B, T, C] (0: the embeddings, as transformers'
    ``hidden_states[i]``); index L (the layer count) -> the model's output after the final norm.
    attentions: layer index -> attention weights [B, H, T, S] float32 over the S cached slots after the forward.
    """

    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)
    attentions: dict[int, torch.Tensor] = field(default_factory=dict)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep rows ``rows [B']`` of every tensor (a prompt's prefill copied into its beams or samples)."""
        for recorded in (self.hidden_states, self.attentions):
            for i, x in recorded.items():
                recorded[i] = x.index_select(0, rows)


# The recorder whose forward is running in this context (thread, task), asked by the attention functions.
RECORDER: ContextVar[ForwardRecorder | None] = ContextVar("kvgen_forward_recorder", default=None)


def decoder_layers(model: CausalLM) -> nn.ModuleList:
    """The model's stack of decoder layers (the ModuleList of ``config.num_hidden_layers`` modules). Raises
    ``NotImplementedError`` for a model without one."""
    num_layers = model.config.num_hidden_layers
    found = next((m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == num_layers), None)
    if found is None:
        raise NotImplementedError(f"no stack of {num_layers} decoder layers found in {type(model).__name__}")
    return found


class ForwardRecorder:
    """Records the forwards of ``model`` run inside :meth:`forward` while the recorder is open (``with``).

    layers: the decoder layers whose input hidden states are kept; ``final``: also the output after the final
    norm; ``attentions``: every layer's attention weights. ``keep_steps`` False keeps only the latest forward in
    ``steps`` (DoLa reads each step once). Tensors are copies (the kernel path overwrites its rows in place).
    """

    def __init__(self, model: CausalLM, layers: Iterable[int] = (), final: bool = False, attentions: bool = False,
                 keep_steps: bool = True) -> None:
        self.model, self.layers, self.final, self.attentions = model, sorted(set(layers)), final, attentions
        self.keep_steps = keep_steps
        self.steps: list[ForwardRecord] = []
        self._current: ForwardRecord | None = None
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> ForwardRecorder:
        stack, model = decoder_layers(self.model), self.model
        one_op = model.one_op_decoder
        model.one_op_decoder = False  # layer by layer: the hooks below see every layer
        self._undo.append(lambda: setattr(model, "one_op_decoder", one_op))
        for i in self.layers:
            self._hook_layer(stack[i], i)
        if self.attentions:
            token: Token[ForwardRecorder | None] = RECORDER.set(self)
            self._undo.append(lambda: RECORDER.reset(token))
        return self

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            self._undo.pop()()

    def _hook_layer(self, layer: nn.Module, i: int) -> None:
        """Keep layer i's input: x [B, T, C] of its module call, or the kernel path's rows [B T, C]."""
        def keep(x: torch.Tensor) -> None:
            if self._current is not None:
                self._current.hidden_states[i] = x.clone()

        hook = layer.register_forward_pre_hook(lambda _m, args: keep(args[0]))
        self._undo.append(hook.remove)
        run: Any = getattr(layer, "forward_kernels", None)
        if run is not None:
            def forward_kernels(rows: torch.Tensor, batch: int, *args: Any) -> Any:
                keep(rows.view(batch, -1, rows.shape[-1]))
                return run(rows, batch, *args)

            setattr(layer, "forward_kernels", forward_kernels)  # noqa: B010 -- an instance attribute over the method
            self._undo.append(lambda: delattr(layer, "forward_kernels"))

    @contextlib.contextmanager
    def forward(self) -> Iterator[ForwardRecord]:
        """Record the model calls made inside: one :class:`ForwardRecord`, appended to ``steps``."""
        record = ForwardRecord()
        self.steps = [*self.steps, record] if self.keep_steps else [record]
        self._current = record
        try:
            yield record
        finally:
            self._current = None

    def output(self, record: ForwardRecord, hidden: torch.Tensor) -> None:
        """Keep the model's output hidden [B, T, C] (after the final norm) in ``record`` when ``final``."""
        if self.final:
            record.hidden_states[self.model.config.num_hidden_layers] = hidden.clone()

    def attention(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
                  scale: float | None, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> None:
        """Keep layer ``layer_idx``'s attention weights (:func:`kvgen.kv_cache.sdpa.attention_probs`) while a
        recorded forward runs: q [B, H, T, D]; k [B, Hkv, S, D] every cached key (any float dtype); mask
        [B|1, 1, T, S] bool, or None (causal when T > 1, else every key)."""
        if self._current is None:
            return
        t = q.shape[2]
        self._current.attentions[layer_idx] = attention_probs(
            q, k.to(q.dtype), mask, mask is None and t > 1, scale, softcap, sinks)  # [B, H, T, S]

    def hidden_states_per_step(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Per recorded forward, the recorded layers' inputs then the output (when ``final``): transformers'
        ``GenerateOutput.hidden_states`` when every layer is recorded."""
        last = [self.model.config.num_hidden_layers] if self.final else []
        return tuple(tuple(step.hidden_states[i] for i in [*self.layers, *last]) for step in self.steps)

    def attentions_per_step(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Per recorded forward, every layer's attention weights: transformers' ``GenerateOutput.attentions``."""
        return tuple(tuple(step.attentions[i] for i in sorted(step.attentions)) for step in self.steps)
