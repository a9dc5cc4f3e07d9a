"""Incremental detokenization: token ids in, text out, one step at a time, with stop strings.

A token is not always a whole character: a byte-level BPE may split "é" over two tokens, and
decoding the first alone gives "\\ufffd". A detokenizer therefore decodes a small window of
recent tokens and emits text only once it no longer ends in a broken character.

Stop *strings* are checked here too (the engine core only sees token ids): when one appears,
the text is cut before it (or after it, with ``include_stop_str_in_output``). A stream must
never show the start of a stop string that is then cut away, so ``get_next_output_text`` holds
back the last ``max(len(stop)) - 1`` characters until more text (or the end) settles them.

Two decoders share that bookkeeping (vLLM v1's names):

* ``SlowIncrementalDetokenizer``: the classic algorithm over any tokenizer with ``decode``:
  two offsets into the token list, ``prefix_offset`` (where the decoding window starts) and
  ``read_offset`` (tokens before it are already in the text). Each step decodes the window
  twice, without and with the new tokens, and emits the difference: two ``decode`` calls
  per step, each a trip through transformers' Python layer (chapter 07 times it);
* ``FastIncrementalDetokenizer``: the same idea in Rust (``tokenizers.decoders.DecodeStream``),
  for fast tokenizers: the engine's default when the tokenizer has a Rust backend.
"""

from __future__ import annotations

from minivllm.sampling_params import SamplingParams

CONTEXT_TOKENS = 5  # prompt tokens decoded with the first outputs (a leading space needs them)


def _tail(pieces: list[str], n: int) -> str:
    """The last ``n`` characters of the pieces joined, joining only the pieces needed."""
    if n <= 0:
        return ""
    parts, size = [], 0
    for piece in reversed(pieces):
        parts.append(piece)
        size += len(piece)
        if size >= n:
            break
    return "".join(reversed(parts))[-n:]


def find_stop_string(text: str, new_len: int, stops: list[str]) -> tuple[int, str | None]:
    """(index, stop string) of the earliest stop string in ``text``, looking only where the
    last ``new_len`` characters could complete one; (-1, None) if none."""
    best, best_stop = -1, None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best == -1 or i < best):
            best, best_stop = i, stop
    return best, best_stop


class IncrementalDetokenizer:
    """Output text, stop strings and hold-back; subclasses decode (``_decode_new``).

    The front end calls, per engine step of a request:

    * ``update(new_token_ids)``: decode them, append the text, look for a stop string; returns
      the stop string found (the text is then cut at it), else None;
    * ``get_next_output_text(finished, delta)``: the text to hand out now: all of it so far
      (``delta=False``), or only what was not handed out before (``delta=True``); either way
      without the held-back tail while the request is not finished.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.hold_back = (max(map(len, self.stop)) - 1
                          if self.stop and not self.include_stop_str_in_output else 0)
        self.pieces: list[str] = []  # the text, in pieces (joined only when all of it is needed)
        self.num_chars = 0
        self.num_sent_chars = 0  # characters already handed out as deltas

    @property
    def output_text(self) -> str:
        if len(self.pieces) > 1:
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""

    def _decode_new(self, new_token_ids: list[int]) -> str:
        raise NotImplementedError

    def update(self, new_token_ids: list[int]) -> str | None:
        new_text = self._decode_new(new_token_ids)
        if not new_text:
            return None
        self.pieces.append(new_text)
        self.num_chars += len(new_text)
        if not self.stop:
            return None
        # only the end of the text can hold a stop string completed by the new characters
        text = _tail(self.pieces, len(new_text) + max(map(len, self.stop)) - 1)
        i, stop = find_stop_string(text, len(new_text), self.stop)
        if stop is None:
            return None
        end = i + len(stop) if self.include_stop_str_in_output else i
        self._truncate(len(text) - end)
        return stop

    def _truncate(self, cut: int) -> None:
        """Drop the last ``cut`` characters."""
        self.num_chars -= cut
        while cut > 0:
            last = self.pieces.pop()
            if len(last) > cut:
                self.pieces.append(last[: len(last) - cut])
            cut -= len(last)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        end = self.num_chars if finished else max(0, self.num_chars - self.hold_back)
        if not delta:
            return self.output_text[:end]
        unsent = end - self.num_sent_chars
        if unsent <= 0:
            return ""
        last = self.pieces[-1]
        if end == self.num_chars and len(last) == unsent:  # most steps: exactly the last piece
            text = last
        else:
            text = _tail(self.pieces, self.num_chars - self.num_sent_chars)[:unsent]
        self.num_sent_chars = end
        return text


class SlowIncrementalDetokenizer(IncrementalDetokenizer):
    """Prefix and read offsets over ``tokenizer.decode`` (any tokenizer)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        super().__init__(tokenizer, prompt_token_ids, params)
        self.tokens = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the decoding window
        self.read_offset = len(self.tokens)  # tokens before this are already in the text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, new_token_ids: list[int]) -> str:
        self.tokens.extend(new_token_ids)
        known = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) <= len(known) or full.endswith("\ufffd"):
            return ""  # nothing new yet, or a character still incomplete
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return full[len(known) :]


class FastIncrementalDetokenizer(IncrementalDetokenizer):
    """The Rust tokenizer's own streaming decoder (``tokenizers.decoders.DecodeStream``)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        from tokenizers.decoders import DecodeStream

        super().__init__(tokenizer, prompt_token_ids, params)
        self.backend = tokenizer.backend_tokenizer
        self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        for token_id in prompt_token_ids[-CONTEXT_TOKENS:]:  # context, not output: discarded
            self.stream.step(self.backend, token_id)

    def _decode_new(self, new_token_ids: list[int]) -> str:
        if len(new_token_ids) == 1:  # a decode step: one token, no list to join
            return self.stream.step(self.backend, new_token_ids[0]) or ""
        parts = []
        for token_id in new_token_ids:
            piece = self.stream.step(self.backend, token_id)
            if piece:
                parts.append(piece)
        return "".join(parts)


def default_detokenizer_cls(tokenizer) -> type[IncrementalDetokenizer]:
    """Fast (Rust) when the tokenizer has a Rust backend, else the classic algorithm."""
    if getattr(tokenizer, "is_fast", False) and hasattr(tokenizer, "backend_tokenizer"):
        try:
            import tokenizers.decoders

            if hasattr(tokenizers.decoders, "DecodeStream"):
                return FastIncrementalDetokenizer
        except ImportError:
            pass
    return SlowIncrementalDetokenizer
