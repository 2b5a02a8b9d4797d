"""Detokenization: token ids -> text, incrementally and UTF-8 safe, with stop strings.

``IncrementalDetokenizer`` turns a stream of ids into text; ``RequestDetokenizer`` adds one
request's stop strings. Stop strings are matched on the decoded text, across token boundaries.
While a request runs, text that may still grow into a stop string is held back, so streamed
text never contains any part of a matched stop string; the concatenated deltas equal the
final text. ``OutputProcessor`` (:mod:`kvgen.engine.output_processor`) drives them each step.
Source: vLLM v1 ``vllm/v1/engine/detokenizer.py``.
"""

from __future__ import annotations

from kvgen.engine.sampling_params import SamplingParams
from kvgen.sampling.stopping import StopStrings
from kvgen.tokenizer import Tokenizer, check_token_ids
from kvgen.tokenizer.wordpiece import StreamingCleanUp

# Prompt tokens decoded before the first new one (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET), for spacing that depends on context.
DETOKENIZE_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turn a stream of generated ids into text, one finalized piece at a time.

    Decodes a short window (the last emitted tokens plus the new ones) and emits the
    difference, holding text back while it ends in "\\ufffd" (an unfinished UTF-8
    character): O(1) per token. For a tokenizer that cleans up spaces (WordPiece), that
    text then runs through a streaming clean-up, which holds back a possible " '".
    ``"".join(add outputs) + flush()`` equals ``tokenizer.decode(token_ids, skip_special_tokens)``;
    after a prompt, for a space-joining (WordPiece) tokenizer, it is what the ids add to the
    decoded prompt instead: a space before a new word, none before a "##" piece; after a prompt that ends inside a
    character, it begins with that character (as vLLM). Raises ``ValueError`` for a prompt id outside the vocabulary.
    Source: vLLM ``detokenize_incrementally`` (prefix_offset / read_offset).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        context = list(prompt_token_ids or [])[-DETOKENIZE_CONTEXT_TOKENS:]
        check_token_ids(context, tokenizer.vocab_size)
        self._tokenizer = tokenizer
        self._clean_up = StreamingCleanUp() if tokenizer.clean_up_tokenization_spaces else None
        self._skip_special_tokens = skip_special_tokens
        self._ids = context  # prompt context, then generated ids
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset, self._prefix_text = self._finished_prefix(context)
        self._pieces: list[str] = []

    def _finished_prefix(self, context: list[int]) -> tuple[int, str]:
        """(ids, text) of the context up to the prompt's last finished character: a character the prompt leaves
        unfinished (at most 3 UTF-8 bytes, so 3 ids) is emitted whole once the new ids finish it, as vLLM's
        ``DecodeStream`` primed with the prompt does (it was lost: its "\\ufffd" counted as text already shown)."""
        for end in range(len(context), max(len(context) - 4, -1), -1):
            if not (text := self._decode(0, end)).endswith("\ufffd"):
                return end, text
        return len(context), self._decode(0, len(context))

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode_without_clean_up(self._ids[start:end], self._skip_special_tokens)

    def _emit(self, text: str) -> str:
        """Slide the window past ``text`` (final, not cleaned up yet)."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return text

    def _finish(self, text: str, end: bool) -> str:
        """Clean up ``text`` where the tokenizer asks for it and record what comes out."""
        if self._clean_up is not None:
            text = self._clean_up.feed(text) + (self._clean_up.flush() if end else "")
        self._pieces.append(text)
        return text

    def add(self, token_id: int | list[int]) -> str:
        """Append generated id(s); return the text they finalize ("" while a character is unfinished).

        Raises ``ValueError`` for an id outside the vocabulary.
        """
        new_ids = [int(i) for i in token_id] if isinstance(token_id, (list, tuple)) else [int(token_id)]
        check_token_ids(new_ids, self._tokenizer.vocab_size)
        out = []
        for i in new_ids:
            self._ids.append(i)
            text = self._decode(self._prefix_offset, len(self._ids))
            if len(text) > len(self._prefix_text) and not text.endswith("\ufffd"):
                out.append(self._emit(text[len(self._prefix_text) :]))
        return self._finish("".join(out), end=False)

    def flush(self) -> str:
        """Emit whatever is held back (an unfinished character decodes to "\\ufffd")."""
        text = self._decode(self._prefix_offset, len(self._ids))[len(self._prefix_text) :]
        return self._finish(self._emit(text) if text else "", end=True)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    @property
    def token_ids(self) -> list[int]:
        """The generated ids added so far (without the prompt)."""
        return self._ids[self._num_context :]


class RequestDetokenizer:
    """One request's text: incremental decoding, stop strings, streaming hold-back."""

    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: list[int], params: SamplingParams):
        if tokenizer is None and params.stop:
            raise ValueError(f"stop strings need a tokenizer, got stop={params.stop!r} without one")
        skip = params.skip_special_tokens
        self._decoder = None if tokenizer is None else IncrementalDetokenizer(tokenizer, prompt_token_ids, skip)
        # a model's vocabulary may be padded past the tokenizer's: those ids have no text (HF's decode skips them)
        self._vocab_size = 0 if tokenizer is None else tokenizer.vocab_size
        self._stop = StopStrings(tuple(params.stop), params.include_stop_str_in_output) if params.stop else None
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens, self._num_tokens = params.min_tokens, 0  # generated ids so far
        self.has_stop_strings = self._stop is not None
        self.text = ""  # decoded so far; final (cut at the stop string) once is_stopped
        self.is_stopped = False
        self._num_sent = 0  # characters already handed out

    def update(self, new_token_ids: list[int], stop_terminated: bool = False, finished: bool = False) -> str | None:
        """Decode new ids; return the stop string if one now matches (the text is cut there).

        ``stop_terminated``: the last id is EOS or a stop token id, left out of the text unless
        ``include_stop_str_in_output``. ``finished``: no ids follow (decode what is held back). As vLLM (PR
        22014), the text of the first ``min_tokens`` ids is not searched (but for a stop string that ends later).
        """
        assert not self.is_stopped, "update after a stop string matched"
        num_before, self._num_tokens = self._num_tokens, self._num_tokens + len(new_token_ids)
        if stop_terminated and not self._include_stop:
            new_token_ids = new_token_ids[:-1]
        if self._decoder is None:
            return None
        num_held = max(0, self._min_tokens - num_before)  # ids within min_tokens: their text is not searched
        held, rest = self._known(new_token_ids[:num_held]), self._known(new_token_ids[num_held:])
        if held:
            self.text += self._decoder.add(held)
        old_len = len(self.text)
        if rest:
            self.text += self._decoder.add(rest)
        if finished or stop_terminated:
            self.text += self._decoder.flush()
        return None if self._num_tokens <= self._min_tokens else self._match_stop(old_len)

    def _known(self, token_ids: list[int]) -> list[int]:
        """The ids the tokenizer knows (a model may pad its vocabulary past the tokenizer's; HF's decode, and so
        vLLM's text, skips the others)."""
        return [t for t in token_ids if t < self._vocab_size]

    def _match_stop(self, old_len: int) -> str | None:
        match = None if self._stop is None else self._stop.match_new(self.text, old_len)
        if match is None:
            return None
        cut, stop = match
        self.text = self.text[:cut]
        self.is_stopped = True
        return stop

    def _num_streamable(self, finished: bool) -> int:
        if finished or self.is_stopped or self._stop is None:
            return len(self.text)
        return self._stop.num_streamable(self.text)

    def get_text(self, finished: bool) -> str:
        """All text that is safe to show: everything once finished, else minus the hold-back."""
        self._num_sent = max(self._num_sent, self._num_streamable(finished))
        return self.text[: self._num_sent]

    def get_delta(self, finished: bool) -> str:
        """Safe text not handed out yet."""
        end = self._num_streamable(finished)
        assert end >= self._num_sent, "held-back text shrank"
        delta, self._num_sent = self.text[self._num_sent : end], end
        return delta
