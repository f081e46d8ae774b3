"""Resume from tokens, the pure parts and the worker loop: the checkpoint a delta stream holds
(sink.progress_of), Client.stream across resume markers, and a released job resumed by a peer on
the in-memory source and sink with the scripted fake engine (no model, no Redis)."""

from __future__ import annotations

import os
import signal

import pytest

from qworker.backends.memory.results import MemoryResultSink
from qworker.backends.sink import Delta, Progress, ResumePoint, latest_attempt, progress_of
from qworker.errors import StreamRestartedError
from qworker.jobs.client import Client
from tests.unit.test_worker_loop import job, make_harness

pytestmark = pytest.mark.timeout(30)


def d(text: str, ids: list[int], pos: int | None) -> Delta:
    return Delta("j", text, ids, pos=pos)


def marker(attempt: int, num_tokens: int | None = None, num_chars: int = 0) -> Delta:
    resume = ResumePoint(num_tokens, num_chars) if num_tokens is not None else None
    return Delta("j", "", attempt=attempt, resume=resume)


# -- the checkpoint ----------------------------------------------------------------------------


def test_progress_follows_attempts_and_positions() -> None:
    first = [d("a", [1], 0), d("bc", [2, 3], 1), d("d", [4], 3)]
    assert progress_of(first) == Progress([1, 2, 3, 4], "abcd")
    # A resumed attempt keeps what its marker says and extends it from there.
    resumed = [*first, marker(2, 3, 3), d("x", [9], 3), d("y", [8], 4)]
    assert progress_of(resumed) == Progress([1, 2, 3, 9, 8], "abcxy")
    # A plain marker starts from zero.
    assert progress_of([*first, marker(2), d("p", [5], 0)]) == Progress([5], "p")
    assert progress_of([*first, marker(2)]) == Progress()


def test_progress_stops_at_a_gap_and_skips_stale_deltas() -> None:
    # The outbox dropped pos 2 (a long outage): nothing past the gap is stitched on.
    assert progress_of([d("a", [1], 0), d("b", [2], 1), d("d", [4], 3), d("e", [5], 4)]) == Progress(
        [1, 2], "ab"
    )
    # A stale writer's delta (a position already covered) is skipped.
    assert progress_of([d("a", [1], 0), d("b", [2], 1), d("B", [7], 1), d("c", [3], 2)]) == Progress(
        [1, 2, 3], "abc"
    )
    # A trimmed stream (its first entries gone) holds nothing to resume from.
    assert progress_of([d("c", [3], 2), d("d", [4], 3)]) == Progress()
    # A last flush (text, no token: an attempt's end) ends what the attempt adds.
    assert progress_of([d("a", [1], 0), d("!", [], 1), d("b", [2], 1)]) == Progress([1], "a")
    # Deltas from a writer that gives no positions are not used.
    assert progress_of([d("a", [1], None)]) == Progress()
    # A resume marker reopens after a gap.
    tail = [d("a", [1], 0), d("c", [3], 2), marker(2, 1, 1), d("b", [2], 1)]
    assert progress_of(tail) == Progress([1, 2], "ab")


@pytest.mark.parametrize(
    "deltas",
    [
        [d("a", [1], 0), Delta("j", "b", ["x"], pos=1)],  # type: ignore[list-item]
        [d("a", [1], 0), Delta("j", "b", [True], pos=1)],
        [d("a", [1], 0), Delta("j", "b", "12", pos=1)],  # type: ignore[arg-type]
        [d("a", [1], 0), marker(2, 5, 1)],  # resumes past what is there
        [d("ab", [1], 0), marker(2, 1, 9)],
    ],
    ids=["str-id", "bool-id", "not-a-list", "tokens-past", "chars-past"],
)
def test_corrupt_progress_is_a_problem(deltas) -> None:
    progress = progress_of(deltas)
    assert progress.problem is not None and progress.token_ids == []


def test_a_late_reader_keeps_resumed_attempts() -> None:
    deltas = [d("a", [1], 0), marker(2, 1, 1), d("b", [2], 1)]
    assert latest_attempt(deltas) == deltas
    assert latest_attempt([d("a", [1], 0), marker(2), d("b", [2], 0)]) == [marker(2), d("b", [2], 0)]


# -- Client.stream -----------------------------------------------------------------------------


