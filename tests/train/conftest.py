"""Tiny configs shared by the train tests (equal shapes let tests reuse compiled programs)."""

import os
import shutil
import subprocess
import uuid

import pytest

from scalestudy.config.experiment import ExperimentConfig, load_config

ARCH_CELL = {"causal_decoder": "flm", "noncausal_decoder": "plm", "encoder_decoder": "mlm"}

TINY = [
    "model.d_model=32",
    "model.d_ff=64",
    "model.n_heads=2",
    "model.n_layers=2",
    "model.rel_max_distance=32",
    "model.dropout=0.1",  # exact resume must reproduce the dropout masks too
    "objective.inputs_length=24",
    "objective.targets_length=8",
    "data.synthetic.n_train_documents=300",
    "data.synthetic.n_validation_documents=40",
    "train.batch_size=16",
    "train.steps=40",  # resume tests stop early (stop_after_steps); overfitting uses all 40
    "train.log_every=1",
    "train.checkpoint_every=4",
    "train.eval_batches=1",
    "train.progress=false",
    "optim.schedule=wsd",
    "optim.learning_rate=0.01",
    "optim.warmup_steps=2",
    "optim.cooldown_steps=4",
]


def tiny(
    arch: str = "causal_decoder", objective: str | None = None, *more: str
) -> ExperimentConfig:
    """A tiny experiment config; `more` are extra dotted overrides."""
    objective = objective or ARCH_CELL[arch]
    return load_config(None, [*TINY, f"model.arch={arch}", f"objective.name={objective}", *more])


@pytest.fixture(scope="session")
def tiny_cfg():
    return tiny


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """A private persistent compilation cache, shared with subprocesses the tests start."""
    os.environ.setdefault("SCALESTUDY_JAX_CACHE", str(tmp_path_factory.mktemp("jax_cache")))


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs (root only; where mounting is not allowed the test is skipped): room for
    two tiny checkpoints, what a failed save wrote before it was sealed (nothing of it lands
    after) and train.log once the filler is gone."""
    path = tmp_path / "disk"
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", f"scalestudy-{uuid.uuid4().hex[:8]}", path],
        capture_output=True,
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield path
    subprocess.run(["umount", "-l", path], check=False)


@pytest.fixture
def fill():
    """`fill(path, leave)`: fill the file system of `path` until `leave` bytes are free."""

    def fill(path, leave: int) -> None:
        st = os.statvfs(path)
        free = st.f_bavail * st.f_frsize
        with (path / "filler").open("wb") as f:
            f.write(b"\0" * max(free - leave, 0))

    return fill
