"""Texts in a slot (Op.EMBED): the one place their encoding and its limits are written down.

A request's blob holds its ``nq`` texts as UTF-8, each followed by one NUL byte (0x00): C strings
laid end to end, ``blob_len`` bytes in all. A text is 1 to :data:`MAX_TEXT_BYTES` bytes of valid
UTF-8 (no NUL, not only whitespace). The sidecar reads the blob as untrusted input
(:func:`decode_texts`): any other blob is a BAD_REQUEST naming the text and why, and nothing is
embedded for that request. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence

#: The most UTF-8 bytes of one text (the tokenizer truncates at the model's token limit anyway:
#: 16 KiB is ~3,000 words, beyond any 512-token window).
MAX_TEXT_BYTES = 16384


class TextError(ValueError):
    """A text (or a blob of texts) that breaks the rules above; the message says which and why."""


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be sent (None: it can)."""
    if not isinstance(text, str):
        return f"a text must be a str, not {type(text).__name__}"
    if "\x00" in text:
        return "holds a NUL character"
    try:
        n = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid Unicode (a lone surrogate)"
    if n > MAX_TEXT_BYTES:
        return f"is {n} bytes of UTF-8; the most is {MAX_TEXT_BYTES}"
    if not text.strip():
        return "is empty (or only whitespace)"
    return None


def encode_texts(texts: Sequence[str]) -> bytes:
    """The blob of ``texts`` (each checked: TextError names the first bad one)."""
    for i, t in enumerate(texts):
        problem = text_problem(t)
        if problem is not None:
            raise TextError(f"text {i} {problem}")
    return b"".join(t.encode("utf-8") + b"\x00" for t in texts)


def decode_texts(blob: bytes, n: int) -> list[str]:
    """The ``n`` texts of a request's blob, checked as untrusted input (TextError otherwise)."""
    if not blob.endswith(b"\x00"):
        raise TextError("the blob must end with a NUL byte (each text is NUL-terminated)")
    parts = blob[:-1].split(b"\x00")
    if len(parts) != n:
        raise TextError(f"the blob holds {len(parts)} texts, nq is {n}")
    out = []
    for i, raw in enumerate(parts):
        if len(raw) > MAX_TEXT_BYTES:
            raise TextError(f"text {i} is {len(raw)} bytes of UTF-8; the most is {MAX_TEXT_BYTES}")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TextError(f"text {i} is not valid UTF-8 (byte {e.start})") from None
        if not text.strip():
            raise TextError(f"text {i} is empty (or only whitespace)")
        out.append(text)
    return out


__all__ = ["MAX_TEXT_BYTES", "TextError", "decode_texts", "encode_texts", "text_problem"]
