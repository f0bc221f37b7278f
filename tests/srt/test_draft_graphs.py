"""Stage 0's draft pass from a CUDA graph (``draft_graphs``): buckets, the eager fallback, and on
a GPU replays equal to the eager pass on the same rows."""

import logging

import pytest
import torch

from spexis_sglang.srt import draft_graphs
from spexis_sglang.srt.draft_graphs import MAX_GRAPH_ROWS, DraftPassGraphs, bucket_rows
from spexis_sglang.srt.protocol import pack_drafts


def test_buckets_pad_little():
    assert [bucket_rows(n) for n in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert [bucket_rows(n) for n in (17, 32, 33, 250, 256, 257)] == [32, 32, 48, 256, 256, 272]
    assert bucket_rows(MAX_GRAPH_ROWS) == MAX_GRAPH_ROWS
    assert bucket_rows(MAX_GRAPH_ROWS + 1) is None and bucket_rows(0) is None
    for n in range(1, MAX_GRAPH_ROWS + 1):
        b = bucket_rows(n)
        assert n <= b and (b - n < 16 or n <= 16)


def _head(vocab: int, hidden: int, device, dtype):
    gen = torch.Generator(device="cpu").manual_seed(0)
    weight = torch.randn((vocab, hidden), generator=gen).to(device=device, dtype=dtype)

    def draft(x, buckets):
        logits = x @ weight.T
        top, ids = logits.float().max(dim=-1)
        conf = 1.0 / torch.exp(logits.float() - top.unsqueeze(-1)).sum(dim=-1)
        return ids, conf, pack_drafts(ids, conf, buckets)

    return draft


def test_a_capture_that_fails_leaves_the_pass_eager_and_says_so(caplog):
    graphs = DraftPassGraphs(_head(64, 8, "cpu", torch.float32), 8, torch.float32, "cpu")
    with caplog.at_level(logging.WARNING, logger=draft_graphs.__name__):
        assert graphs.run(torch.ones((3, 8)), 3, None) is None  # no CUDA here: the capture fails
    assert graphs.on is False and graphs.captures == 0
    assert "drafts eagerly" in caplog.text
    assert graphs.run(torch.ones((3, 8)), 3, None) is None  # and stays off, silently
    assert caplog.text.count("drafts eagerly") == 1


def test_off_by_environment(monkeypatch):
    monkeypatch.setenv("SPEXIS_DRAFT_GRAPH", "0")
    graphs = DraftPassGraphs(_head(64, 8, "cpu", torch.float32), 8, torch.float32, "cpu")
    assert graphs.on is False and graphs.run(torch.ones((3, 8)), 3, None) is None


def test_shapes_no_graph_serves_draft_eagerly():
    graphs = DraftPassGraphs(_head(64, 8, "cpu", torch.float32), 8, torch.float32, "cpu")
    x = torch.ones((MAX_GRAPH_ROWS + 1, 8))
    assert graphs.run(x, MAX_GRAPH_ROWS + 1, None) is None  # too many rows
    assert graphs.run(torch.ones((3, 8), dtype=torch.float64), 3, None) is None  # another dtype
    assert graphs.run(torch.ones((3, 4)), 3, None) is None  # another width
    assert graphs.run(torch.ones((2, 8)), 3, None) is None  # fewer rows than asked for
    assert graphs.on is True and graphs.captures == 0  # neither tried a capture


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("with_buckets", [False, True])
def test_replays_equal_the_eager_pass_on_the_same_rows(with_buckets):
    hidden, vocab, dtype = 64, 5000, torch.bfloat16
    draft = _head(vocab, hidden, "cuda", dtype)
    graphs = DraftPassGraphs(draft, hidden, dtype, "cuda")
    gen = torch.Generator(device="cpu").manual_seed(1)
    # sizes in and across buckets, one bucket twice with other values (the replay reads the
    # graph's input as copied this time, and its outputs are this replay's)
    for rows in (5, 7, 40, 33, 40, 1, 200):
        padded = bucket_rows(rows) + 3  # a forward's outputs are padded past the batch
        x = torch.randn((padded, hidden), generator=gen).to("cuda", dtype)
        buckets = None
        if with_buckets:
            buckets = torch.randint(-1, 5, (padded,), generator=gen).to("cuda")
        got = graphs.run(x, rows, buckets)
        assert got is not None
        # the eager pass on the graph's own input (its bucket's rows): bit for bit the same
        size = bucket_rows(rows)
        captured = graphs._graphs[(size, with_buckets)]
        want = draft(captured.x, captured.buckets)
        for g, w in zip(got, want):
            assert g.shape[0] == rows
            assert torch.equal(g, w[:rows])
        # the batch's own rows went in (the bucket's padding rows hold older values)
        assert torch.equal(captured.x[:rows], x[:rows])
        if with_buckets:
            assert torch.equal(got[2][:, 2], buckets[:rows].double())
    assert graphs.captures == 4  # buckets of 8, 48, 1 and 208 rows, each captured once
