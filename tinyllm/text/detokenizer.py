"""Streaming token ids -> text without ever showing half a character.

A byte-level BPE token can hold part of a multi-byte UTF-8 character (an emoji is often 2-4
tokens), and decoding such a prefix ends in U+FFFD. Decoding the whole sequence after every token
would fix that but costs O(length) per token. Instead, as vLLM does, keep two offsets into the
ids: text is final up to `read`, and `prefix` (a few tokens before it) gives the decoder context,
so a token decodes the same as it would mid-sequence (leading-space rules depend on it). Each step
decodes only ids[prefix:] and emits the new part once it no longer ends in U+FFFD.
"""

from tinyllm.text.tokenizer import Tokenizer

# How many prompt tokens to decode as context before the first generated one.
_CONTEXT = 5
# A real character is complete within 4 tokens (at least one byte each). Text still ending in
# U+FFFD after this many comes from invalid bytes or a literal U+FFFD, so it is emitted as is,
# which keeps each step's window bounded. (Were a character to start in the last of those
# tokens, it would show as U+FFFD pieces; only after 8 tokens of garbage, so acceptable.)
_MAX_HELD = 8


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)

    def add(self, token_id: int) -> str:
        """Take one generated token; return the text it completes (often "", never half a char)."""
        self._ids.append(token_id)
        prefix_text, new_text = self._decode_window()
        held = len(self._ids) - self._read
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and held < _MAX_HELD):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """The held-back tail once generation ends; may hold U+FFFD, exactly as decode() would."""
        prefix_text, new_text = self._decode_window()
        return self._emit(new_text[len(prefix_text) :]) if len(new_text) > len(prefix_text) else ""

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        window = self._ids[self._prefix :]
        prefix_text = decode(window[: self._read - self._prefix], self._skip_special)
        return prefix_text, decode(window, self._skip_special)

    def _emit(self, text: str) -> str:
        # Only the last few ids matter from now on; dropping the rest keeps memory bounded too.
        self._ids = self._ids[self._read :]
        self._prefix, self._read = 0, len(self._ids)
        self._pieces.append(text)
        return text
