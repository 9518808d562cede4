"""One request's grammar state: an xgrammar matcher advanced with every token the request keeps."""

from __future__ import annotations

from concurrent.futures import Future


class RequestGrammar:
    """Starts once its grammar is compiled; then follows the request's output tokens.

    Draft tokens are tried and rolled back (`num_valid_drafts`, `fill_bitmask`): only tokens the request
    keeps (`accept`) stay accepted.
    """

    def __init__(self, compiled: Future) -> None:
        self.compiled = compiled
        self.matcher = None

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
        return self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance over one kept token; False (and no change) when the grammar forbids it."""
        return self.matcher.accept_token(token_id)

    def num_valid_drafts(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar allows (the state is left as it was)."""
        num = 0
        for token_id in drafts:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token_id):
                break
            num += 1
        if num:
            self.matcher.rollback(num)
        return num

    def fill_bitmask(self, bitmask, row: int, drafts: list[int]) -> None:
        """Rows row .. row + len(drafts): the allowed tokens after drafts[:j] (drafts already checked)."""
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
