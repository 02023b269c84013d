"""The rollout batch: prompt and completion right-padded, only the completion labelled, the sampler's log
probabilities and the advantages aligned with the predictions, the routing padded with -1; and the routing
mismatch counts changed expert sets, not orders."""

from types import SimpleNamespace

import numpy as np
import pytest

from moe_jax.rl import rollout_batch, routing_mismatch


def output(prompt, generated, logprobs, routing=None, request_id="r"):
    return SimpleNamespace(request_id=request_id, prompt_ids=prompt, generated_tokens=generated, logprobs=logprobs,
                           routing=routing)


def test_the_batch_labels_the_completion_and_aligns_logprobs_with_the_predictions():
    routing = np.arange(2 * 4 * 2).reshape(2, 4, 2)          # [L, P + G, K]
    outputs = [output([5, 6, 7], [8], [-0.5], routing), output([5, 6], [9, 3], [-0.25, -1.0], routing)]
    batch = rollout_batch(outputs, [1.0, -1.0], length=6, pad_token_id=0)
    np.testing.assert_array_equal(batch["input_ids"], [[5, 6, 7, 8, 0, 0], [5, 6, 9, 3, 0, 0]])
    np.testing.assert_array_equal(batch["attention_mask"], [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(batch["labels"], [[-100, -100, -100, 8, -100, -100], [-100, -100, 9, 3, -100, -100]])
    # Position t holds the sampler's log probability of the token at t + 1.
    np.testing.assert_array_equal(batch["old_logprobs"], [[0, 0, -0.5, 0, 0, 0], [0, -0.25, -1.0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["advantages"][:, 0], [1.0, -1.0])
    assert batch["routing"].shape == (2, 2, 6, 2)
    np.testing.assert_array_equal(batch["routing"][0, :, :4], routing)
    assert (batch["routing"][:, :, 4:] == -1).all()
    assert "routing" not in rollout_batch([output([1], [2], [-1.0])], [0.0], length=3)
    with pytest.raises(ValueError, match="do not fit length=3"):
        rollout_batch(outputs, [1.0, -1.0], length=3)
    with pytest.raises(ValueError, match="1 logprobs for 2 generated tokens: sample with logprobs=True"):
        rollout_batch([output([1], [2, 3], [-1.0])], [0.0], length=4)


def test_routing_mismatch_counts_changed_expert_sets_over_recorded_rows():
    recorded = np.array([[[[0, 1], [2, 3], [4, 5], [-1, -1]]]])     # [N=1, L=1, S=4, K=2]
    recomputed = np.array([[[[1, 0], [2, 7], [4, 5], [6, 7]]]])     # same set, changed, same, unrecorded
    assert routing_mismatch(recorded, recomputed) == pytest.approx(1 / 3)
