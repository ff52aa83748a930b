"""``slotq bench clients``' bookkeeping, with the real client libraries against a port nothing listens
on: every check fails, none hangs or escapes, each row says why in one line and the totals count them.
What the checks find against real servers is the benchmark's run (bench/results/clients.md)."""

from __future__ import annotations

import pytest

from bench import client_checks, clients_bench
from slotq.jobs.redis_server import free_port


@pytest.mark.slow
def test_every_check_fails_with_its_first_line_against_no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")     # else litellm's import fetches a price list
    rows = clients_bench.run_checks(client_checks.Server(f"http://127.0.0.1:{free_port()}", "m", "m-embed"))
    assert [(r["library"], r["case"]) for r in rows] == [(library, case) for library, case, _ in client_checks.CHECKS]
    assert not any(r["passed"] for r in rows)
    assert all("connect" in r["error"].lower() and "\n" not in r["error"] for r in rows), rows
    results = {"slotq": rows, "llama-server": rows[:1]}
    assert clients_bench.totals(results) == {"slotq": {"pass": 0, "fail": len(rows)},
                                             "llama-server": {"pass": 0, "fail": 1}}
    text = clients_bench.table(results, {})
    assert f"**0 pass / {len(rows)} fail**" in text and "| - |" in text   # a case one server did not run


def test_a_wrapped_retry_error_reports_its_last_try() -> None:
    class Attempt:
        exception = ValueError("the real reason\nand more")

    class Wrapped(Exception):
        failed_attempts = [Attempt()]

    wrapped = Wrapped("<failed_attempts>\n...")
    assert clients_bench.first_line(wrapped) == "Wrapped, last try: ValueError: the real reason"
    assert clients_bench.first_line(AssertionError()) == "AssertionError"
