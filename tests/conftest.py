"""Tests run on 8 virtual CPU devices, set before JAX initialises.

The subprocesses tests start (`moe-jax train` and its resumed run, `moe-jax launch` jobs, the server) cache
compiled programs on disk (a fresh directory per run, removed at exit), so a program one compiled is loaded by
the next. The pytest processes themselves do not: writing every program they compile cost more (~8% of a
compile-bound file) than the few repeats it saved them. Tests that count compilations count cache hits too
(tests/models/test_apply.py).
"""

import atexit
import gc
import importlib.util
import os
import shutil
import tempfile

# The tests' models are tiny, so their time is XLA's compile time, mostly code generation: level 0 skips
# LLVM's optimisation passes (measured: a gradient test 19.9 s -> 14.3 s), and the older elemental emitters
# generate a fusion's code faster than the MLIR fusion emitters (tests/models/test_gradients.py 39 s -> 26 s
# on a 2-core AMD EPYC). XLA's HLO passes (fusion, SPMD partitioning, collectives) are unchanged, except that
# scatters are expanded into loops on that path: tests that look for a scatter read the jaxpr.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    " --xla_cpu_use_fusion_emitters=false"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="moe_jax_tests_xla_cache_")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    # Environment, not jax.config: subprocesses started by the tests share the cache.
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# Parity tests compare against fp32 references: keep XLA:CPU matmuls at full precision (environment, so
# subprocesses compile the same programs and find them in the cache).
os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"

# Huge pages for XLA:CPU's per-execution buffers (moe_jax/host_memory.py), in the environment before
# pytest-xdist starts its workers and for the subprocesses tests start; the process reading this file keeps
# its own allocator settings (glibc reads them at start).
if importlib.util.find_spec("jax") is not None:
    from moe_jax.host_memory import huge_page_tunables

    if (_tunables := huge_page_tunables(os.environ)) is not None:
        os.environ["GLIBC_TUNABLES"] = _tunables

import pytest  # noqa: E402

# Without JAX only the tests that read sources can run (tests/test_layering.py); the rest fail on their imports.
if importlib.util.find_spec("jax") is not None:
    import jax

    jax.config.update("jax_enable_x64", False)
    jax.config.update("jax_enable_compilation_cache", False)  # this process only; see the module docstring

# Tracing builds and drops many small objects, so the cyclic collector runs often, and its full collections walk
# every object the imports left (jax, flax, the tests' modules). Those are frozen after collection, and the youngest
# generation is collected per 50,000 allocations instead of 700 (measured: tracing 20% faster, a compile-bound
# file 5%).
gc.set_threshold(50_000, 20, 1_000)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


# The longest files first, longest of all first: pytest-xdist (--dist loadfile) hands out files in collection
# order, so a long file collected last would keep one worker busy after the other has finished.
LONGEST_FIRST = ("tests/multiprocess/", "tests/inference/test_continuous.py", "tests/test_docs.py",
                 "tests/models/test_context_parallel.py", "tests/serving/test_server.py",
                 "tests/lora/test_many_adapters.py", "tests/models/test_pipeline.py",
                 "tests/serving/test_server_limits.py", "tests/distributed/test_redundant_experts.py",
                 "tests/training/test_balance.py", "tests/inference/test_speculative.py",
                 "tests/training/test_step.py", "tests/models/test_apply.py", "tests/training/test_train_job.py")


def _schedule_rank(item) -> int:
    return next((rank for rank, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)),
                len(LONGEST_FIRST))


def pytest_addoption(parser):
    parser.addoption("--heavy", action="store_true",
                     help="also run the tests marked `heavy` (whole grids and long end-to-end runs; "
                          "scripts/run_heavy_tests.sh runs them alone)")


def pytest_report_header(config):
    if not config.getoption("--heavy"):
        return "tests marked heavy are deselected (--heavy, or scripts/run_heavy_tests.sh alone, runs them)"
    return None


def pytest_collection_modifyitems(config, items):
    items.sort(key=_schedule_rank)
    # `heavy` tests repeat what a representative case in the suite already checks (more families, layouts or
    # stage counts) at a cost CI's 15 minutes cannot carry; they are deselected, not skipped, and run before an
    # issue is resolved (scripts/run_heavy_tests.sh).
    if not config.getoption("--heavy"):
        heavy = [item for item in items if "heavy" in item.keywords]
        if heavy:
            config.hook.pytest_deselected(items=heavy)
            items[:] = [item for item in items if "heavy" not in item.keywords]
    # The live comparisons need the reference (pip install -e ".[reference]"); without it they are skipped
    # by name, not failed on an import deep inside a helper.
    missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        skip = pytest.mark.skip(reason=f"needs the PyTorch reference ({', '.join(missing)} not installed)")
        for item in items:
            if "reference" in item.keywords or "peft" in item.keywords:
                item.add_marker(skip)
    # PEFT is part of the reference extra; a reference install without it skips the LoRA comparisons the same way.
    if not missing and importlib.util.find_spec("peft") is None:
        skip = pytest.mark.skip(reason="needs the PyTorch reference's peft (not installed)")
        for item in items:
            if "peft" in item.keywords:
                item.add_marker(skip)


# CI's second pass (.ci/run): the first runs the README's command on the README's install, where the live
# comparisons skip; with MOE_JAX_REFERENCE_SKIPS=FILE it writes the node ids skipped for want of torch or
# transformers into FILE (one a line, for `pytest @FILE` once they are installed).
REFERENCE_SKIP_REASONS = ("torch", "transformers", "PyTorch reference", "peft")


def pytest_runtest_logreport(report):
    path = os.environ.get("MOE_JAX_REFERENCE_SKIPS")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if any(word in reason for word in REFERENCE_SKIP_REASONS):
        with open(path, "a", encoding="utf-8") as skipped:
            skipped.write(report.nodeid + "\n")
