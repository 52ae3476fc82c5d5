"""StopStringChecker against its definition: a stop string ends the text where it starts, also when split across
tokens; text that may still begin one is held back; while min_tokens holds matching off (match=False) nothing
stops, and afterwards a string matches only where it ends in the new token's text (vLLM's window)."""

from __future__ import annotations

from deepinfer.engine.stop_checker import StopStringChecker


class PieceDetokenizer:
    """Token id i decodes to pieces[i]: the checker's detokenizer interface (add, finish) over known text."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def add(self, token_id: int) -> str:
        return self.pieces[token_id]

    def finish(self) -> str:
        return ""


def feed(pieces: list[str], stop: list[str], match_from: int = 0) -> tuple[StopStringChecker, int | None]:
    """Tokens 0, 1, ... in turn (matching on from token match_from); -> (checker, index of the stopping token)."""
    checker = StopStringChecker(PieceDetokenizer(pieces), stop)
    for i in range(len(pieces)):
        if checker.add(i, match=i >= match_from) is not None:
            return checker, i
    return checker, None


def test_a_split_stop_string_cuts_the_text_where_it_starts():
    checker, at = feed(["hel", "lo wo", "rld!"], ["o w", "zzz"])
    assert at == 1 and checker.matched == "o w" and checker.text == "hell"
    checker, at = feed(["ab", "cd", "ef"], ["bcde"])
    assert at == 2 and checker.text == "a"


def test_the_earliest_start_wins_among_strings_ending_in_one_token():
    checker, at = feed(["xx", "abcd"], ["cd", "abc"])
    assert at == 1 and checker.matched == "abc" and checker.text == "xx"


def test_text_that_may_begin_a_stop_string_is_held_back():
    checker = StopStringChecker(PieceDetokenizer(["hello w", "x"]), ["wor"])
    checker.add(0)
    assert checker.take_delta(final=False) == "hello "  # "w" may begin "wor"
    checker.add(1)
    assert checker.take_delta(final=False) == "wx" and checker.matched is None


def test_no_match_while_held_and_only_new_endings_after():
    # "ab" ends inside the held tokens: never matched later, even with a longer string in the list.
    _, at = feed(["xab", "c", "d"], ["ab", "zzzzzz"], match_from=1)
    assert at is None
    # A string that starts in held text and ends in the first matching token does match.
    checker, at = feed(["xa", "b", "c"], ["ab"], match_from=1)
    assert at == 1 and checker.text == "x"
