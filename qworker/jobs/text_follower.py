"""A job's live text from its deltas, across attempts: what Client.stream yields and what the
gateway streams (the blocking and the asyncio reader feed the same deltas to this).

A job runs again when its worker died or released it: the new attempt streams from the start,
after an attempt marker, or resumes after what the earlier ones streamed (a resume marker says how
many characters it keeps; docs/queues.md "Resume from tokens"). Text handed out before the marker
is not repeated: the new attempt's text is followed silently until it passes what was handed out,
and only the rest is new (a rerun draws the same tokens: the same seed, or greedy). Should the new
text differ from what was handed out, StreamRestartedError.
"""

from __future__ import annotations

from qworker.backends.sink import Delta
from qworker.errors import StreamRestartedError


class TextFollower:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.yielded = ""  # the text handed out so far
        # While a new attempt catches up with `yielded`: its number and its text so far.
        self._attempt: int | None = None
        self._attempt_text = ""

    def feed(self, delta: Delta) -> str:
        """The new text this delta adds for the reader ("" for none); StreamRestartedError when
        a new attempt diverges from what was handed out."""
        if delta.attempt is not None:
            # A resumed attempt continues the text so far (this reader's copy of it: what it
            # handed out, or what it follows of an attempt catching up); a plain one restarts.
            so_far = self._attempt_text if self._attempt is not None else self.yielded
            num_kept = delta.resume.num_chars if delta.resume is not None else 0
            if num_kept > len(so_far):
                raise StreamRestartedError(self.job_id, delta.attempt)  # it missed text it cannot see now
            self._attempt, self._attempt_text = delta.attempt, so_far[:num_kept]
            return ""
        if self._attempt is None:
            self.yielded += delta.text
            return delta.text
        self._attempt_text += delta.text
        common = min(len(self._attempt_text), len(self.yielded))
        if self._attempt_text[:common] != self.yielded[:common]:
            raise StreamRestartedError(self.job_id, self._attempt)
        if len(self._attempt_text) > len(self.yielded):
            rest = self._attempt_text[len(self.yielded) :]
            self.yielded, self._attempt = self._attempt_text, None
            return rest
        return ""

    def finish(self) -> None:
        """At the end of the deltas: StreamRestartedError if the new attempt ended with less
        text than an old one had streamed."""
        if self._attempt is not None and self._attempt_text != self.yielded:
            raise StreamRestartedError(self.job_id, self._attempt)
