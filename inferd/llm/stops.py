"""Stop strings: end a generation at the first stop string, never streaming any of it
(unless the request asks for it: ``include_stop_str_in_output``).

Text that could be the beginning of a stop string is held back until the next delta
shows whether it is one; the stop string itself and what follows are never emitted.
"""

from __future__ import annotations


class StopChecker:
    def __init__(self, stops: tuple[str, ...] | list[str], include: bool = False) -> None:
        """``include``: the stop string that ends the text is part of it (what follows
        is not)."""
        self.stops = tuple(s for s in stops if s)
        self.include = include
        self._pending = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, bool]:
        """The text that may be emitted now, and whether a stop string was reached."""
        if not self.stops:
            return delta, False
        text = self._pending + delta
        hits = [(i, i + len(s)) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            self._pending = ""
            start, end = min(hits)
            return text[: end if self.include else start], True
        hold = 0 if final else self._held_back(text)
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def _held_back(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best
