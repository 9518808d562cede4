"""One request's grammar state: an xgrammar matcher advanced with every token the request keeps."""

from __future__ import annotations

from concurrent.futures import Future


class RequestGrammar:
    """Starts once its grammar is compiled; then follows the request's output tokens.

    Draft tokens are tried and rolled back (`num_valid_drafts`, `fill_bitmask`): only tokens the request
    keeps (`accept`) stay accepted. With `reasoning_end` (a thinking model's end-of-thought ids) the grammar
    applies only after the output has held them: the thoughts before are free.
    """

    def __init__(self, compiled: Future, reasoning_end: list[int] | None = None) -> None:
        self.compiled = compiled
        self.matcher = None
        self.reasoning_end = tuple(reasoning_end or ())
        self.recent: tuple[int, ...] = ()  # the last kept ids while thinking (as many as reasoning_end holds)
        self.is_thinking = bool(self.reasoning_end)

    @property
    def is_ready(self) -> bool:
        return self.compiled.done()

    @property
    def error(self) -> str | None:
        """Why the grammar could not be compiled (None while compiling or when it compiled)."""
        if not self.compiled.done() or self.compiled.exception() is None:
            return None
        return str(self.compiled.exception())

    def start(self) -> None:
        import xgrammar as xgr

        assert self.is_ready and self.error is None, "start() once compiled"
        self.matcher = xgr.GrammarMatcher(self.compiled.result())  # rolls back any number of tokens

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing more may follow."""
        return not self.is_thinking and self.matcher.is_terminated()

    @property
    def can_fill_in_batch(self) -> bool:
        """Its next row comes from the matcher alone (past any thinking, not terminated): with the other
        such rows of a step in one batch call (structured.bitmask)."""
        return not self.is_thinking and not self.matcher.is_terminated()

    def accept_if_open(self, token_id: int) -> bool:
        """Advance over a kept token when the grammar allows it and stays open after it (a step's common case,
        taken in the scheduler's fast lane); otherwise change nothing and return False (the caller takes the
        token through `accept`)."""
        if self.is_thinking or not self.matcher.accept_token(token_id):
            return False
        if self.matcher.is_terminated():
            self.matcher.rollback(1)
            return False
        return True

    def accept(self, token_id: int) -> bool:
        """Advance over one kept token; False (and no change) when the grammar forbids it."""
        if self.is_thinking:
            self.recent = self._after(self.recent, token_id)
            self.is_thinking = self.recent != self.reasoning_end
            return True
        return self.matcher.accept_token(token_id)

    def _num_thought_drafts(self, drafts: list[int]) -> int | None:
        """How many leading drafts are thoughts, the last of them ending the thinking: 0 when the grammar
        applies already; None when the thinking goes on past them all."""
        if not self.is_thinking:
            return 0
        recent = self.recent
        for i, token_id in enumerate(drafts):
            recent = self._after(recent, token_id)
            if recent == self.reasoning_end:
                return i + 1
        return None

    def _after(self, recent: tuple[int, ...], token_id: int) -> tuple[int, ...]:
        return (*recent, token_id)[-len(self.reasoning_end):]

    def num_valid_drafts(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar allows (the state is left as it was)."""
        num_thought = self._num_thought_drafts(drafts)
        if num_thought is None:
            return len(drafts)
        return num_thought + self._num_valid(drafts[num_thought:])

    def _num_valid(self, drafts: list[int]) -> int:
        num = 0
        for token_id in drafts:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token_id):
                break
            num += 1
        if num:
            self.matcher.rollback(num)
        return num

    def fill_bitmask(self, bitmask, row: int, drafts: list[int]) -> None:
        """Rows row .. row + len(drafts): the allowed tokens after drafts[:j] (drafts already checked); a row
        still in thought allows any token."""
        num_thought = self._num_thought_drafts(drafts)
        for j in range(len(drafts) + 1 if num_thought is None else num_thought):
            bitmask[row + j].fill_(-1)
        if num_thought is not None:
            self._fill_rows(bitmask, row + num_thought, drafts[num_thought:])

    def _fill_rows(self, bitmask, row: int, drafts: list[int]) -> None:
        num_accepted = 0
        for j in range(len(drafts) + 1):
            if self.matcher.is_terminated():
                bitmask[row + j].fill_(-1)  # after the stop token nothing is kept: any token will do
            else:
                self.matcher.fill_next_token_bitmask(bitmask, row + j)
            if j < len(drafts) and self.matcher.accept_token(drafts[j]):
                num_accepted += 1
        if num_accepted:
            self.matcher.rollback(num_accepted)
