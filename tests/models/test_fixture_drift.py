"""The committed PyTorch fixtures still are what transformers computes from their committed checkpoints.

test_fixture_parity.py trusts `tests/fixtures/models/<model_type>/reference.npz` without torch; here (CI
installs torch) each one is recomputed from the checkpoint beside it with `fixture_arrays`, the function
scripts/fixtures/make_model_fixtures.py wrote it with, so a checkpoint or logits file changed alone shows up.
"""

import numpy as np
import pytest

from .hf_reference import fixture_arrays
from .test_fixture_parity import FAMILIES, FIXTURES

# PyTorch recomputing the same fp32 logits on another machine or thread count differs by ~1.2e-7; a 1% change
# to any family's routed experts moves them by 4e-5 or more (test_fixture_parity.py).
RECOMPUTE_ATOL = 1e-6


@pytest.mark.reference
@pytest.mark.parametrize("model_type", FAMILIES)
def test_fixture_logits_are_recomputed_from_its_checkpoint(model_type):
    torch = pytest.importorskip("torch")
    import transformers

    directory = FIXTURES / model_type
    committed = np.load(directory / "reference.npz")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    recomputed = fixture_arrays(model)

    assert sorted(committed.files) == sorted(recomputed)
    np.testing.assert_array_equal(committed["input_ids"], recomputed["input_ids"])
    np.testing.assert_array_equal(committed["attention_mask"], recomputed["attention_mask"])
    np.testing.assert_allclose(committed["logits"], recomputed["logits"], atol=RECOMPUTE_ATOL, rtol=0)
    assert abs(float(committed["aux_loss"]) - float(recomputed["aux_loss"])) < 1e-6


@pytest.mark.reference
@pytest.mark.parametrize("model_type", FAMILIES)
def test_low_precision_fixture_is_recomputed_from_its_checkpoint(model_type):
    """`reference_low_precision.npz` (the bar of tests/models/test_low_precision.py) is PyTorch's bf16 / fp16
    run of the committed checkpoint: recomputed here, its distance to the fp32 logits is the committed one's
    (within 10%: another machine's thread count reorders low-precision sums). The fixtures were made where
    PyTorch's CPU kernels use AVX-512; on a CPU without it PyTorch's float16 kernels round differently (an AMD EPYC
    with AVX2, Llama 4: max 6.3e-3, rms 3.1e-4 against the committed 6.0e-4, 1.1e-4), so float16 is then held to
    the same order of magnitude only; bfloat16 keeps the 10%."""
    torch = pytest.importorskip("torch")
    from .hf_reference import low_precision_arrays
    from .low_precision import LOW_PRECISION_DTYPES, LogitsError, fixture_reference

    committed = np.load(FIXTURES / model_type / "reference_low_precision.npz")
    recomputed = low_precision_arrays(FIXTURES / model_type)
    reference = fixture_reference(model_type)
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    for dtype in LOW_PRECISION_DTYPES:
        ours, theirs = (LogitsError.between(arrays[f"logits_{dtype}"], reference) for arrays in (recomputed, committed))
        message = f"{model_type} {dtype}: recomputed {ours}, committed {theirs}"
        if dtype == "float16" and not avx512:
            assert theirs.rms / 10 <= ours.rms <= theirs.rms * 10, message
            assert theirs.max / 10 <= ours.max <= theirs.max * 20, message
            continue
        assert ours.rms == pytest.approx(theirs.rms, rel=0.1) and ours.max == pytest.approx(theirs.max, rel=0.1), message
