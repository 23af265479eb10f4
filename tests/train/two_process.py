"""One job of two local processes of four CPU devices each, joined through jax.distributed
into one 8-device mesh as on two hosts: the tiny config both multi-process test files train,
and each process's environment."""

import socket

# d_model 32, 2 layers, rows of 24 + 8, 6 steps with a checkpoint every 3, float32 (so the
# two-process run can equal the one-process one), batch 16 over data 4 x fsdp 2.
OVERRIDES = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.d_ff=64",
    "model.dtype=float32",
    "objective.inputs_length=24",
    "objective.targets_length=8",
    "train.steps=6",
    "train.batch_size=16",
    "train.log_every=1",
    "train.eval_batches=1",
    "train.checkpoint_every=3",
    "train.progress=false",
    "mesh.data=4",
    "mesh.fsdp=2",
]


def free_port() -> int:
    """A TCP port free on this host now, for the job's coordinator."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(process_id: int, port: int) -> dict[str, str]:
    """The variables that make a process `process_id` of the two-process job whose
    coordinator listens on `port`, with four CPU devices of its own."""
    return {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "SCALESTUDY_COORDINATOR": f"127.0.0.1:{port}",
        "SCALESTUDY_NUM_PROCESSES": "2",
        "SCALESTUDY_PROCESS_ID": str(process_id),
    }
