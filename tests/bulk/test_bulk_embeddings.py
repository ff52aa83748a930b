"""``slotq bulk`` over embedding lines: slotq lines (``{"inputs": [...]}``) and OpenAI Batch lines to
``/v1/embeddings``, on a real ``slotq worker --embeddings`` (tiny model); memory stays flat as the
file grows."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from tests.bulk.test_bulk import fleet, leftover_keys, read_jsonl, run_bulk_cli, write_jsonl
from tests.support.jobs import clean_env, wait_for_workers


def text_lines(n: int) -> list[dict[str, object]]:
    return [{"id": f"doc-{i}", "inputs": [f"document number {i} about queues and slots"]} for i in range(1, n + 1)]


async def test_embedding_lines_in_both_formats(client, redis_url, tiny_model_path, tmp_path: Path) -> None:
    lines = [
        *text_lines(3),
        {"custom_id": "e1", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "tiny", "input": ["first text", "second text"], "encoding_format": "base64"}},
        {"custom_id": "e2", "method": "POST", "url": "/v1/embeddings", "body": {"model": "tiny", "input": "x" * 9000}},
        {"custom_id": "e3", "method": "POST", "url": "/v1/embeddings", "body": {"model": "tiny", "input": "x",
                                                                               "dimensions": 8}},
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    procs = fleet(("emb-w1",), redis_url, tiny_model_path, tmp_path, embeddings="true")
    try:
        await wait_for_workers(client, {"emb-w1"}, procs=procs)
        code, _out, err = await run_bulk_cli(str(inp), "-o", "out.jsonl", "--errors", "bad.jsonl", "--quiet",
                                             env=clean_env(redis_url=redis_url), cwd=tmp_path)
    finally:
        for p in procs:
            p.stop()
    assert code == 1, err
    records = {r.get("custom_id") or r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert set(records) == {"doc-1", "doc-2", "doc-3", "e1"}
    doc = records["doc-2"]
    assert doc["status"] == "succeeded" and doc["dimensions"] == 128 and len(doc["embeddings"]) == 1
    assert np.isclose(np.linalg.norm(np.frombuffer(base64.b64decode(doc["embeddings"][0]), "<f4")), 1, atol=1e-5)
    body = records["e1"]["response"]["body"]
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
    assert isinstance(body["data"][0]["embedding"], str) and body["usage"]["prompt_tokens"] > 0
    errors = {r["custom_id"]: r for r in read_jsonl(tmp_path / "bad.jsonl")}
    assert errors["e2"]["response"]["body"]["error"]["param"] == "input"          # 9000 characters > 512 x 16
    assert errors["e3"]["response"]["body"]["error"]["param"] == "dimensions"
    assert await leftover_keys(client) == []


@pytest.mark.slow
async def test_memory_stays_flat_as_the_file_grows(client, redis_url, tiny_model_path, tmp_path: Path) -> None:
    """The runner's peak RSS for 10x the lines grows by less than a few MB: lines stream through a
    window, and Redis keeps nothing of the finished ones."""
    small = write_jsonl(tmp_path / "small.jsonl", text_lines(200))
    large = write_jsonl(tmp_path / "large.jsonl", text_lines(2000))
    procs = fleet(("emb-w2",), redis_url, tiny_model_path, tmp_path, embeddings="true", slots=16)
    env = clean_env(redis_url=redis_url)
    try:
        await wait_for_workers(client, {"emb-w2"}, procs=procs)
        summaries = []
        for inp in (small, large):
            code, out, err = await run_bulk_cli(str(inp), "-o", f"{inp.stem}.out.jsonl", "--json", "--window", "64",
                                                env=env, cwd=tmp_path, timeout=300)
            assert code == 0, err
            summaries.append(json.loads(out))
    finally:
        for p in procs:
            p.stop()
    assert [s["succeeded"] for s in summaries] == [200, 2000]
    grown = summaries[1]["peak_rss_mb"] - summaries[0]["peak_rss_mb"]
    assert grown < 8, f"peak RSS grew by {grown:.1f} MB for 10x the lines"
    assert await leftover_keys(client) == []


async def test_rerank_lines(client, redis_url, tiny_reranker_path, tmp_path: Path) -> None:
    """slotq lines of ``{"query", "documents"}`` on a reranker's queue: each output carries its scores in
    document order, and nothing of the other kinds' results; a document over the limit fails its line alone."""
    lines = [{"id": f"q-{i}", "query": "cat", "documents": ["the cat sat", "queues", f"doc {i}"]} for i in range(3)]
    lines.append({"id": "too-long", "query": "cat", "documents": ["abc " * 200]})
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    procs = fleet(("rank-w1",), redis_url, tiny_reranker_path, tmp_path, ctx=256, batch=256)
    try:
        await wait_for_workers(client, {"rank-w1"}, procs=procs)
        code, _out, err = await run_bulk_cli(str(inp), "-o", "out.jsonl", "--errors", "bad.jsonl", "--quiet",
                                             env=clean_env(redis_url=redis_url), cwd=tmp_path)
    finally:
        for p in procs:
            p.stop()
    assert code == 1, err
    records = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert set(records) == {"q-0", "q-1", "q-2"}
    for record in records.values():
        assert record["status"] == "succeeded" and len(record["scores"]) == 3 and record["usage"]["prompt_tokens"] > 0
        assert "embeddings" not in record and "dimensions" not in record
    # The same pairs, the same scores (to the rounding of flash attention over other pairs beside them).
    assert records["q-0"]["scores"][:2] == pytest.approx(records["q-1"]["scores"][:2], rel=2e-2)
    [error] = read_jsonl(tmp_path / "bad.jsonl")
    assert error["id"] == "too-long" and error["error"]["field"] == "documents"
    assert await leftover_keys(client) == []
