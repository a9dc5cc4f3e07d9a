"""The front end's half of a request: incremental detokenization, stop strings, metrics.

The engine core only sees token ids. Turning them back into text happens here, one token at
a time, because a token is not always a whole character: a byte-level BPE may split "é" over
two tokens, and decoding the first alone gives "\\ufffd". The detokenizer decodes a small
window of recent tokens and only emits text once it no longer ends in a broken character.

Stop *strings* live here too (the core cannot see text): when one appears, the text is cut
before it, the request is finished with reason "stop", and the core is told to abort it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.engine.messages import EngineCoreOutput
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind
from minivllm.sampling_params import SamplingParams

_CONTEXT_TOKENS = 5  # prompt tokens decoded along with the first outputs (leading spaces)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the decoding window
        self.read_offset = len(self.tokens)  # tokens before this are already in the text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text they complete (maybe empty, if a character is pending)."""
        self.tokens.extend(new_token_ids)
        known = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) <= len(known) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return full[len(known) :]


@dataclass
class RequestState:
    """The front end's view of one request. Text is kept as pieces (joined only when an output
    needs all of it), so a step costs O(new tokens), not O(everything generated so far)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)
    text_pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # for DELTA outputs: how many tokens / text pieces the previous output already carried
    num_sent_tokens: int = 0
    num_sent_pieces: int = 0

    @property
    def text(self) -> str:
        if len(self.text_pieces) > 1:
            self.text_pieces[:] = ["".join(self.text_pieces)]
            self.num_sent_pieces = min(self.num_sent_pieces, 1)
        return self.text_pieces[0] if self.text_pieces else ""

    def to_output(self) -> RequestOutput:
        if self.params.output_kind == RequestOutputKind.DELTA:
            text = "".join(self.text_pieces[self.num_sent_pieces:])
            token_ids = self.output_token_ids[self.num_sent_tokens:]
            self.num_sent_pieces = len(self.text_pieces)
            self.num_sent_tokens = len(self.output_token_ids)
        else:
            text, token_ids = self.text, list(self.output_token_ids)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finish_reason is not None,
            metrics=self.metrics,
            num_cached_tokens=self.metrics.num_cached_tokens,
        )


def _tail(pieces: list[str], n: int) -> str:
    """The last ``n`` characters of the pieces joined, joining only the pieces needed."""
    parts, size = [], 0
    for piece in reversed(pieces):
        parts.append(piece)
        size += len(piece)
        if size >= n:
            break
    return "".join(reversed(parts))[-n:]


def find_stop_string(text: str, new_len: int, stops: list[str]) -> int:
    """Index where the earliest stop string begins in ``text``, looking only where the last
    ``new_len`` characters could complete one; -1 if none."""
    best = -1
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best == -1 or i < best):
            best = i
    return best


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.requests[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, detok, RequestMetrics(arrival_time)
        )

    def abort_requests(self, request_ids: list[str]) -> list[RequestState]:
        return [s for rid in request_ids if (s := self.requests.pop(rid, None)) is not None]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Apply the core's new tokens. Returns (outputs to hand out, requests the core must abort)."""
        request_outputs: list[RequestOutput] = []
        to_abort: list[str] = []
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue  # aborted by the user meanwhile
            self._update_metrics(state, out)
            state.output_token_ids.extend(out.new_token_ids)
            if out.finished:
                state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
            if state.detokenizer is not None:
                new_text = state.detokenizer.update(out.new_token_ids)
                if new_text:
                    state.text_pieces.append(new_text)
                if self._check_stop_strings(state, len(new_text)) and not out.finished:
                    to_abort.append(out.request_id)
            finished = state.finish_reason is not None
            if finished:
                state.metrics.finished_time = out.timestamp
                del self.requests[out.request_id]
            if finished or state.params.output_kind != RequestOutputKind.FINAL_ONLY:
                request_outputs.append(state.to_output())
        return request_outputs, to_abort

    @staticmethod
    def _update_metrics(state: RequestState, out: EngineCoreOutput) -> None:
        m = state.metrics
        if out.first_scheduled_time is not None and m.first_scheduled_time is None:
            m.first_scheduled_time = out.first_scheduled_time
        m.num_cached_tokens = out.num_cached_tokens
        m.num_preemptions = out.num_preemptions
        if out.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = out.timestamp
            m.last_token_time = out.timestamp
            m.token_times.extend([out.timestamp] * len(out.new_token_ids))

    @staticmethod
    def _check_stop_strings(state: RequestState, new_len: int) -> bool:
        stops = state.params.stop
        if not stops or new_len == 0:
            return False
        # only the end of the text can hold a stop string completed by the new characters
        text = _tail(state.text_pieces, new_len + max(len(s) for s in stops) - 1)
        i = find_stop_string(text, new_len, stops)
        if i < 0:
            return False
        stop = next(s for s in stops if text.startswith(s, i))
        end = i + len(stop) if state.params.include_stop_str_in_output else i
        cut = len(text) - end  # characters to drop from the end
        while cut > 0:  # drop them from the last pieces
            last = state.text_pieces.pop()
            if len(last) > cut:
                state.text_pieces.append(last[: len(last) - cut])
            cut -= len(last)
        state.num_sent_pieces = min(state.num_sent_pieces, len(state.text_pieces))
        state.finish_reason, state.stop_reason = "stop", stop
        return True
