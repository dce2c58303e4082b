"""Turn a sequence's generated tokens into text as they arrive, with stop strings.

NOTE: decoding follows vLLM's prefix/read-offset scheme. Each step decodes only a small window of token
ids, `ids[prefix_offset:]`, and the new text is what that decode adds past `ids[prefix_offset:read_offset]`.
The window starts a token or two back, and the first window starts inside the prompt's last tokens, so a
token's leading space comes out as the tokenizer means it (byte-level BPE and SentencePiece alike).
The offsets only move once the window decodes to whole characters: not ending in U+FFFD (a UTF-8
character cut short) nor in a run of SentencePiece byte tokens (a later byte token can still change how
the run decodes). Until then the window's text is pending; finish() flushes it.

Text is then held back while its end could still be the start of a stop string. Stop strings are looked
for, once min_tokens tokens are in, in the decoded text, pending text included up to its last whole
character; the earliest match wins.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.runtime.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# How many of the prompt's last tokens give the first window its left context.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """One sequence's text, a token at a time.

    The final text is the decode of the prompt's last tokens plus the output, past the decode of those
    prompt tokens, cut before the first stop string (or after it, with include_stop_str_in_output). For
    byte-level BPE that is `tokenizer.decode(output_ids)`; SentencePiece keeps the space that a first
    output token such as "▁Hello" carries, which decoding the output alone strips.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a sequence of non-empty strings, got {stop!r}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._tail_length = max((len(s) for s in self._stop), default=1) - 1
        context = self._context(prompt_token_ids)
        self._ids = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(0)
        self._pending = ""  # decoded past read_offset, not yet whole characters
        self._in_byte_run = False  # whether the last token that added text was a byte token
        self._tail = ""  # the last _tail_length characters of the decoded text: where a stop can start
        self._unsent = ""  # decoded text not yet handed out by take_delta
        self._sent = ""  # the text take_delta has handed out
        self._done = False
        self._stop_string: str | None = None

    @property
    def text(self) -> str:
        """All text safe to show so far (what take_delta has returned plus would return now); after
        finish() or a stop, the final text."""
        return self._sent + self._unsent[: self._releasable()]

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stop_string

    @property
    def finished(self) -> bool:
        """Whether a stop string matched or finish() was called; no more tokens are taken then."""
        return self._done

    def add_token(self, token_id: int) -> str | None:
        """Append one generated token. Returns the stop string it completes, if any: the sequence then
        ends (finish_reason "stop", stop_reason that string) and takes no more tokens. Stop strings
        completed before the min_tokens-th token do not count."""
        if self._done:
            raise ValueError("the sequence's text is finished (a stop string matched or finish() ran)")
        self._ids.append(token_id)
        self._num_tokens += 1
        window = self._decode(self._prefix_offset)
        new_text = window[len(self._prefix_text) :]
        if new_text != self._pending:  # a skipped special token leaves a byte run open
            self._in_byte_run = _is_byte_token(self._tokenizer.id_to_token(token_id))
        if self._is_open(window):
            self._pending = new_text
            return self._append("", new_text.rstrip(REPLACEMENT_CHAR))
        self._pending = ""
        self._prefix_text = self._decode(self._read_offset)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._append(new_text, "")

    def take_delta(self) -> str:
        """The text that became safe to show since the last call."""
        count = self._releasable()
        delta, self._unsent = self._unsent[:count], self._unsent[count:]
        self._sent += delta
        return delta

    def finish(self) -> None:
        """End the sequence: release whatever was held back (a cut-short character, a possible stop)."""
        if self._done:
            return
        pending, self._pending = self._pending, ""
        self._append(pending, "")
        self._done = True

    def _context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The longest suffix of the prompt's last tokens that decodes to whole characters."""
        for count in range(min(len(prompt_token_ids), _CONTEXT_TOKENS), 0, -1):
            context = list(prompt_token_ids[-count:])
            if REPLACEMENT_CHAR not in self._tokenizer.decode(context, self._skip_special_tokens):
                return context
        return []

    def _decode(self, start: int) -> str:
        return self._tokenizer.decode(self._ids[start:], skip_special_tokens=self._skip_special_tokens)

    def _is_open(self, window: str) -> bool:
        """Whether the window may still change as tokens follow, so its offsets must stay."""
        return len(window) <= len(self._prefix_text) or window.endswith(REPLACEMENT_CHAR) or self._in_byte_run

    def _append(self, decoded: str, pending_whole: str) -> str | None:
        """Add newly decoded text, then look for a stop string ending in it or in the whole part of the
        pending text. Any earlier match was seen before (or came before min_tokens)."""
        tail = self._tail
        searched_from = len(self._sent) + len(self._unsent) - len(tail)
        self._unsent += decoded
        if self._tail_length:
            self._tail = (tail + decoded)[-self._tail_length :]
        if self._num_tokens < self._min_tokens:
            return None
        match = _earliest_match(tail + decoded + pending_whole, self._stop, ends_after=len(tail))
        if match is None:
            return None
        start, stop = match
        end = searched_from + start + (len(stop) if self._include_stop else 0)
        self._unsent = (self._unsent + pending_whole)[: end - len(self._sent)]
        self._pending = ""
        self._done = True
        self._stop_string = stop
        return stop

    def _releasable(self) -> int:
        """How much of the unsent text is safe: all once done, else all but a possible stop's start."""
        if self._done:
            return len(self._unsent)
        return max(0, len(self._unsent) - _stop_prefix_length(self._tail, self._stop))


def _is_byte_token(piece: str | None) -> bool:
    """SentencePiece's byte-fallback pieces, "<0xE6>"."""
    return piece is not None and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


def _earliest_match(text: str, stops: Sequence[str], ends_after: int) -> tuple[int, str] | None:
    """The stop string found earliest in `text` ending past `ends_after` characters (of two starting
    together, the one ending first)."""
    found = [
        (index, len(stop), stop)
        for stop in stops
        if (index := text.find(stop, max(0, ends_after - len(stop) + 1))) >= 0
    ]
    if not found:
        return None
    index, _, stop = min(found)
    return index, stop


def _stop_prefix_length(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of `text` that a stop string starts with (but is not all of)."""
    return max(
        (
            size
            for stop in stops
            for size in range(1, min(len(stop), len(text) + 1))
            if text.endswith(stop[:size])
        ),
        default=0,
    )
