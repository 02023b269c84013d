"""Where a process learns its job: arguments, then JAX_* (moe-jax launch), torchrun, SLURM; clear errors."""

import pytest

from moe_jax.distributed import ProcessEnvironment, initialize, process_environment


def test_arguments_come_first():
    found = process_environment("10.0.0.1:1234", 4, 3, environ={"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"})
    assert found == ProcessEnvironment(4, 3, "10.0.0.1:1234", "arguments")


@pytest.mark.parametrize("environ, expected", [
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:5000", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1",
      "WORLD_SIZE": "8", "RANK": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     ProcessEnvironment(2, 1, "127.0.0.1:5000", "JAX_*")),
    # torchrun's agent keeps its rendezvous store on MASTER_PORT: the coordinator takes the next port
    ({"WORLD_SIZE": "8", "RANK": "3", "MASTER_ADDR": "node1", "MASTER_PORT": "29500"},
     ProcessEnvironment(8, 3, "node1:29501", "torchrun")),
    ({"SLURM_NTASKS": "16", "SLURM_PROCID": "5", "SLURM_STEP_NODELIST": "gpu[01-02]"},
     ProcessEnvironment(16, 5, None, "SLURM")),
    ({}, ProcessEnvironment(1, 0, None, "single process")),
])
def test_the_environment_names_the_job(environ, expected):
    assert process_environment(environ=environ) == expected


@pytest.mark.parametrize("environ, message", [
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "JAX_COORDINATOR_ADDRESS is not"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR / MASTER_PORT are not"),
    ({"WORLD_SIZE": "two", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "WORLD_SIZE='two'"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2", "JAX_COORDINATOR_ADDRESS": "h:1"}, "process id 2 of 2"),
])
def test_an_incomplete_environment_is_refused_naming_the_variable(environ, message):
    with pytest.raises(ValueError, match=message):
        process_environment(environ=environ)


def test_a_one_process_job_starts_nothing():
    assert initialize(environ={}) == ProcessEnvironment(1, 0, None, "single process")
    with pytest.raises(ValueError, match="needs a coordinator_address"):
        initialize(num_processes=2, process_id=0)


def test_initialize_after_jax_started_says_to_call_it_first():
    import jax

    jax.devices()  # this test process already runs JAX computations
    with pytest.raises(RuntimeError, match="must run before any JAX computation"):
        initialize("127.0.0.1:1", 2, 0)
