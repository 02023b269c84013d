"""Who holds the memory at the peak, from XLA's live-range dump: forward activations, backward buffers, others."""

from moe_jax.planning.peak_memory import pass_of, peak_holders

DUMP = """HloLiveRange (max 10):
  Live ranges at 5 (peak):
    fusion.1{}: 100 bytes
  Stack trace breakdown for peak usage: 1 234 567 bytes
    main.1 (100.0%, total: 1 234 567 bytes, current: 0 bytes, remaining: 1 234 567 bytes)
      ├── jit(_step)/while/body/closed_call/jvp()/while (50.0%, total: 1 000 000 bytes, current: 0 bytes, remaining: 234 567 bytes)
      │   └── jit(_step)/while/body/closed_call/jvp()/while/body/dynamic_update_slice (50.0%, total: 1 000 000 bytes, current: 1 000 000 bytes, remaining: 234 567 bytes)
      ├── jit(_step)/while/body/closed_call/transpose(jvp())/dot_general (20.0%, total: 200 000 bytes, current: 200 000 bytes, remaining: 34 567 bytes)
      ├── convert.7 (1.0%, total: 30 000 bytes, current: 30 000 bytes, remaining: 4 567 bytes)
      ├── state (1.0%, total: 9 999 bytes, current: 0 bytes, remaining: 4 567 bytes)
      │   └── params (1.0%, total: 9 999 bytes, current: 9 999 bytes, remaining: 4 567 bytes)
      ├── state.opt_state[0].mu['lm_head.weight'] (1.0%, total: 7 bytes, current: 7 bytes, remaining: 4 567 bytes)
      └── copy.3 (0.4%, total: 4 567 bytes, current: 4 567 bytes, remaining: 0 bytes)
"""


def test_the_peak_is_split_by_the_pass_that_made_each_buffer():
    """A loop's buffers count under the loop (its total); the step's arguments (`state`) are left out."""
    peak = peak_holders(DUMP, widened=frozenset({"convert.7"}))
    assert (peak.forward, peak.backward, peak.widened, peak.other) == (1_000_000, 200_000, 30_000, 4_567)
    assert peak.total == 1_234_567


def test_pass_names():
    assert pass_of("jit(_step)/transpose(jvp(jit(silu)))/mul") == "backward"
    assert pass_of("jit(_step)/jvp(jit(silu))/mul") == "forward"
    assert pass_of("jit(_step)/add") == "other"
    assert peak_holders("no breakdown here") is None
