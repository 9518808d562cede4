"""Stop strings, as pure functions over the detokenized text.

`check_stop_strings` looks for a stop string in the part of the text that could hold a new match;
`hold_back` says how many trailing characters a stream must withhold because they could be the
start of a stop string (so streamed text never contains a stop string that later completes).
"""

from __future__ import annotations


def check_stop_strings(
    output_text: str, num_new_chars: int, stops: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Return (stop string, length to truncate output_text to) for the first match that ends in
    the last `num_new_chars` characters, or None.

    "First" is the match that ends earliest (it completed first), then the one starting earliest.
    The truncation length cuts the stop string off, or keeps it when include_in_output.
    """
    if num_new_chars <= 0 or not stops:
        return None
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    first_new = len(output_text) - num_new_chars
    for stop_str in stops:
        # A new match must end after first_new, so it starts at first_new - len + 1 or later.
        start = output_text.find(stop_str, max(0, first_new - len(stop_str) + 1))
        if start == -1:
            continue
        match = (start + len(stop_str), start, stop_str)
        if best is None or match < best:
            best = match
    if best is None:
        return None
    end, start, stop_str = best
    return stop_str, end if include_in_output else start


def hold_back(text: str, stops: list[str]) -> int:
    """Number of trailing characters of `text` that are a proper prefix of some stop string."""
    num_held = 0
    for stop_str in stops:
        for length in range(min(len(stop_str) - 1, len(text)), num_held, -1):
            if text.endswith(stop_str[:length]):
                num_held = length
                break
    return num_held
