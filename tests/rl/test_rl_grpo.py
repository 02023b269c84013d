"""`scripts/rl_grpo.py`: GRPO on the tiny model with the sampler's routing replayed writes one record per step
(reward, clip fraction, logprob gap, routing mismatch), TensorBoard's rl/ scalars and a plot_run PNG; over its
default 100 steps (heavy) the reward of the last 10 steps is at least twice the first 10's."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import plot_run  # noqa: E402
import rl_grpo  # noqa: E402


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_short_run_records_every_step_and_plots(tmp_path, capsys):
    jsonl = tmp_path / "grpo.jsonl"
    assert rl_grpo.main(["--steps", "3", "--prompts", "4", "--samples", "4", "--metrics-jsonl", str(jsonl),
                         "--tensorboard", str(tmp_path / "tb")]) == 0
    run = records(jsonl)
    assert [r["step"] for r in run] == [1, 2, 3]
    assert set(run[0]) >= {"reward", "loss", "clip_fraction", "logprob_gap", "routing_mismatch", "grad_norm"}
    # The sampler and the train step compute one network: fp32, the same weights, the routing replayed.
    assert all(r["logprob_gap"] < 1e-5 and r["routing_mismatch"] == 0.0 for r in run)
    assert any(path.name.startswith("events.out") for path in (tmp_path / "tb").iterdir())
    assert plot_run.main([str(jsonl), "-o", str(tmp_path / "grpo.png")]) == 0
    assert "mean reward: first 3 steps" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        rl_grpo.main(["--samples", "1"])


@pytest.mark.heavy
def test_the_reward_doubles_over_the_default_run(tmp_path):
    jsonl = tmp_path / "grpo.jsonl"
    assert rl_grpo.main(["--metrics-jsonl", str(jsonl)]) == 0
    reward = [r["reward"] for r in records(jsonl)]
    assert len(reward) == 100 and sum(reward[-10:]) >= 2 * sum(reward[:10])
