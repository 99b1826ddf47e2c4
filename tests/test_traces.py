import numpy as np
import pytest
import torch

from zend.simulator.traces import GPT2_VOCAB, TokenTrace, default_tokens_path, load_tokens

pytestmark = pytest.mark.inprocess


def test_bundled_fixture_is_gpt2_tokenized_english():
    tokens = load_tokens(default_tokens_path(), GPT2_VOCAB)
    assert 900_000 < tokens.size < 1_100_000
    assert int(tokens.max()) < GPT2_VOCAB
    assert int((tokens == 50256).sum()) == 6  # one <|endoftext|> after each novel
    # the most frequent GPT-2 tokens of English prose: ',' (11), ' the' (262), '.' (13)
    top = np.bincount(tokens).argsort()[::-1][:5].tolist()
    assert {11, 262, 13} <= set(top)


def test_rows_are_the_distinct_token_ids_of_the_batch():
    trace = TokenTrace.default()
    batch = trace.batch(worker=3, step=2)
    assert batch.shape == (8, 512)
    grad = trace.embedding_grad(3, 2, dim=4)
    assert grad.indices.tolist() == sorted(set(batch.reshape(-1).tolist()))
    assert 900 < grad.nnz < 1600  # GPT-2 BPE batches of 8 x 512 real tokens touch 934-1,459 distinct rows


def test_uncoalesced_grad_has_one_row_per_token():
    trace = TokenTrace.default()
    raw = trace.embedding_grad(0, 0, dim=2, coalesced=False)
    assert raw.nnz == 8 * 512 and not raw.coalesced
    assert torch.equal(raw.coalesce().indices, trace.embedding_grad(0, 0, dim=2).indices)


def test_workers_and_steps_differ_and_overlap_partially():
    trace = TokenTrace.default()
    a, b = set(trace.rows(0, 0)), set(trace.rows(1, 0))
    overlap = len(a & b) / min(len(a), len(b))
    assert 0.15 < overlap < 0.6
    assert not np.array_equal(trace.rows(0, 0), trace.rows(0, 1))


def test_bad_token_files_are_named(tmp_path):
    bad = tmp_path / "ids.npy"
    np.save(bad, np.array([1, 2, 70000]))
    with pytest.raises(ValueError, match="token id 70000 outside vocabulary"):
        load_tokens(bad, GPT2_VOCAB)
    np.save(bad, np.ones((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="1-D integer array"):
        load_tokens(bad, GPT2_VOCAB)