def stream_of(deltas: list[Delta]) -> list[str]:
    sink = MemoryResultSink()
    sink.write_deltas(deltas)
    sink.end_deltas("j", "completed")
    client = Client.__new__(Client)
    client.sink = sink
    return list(client.stream("j", timeout=1))


def test_stream_continues_a_resumed_attempt_without_repeat_or_gap() -> None:
    chunks = stream_of([d("ab", [1], 0), d("cd", [2], 1), marker(2, 2, 4), d("ef", [3], 2), d("g", [4], 3)])
    assert chunks == ["ab", "cd", "ef", "g"]
    # The earlier attempt's last flush ("e", beyond the 4 characters kept) is not repeated.
    chunks = stream_of([d("ab", [1], 0), d("cd", [2], 1), d("e", [], 2), marker(2, 2, 4), d("ef", [3], 2)])
    assert "".join(chunks) == "abcdef"
    # A resume inside a restart that is still catching up.
    chunks = stream_of(
        [
            d("ab", [1], 0),
            d("cd", [2], 1),
            marker(2),
            d("ab", [1], 0),
            marker(3, 1, 2),
            d("cd", [2], 1),
            d("x", [5], 2),
        ]
    )
    assert "".join(chunks) == "abcdx"


def test_stream_refuses_a_resume_past_what_it_saw() -> None:
    with pytest.raises(StreamRestartedError):
        stream_of([d("ab", [1], 0), marker(2, 3, 5), d("x", [4], 3)])


# -- the worker loop ---------------------------------------------------------------------------


def release_at(h, step: int) -> None:
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    h.worker.install_signal_handlers()
    try:
        h.engine.on_step = lambda n: os.kill(os.getpid(), signal.SIGTERM) if n == step else None
        h.worker.run(burst=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def sample(h, name: str, **labels: str) -> float:
    value = h.worker.metrics.registry.get_sample_value(name, labels or None)
    return value or 0.0


def test_released_job_resumes_on_a_peer_from_its_tokens() -> None:
    h = make_harness(drain_grace_s=0.0)
    h.put("a", job(30))
    release_at(h, 10)  # step 10 runs whole: 10 tokens stored
    first = progress_of(h.sink.deltas["a"])
    assert len(first.token_ids) == 10 and first.problem is None
    peer = make_harness(queue=h.queue, name="w2")
    peer.worker.sink = h.sink  # the same result store
    assert peer.worker.run(burst=True).num_completed == 1
    result = h.sink.get_result("a")
    assert result is not None and result.attempts == 2
    assert result.text == "abcdefghijklmnopqrstuvwxyzabcd"
    assert result.usage.completion_tokens == 30  # every token the user got, once
    # The peer generated 20 tokens and resumed 10: counted apart.
    assert sample(peer, "qworker_generation_tokens_total") == 20
    assert sample(peer, "qworker_resumed_tokens_total") == 10
    assert sample(peer, "qworker_resumes_total", outcome="resumed") == 1
    deltas = h.sink.deltas["a"]
    assert deltas[10] == Delta("a", "", attempt=2, resume=ResumePoint(10, 10))
    assert [x.pos for x in deltas[11:]] == list(range(10, 30))
    chunks = stream_of([Delta("j", x.text, x.token_ids, x.attempt, x.pos, x.resume) for x in deltas])
    assert "".join(chunks) == result.text


def test_stored_tokens_that_do_not_fit_restart_from_zero(caplog) -> None:
    h = make_harness(drain_grace_s=0.0)
    h.put("a", job(30))
    release_at(h, 6)
    # Tokens that are not this job's (another model's, a corrupt store): the engine refuses them.
    h.sink.deltas["a"] = [d("zzzzz", list(b"zzzzz"), 0)]
    peer = make_harness(queue=h.queue, name="w2")
    peer.worker.sink = h.sink
    with caplog.at_level("WARNING"):
        assert peer.worker.run(burst=True).num_completed == 1
    assert "job a restarts from zero" in caplog.text
    result = h.sink.get_result("a")
    assert result is not None and result.text == "abcdefghijklmnopqrstuvwxyzabcd"
    assert sample(peer, "qworker_resumes_total", outcome="restarted") == 1
    assert sample(peer, "qworker_generation_tokens_total") == 30
    assert h.sink.deltas["a"][1] == Delta("a", "", attempt=2)
