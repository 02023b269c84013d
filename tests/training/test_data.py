"""Batch sources: token rows wrap around, synthetic batches repeat, text goes through the checkpoint's
tokenizer, and bad files are refused with their reason."""

import json

import numpy as np
import pytest

from moe_jax.training.data import SyntheticTokens, TokenRows


def test_step_i_trains_on_rows_i_b_to_i_b_plus_b_minus_1_wrapping_around():
    rows = np.arange(5 * 4).reshape(5, 4)
    data = TokenRows(rows, batch_size=2, seq_len=3)
    np.testing.assert_array_equal(data.batch(1)["input_ids"], rows[[2, 3], :3])
    np.testing.assert_array_equal(data.batch(2)["input_ids"], rows[[4, 0], :3])   # wraps
    assert data.batch(2)["input_ids"].dtype == np.int32


def test_synthetic_batches_are_the_same_every_time_they_are_asked_for():
    data = SyntheticTokens(vocab_size=50, batch_size=3, seq_len=7, seed=1)
    np.testing.assert_array_equal(data.batch(4)["input_ids"], data.batch(4)["input_ids"])
    assert not np.array_equal(data.batch(4)["input_ids"], data.batch(5)["input_ids"])
    assert data.batch(0)["input_ids"].max() < 50


@pytest.mark.parametrize("rows, message", [
    (np.zeros((4, 3), np.float64), "must be integers, got dtype float64"),
    (np.zeros(12, np.int32), "must be a 2-D array"),
    (np.zeros((0, 3), np.int32), "holds no tokens"),
])
def test_bad_token_arrays_are_refused(rows, message):
    with pytest.raises(ValueError, match=message):
        TokenRows(rows, batch_size=2)


def test_a_sequence_longer_than_the_rows_is_refused():
    with pytest.raises(ValueError, match="seq_len=5 is not within the 4 tokens per row"):
        TokenRows(np.zeros((3, 4), np.int32), batch_size=1, seq_len=5)


def test_text_is_tokenised_with_the_checkpoint_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocabulary = {"[UNK]": 0, "the": 1, "experts": 2, "route": 3, "tokens": 4}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (tmp_path / "corpus.txt").write_text("the experts route the tokens " * 3 + "the")
    data = TokenRows.from_text(tmp_path / "corpus.txt", tmp_path, batch_size=2, seq_len=4)
    assert data.num_sequences == 4                              # 16 tokens -> 4 rows of 4
    np.testing.assert_array_equal(data.batch(0)["input_ids"], [[1, 2, 3, 1], [4, 1, 2, 3]])
