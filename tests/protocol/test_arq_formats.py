"""arq's key names and record formats, written out in jobs/protocol/arq_formats.py so that
producers import no arq, are arq's own: each is checked here against the installed arq, byte for
byte, with slotq's serializer. And a producer indeed loads no arq."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import arq.constants
import pytest
from arq.jobs import deserialize_result, serialize_job, serialize_result

from slotq.jobs.protocol import arq_formats
from slotq.jobs.protocol.serialization import deserialize, serialize


def test_the_key_names_are_arqs() -> None:
    assert (arq_formats.JOB_KEY_PREFIX, arq_formats.RETRY_KEY_PREFIX, arq_formats.RESULT_KEY_PREFIX,
            arq_formats.ABORT_JOBS_SET) == (arq.constants.job_key_prefix, arq.constants.retry_key_prefix,
                                            arq.constants.result_key_prefix, arq.constants.abort_jobs_ss)


def test_a_job_record_is_arqs() -> None:
    payload = {"prompt": "hi", "max_tokens": 3, "nested": [1, 2.5, None]}
    assert arq_formats.job_record("generate", payload, 1_700_000_000_123, serialize) == \
        serialize_job("generate", (payload,), {}, None, 1_700_000_000_123, serializer=serialize)


@pytest.mark.parametrize("value", [{"text": "done"}, arq_formats.exception_data(RuntimeError("cancelled")), "plain"])
def test_a_result_record_is_arqs_and_reads_as_arq_reads_it(value: Any) -> None:
    ours = arq_formats.result_record("j1", "generate", value, "slotq:queue", 1_700_000_000_123, serialize)
    assert ours == serialize_result("generate", (), {}, 0, 1_700_000_000_123, True, value, 1_700_000_000_123,
                                    1_700_000_000_123, "j1", "slotq:queue", "j1", serializer=serialize)
    record, arqs = arq_formats.read_result_record(ours, deserialize), deserialize_result(ours, deserializer=deserialize)
    assert (record.attempts, record.output) == (arqs.job_try, arqs.result if isinstance(arqs.result, dict) else None)


def test_a_result_that_cannot_be_serialized_is_stored_as_arq_stores_it() -> None:
    def fussy(data: dict[str, Any]) -> bytes:
        if not isinstance(data["r"], str):
            raise TypeError("not serializable")
        return serialize(data)

    value = object()
    assert arq_formats.result_record("j1", "generate", value, "q", 5, fussy) == \
        serialize_result("generate", (), {}, 0, 5, True, value, 5, 5, "j1", "q", "j1", serializer=fussy)


def test_the_producer_client_loads_no_arq() -> None:
    probe = "import sys, slotq.jobs.producer.client; print(sorted(m for m in sys.modules if m.split('.')[0] == 'arq'))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]", f"importing the producer client loads arq (any arq module loads arq.worker): {loaded}"
