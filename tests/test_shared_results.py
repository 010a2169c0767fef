"""app_pages.shared_results: what every session of the server shares."""

import contextlib
import threading
import time

import pytest

from app_pages.shared_results import SharedResults


def test_two_sessions_asking_at_once_compute_once():
    results = SharedResults(kept=8)
    calls, started = [], threading.Event()

    def slow():
        calls.append(1)
        started.set()
        time.sleep(0.2)  # the second session asks while this one computes
        return object()

    answers = []
    first = threading.Thread(target=lambda: answers.append(results.get("k", slow)))
    first.start()
    started.wait(5)
    second = threading.Thread(target=lambda: answers.append(results.get("k", slow)))
    second.start()
    first.join(5)
    second.join(5)
    assert len(calls) == 1
    assert len(answers) == 2 and answers[0] is answers[1]


def test_a_computation_that_raises_keeps_nothing_and_the_next_ask_computes_again():
    results = SharedResults(kept=8)

    def fails():
        raise ValueError("not this time")

    with pytest.raises(ValueError):
        results.get("k", fails)
    assert results.found("k") == (False, None)
    assert results.get("k", lambda: 3) == 3
    assert results.found("k") == (True, 3)


def test_the_least_recently_used_result_goes_first():
    results = SharedResults(kept=2)
    results.get("a", lambda: 1)
    results.get("b", lambda: 2)
    assert results.found("a") == (True, 1)  # used: "b" is now the oldest
    results.get("c", lambda: 3)
    assert len(results) == 2
    assert results.found("b") == (False, None)
    assert results.found("a") == (True, 1) and results.found("c") == (True, 3)


def test_keep_serves_the_first_result_kept():
    results = SharedResults(kept=4)
    first, second = object(), object()
    assert results.keep("k", first) is first
    assert results.keep("k", second) is first  # a second search of the same inputs is served the first's
    assert results.get("k", lambda: second) is first


def test_the_computing_context_is_entered_only_while_a_result_is_missing():
    results = SharedResults(kept=4)
    entered = []

    @contextlib.contextmanager
    def spinner():
        entered.append(1)
        yield

    assert results.get("k", lambda: 1, computing=spinner) == 1
    assert results.get("k", lambda: 2, computing=spinner) == 1
    assert entered == [1]
