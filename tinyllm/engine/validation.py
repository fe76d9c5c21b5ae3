"""Checks for what users hand the engine, shared by SamplingParams and the engine's prompt check.

Everything wrong is a ValueError (as pydantic's type errors are, and as vLLM raises): one
`except ValueError` catches every bad input, and each message names the field, the value and
the rule.
"""

import numbers
import reprlib


def is_int(x: object) -> bool:
    # bool is an int subclass, but max_tokens=True is a mistake, not 1.
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x: object) -> bool:
    """An int or a float (not a bool, not a str); the range checks that follow reject nan."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def kind_of(x: object) -> str:
    """What `x` is, for an error message: "an int", "a str", "None"."""
    if x is None:
        return "None"
    name = type(x).__name__
    return f"{'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"


def show(x: object) -> str:
    """`x` for an error message: short, even for a long list or string, and a huge int as its
    size (Python refuses to print one of over 4300 digits)."""
    if is_int(x) and int(x).bit_length() > 4096:
        return f"<an int of {int(x).bit_length()} bits>"
    return reprlib.repr(x)


def check_token_ids(what: str, ids: object, vocab_size: int) -> None:
    """`ids` is a list (or tuple) of token ids, each an int in [0, vocab_size)."""
    if not isinstance(ids, list | tuple):
        raise ValueError(f"{what} must be a list of token ids, not {kind_of(ids)}")
    for i, t in enumerate(ids):  # a message is built only for the id that is wrong
        if not is_int(t):
            raise ValueError(f"{what}: token id {show(t)} at index {i} is {kind_of(t)}, not an int")
        if not 0 <= t < vocab_size:
            raise ValueError(
                f"{what}: token id {show(t)} at index {i} is outside the vocabulary "
                f"[0, {vocab_size})"
            )
