"""What a user's terminal shows when a run meets a fault: the run's own line, nothing from
the libraries. TensorFlow's C++ start-up lines, and the tracebacks that tensorstore's and
asyncio's leftovers of a failed save print, go to the run's train.log instead."""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from scalestudy.cli import main as cli
from scalestudy.config.errors import ScalestudyError
from scalestudy.config.experiment import to_yaml
from scalestudy.train import loop
from scalestudy.train.rundir import layout as rundir
from scalestudy.train.rundir import logfile, saved_run
from scalestudy.train.runtime import stop_signals


def _user_env() -> dict[str, str]:
    """The environment of a user who has chosen neither a TensorFlow log level nor JAX's
    platforms (the test session sets both)."""
    drop = (logfile.TF_LOG_LEVEL, logfile.TF_LOG_LEVEL_DEFAULTED, "JAX_PLATFORMS")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _cli_train(tmp_path, cfg, *more) -> tuple[int, list[str]]:
    """`scalestudy train` as a user runs it; (exit status, stderr lines)."""
    (tmp_path / "cfg.yaml").write_text(to_yaml(cfg))
    command = [sys.executable, "-m", "scalestudy.cli.main", "train", "--config", "cfg.yaml"]
    done = subprocess.run(
        [*command, "--workdir", "run", *more],
        cwd=tmp_path,
        env=_user_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done.returncode, done.stderr.splitlines()


def _flip_bytes(path, n=16):
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + n] = bytes(b ^ 0xFF for b in data[middle : middle + n])
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------- the command line


def test_a_host_without_accelerators_keeps_jax_off_libtpu():
    """With the `tpu` extra installed, a host without TPU chips (and no GPU plugin) gets the CPU
    platform, so libtpu never prints its search for a chip; a user's own choice stands."""
    import glob

    import scalestudy

    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        pytest.skip("this host has TPU chips")
    if scalestudy._gpu_plugin_installed():
        pytest.skip("a GPU plugin is installed: JAX chooses between GPU and CPU itself")
    probe = "import os, scalestudy; print(os.environ['JAX_PLATFORMS'])"
    env = _user_env()
    chosen = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert chosen.stdout.strip() == "cpu", chosen.stderr
    env["JAX_PLATFORMS"] = "cpu,tpu"
    kept = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert kept.stdout.strip() == "cpu,tpu", kept.stderr


def test_a_config_error_is_the_only_output(tiny_cfg, tmp_path):
    code, lines = _cli_train(tmp_path, tiny_cfg("causal_decoder"), "model.d_model=banana")
    assert code == 2, lines
    assert lines == [
        "error: cfg.yaml: invalid config: model.d_model: Input should be a valid integer; "
        "got 'banana'"
    ]


@pytest.mark.slow
def test_a_config_error_found_once_the_data_starts_is_the_only_line(tiny_cfg, tmp_path):
    """A vocabulary too small for the data is found after TensorFlow has started."""
    code, lines = _cli_train(tmp_path, tiny_cfg("causal_decoder"), "model.vocab_size=64")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and "vocab_size" in lines[0]
    assert not (tmp_path / "run").exists()  # refused: the disk as it was found


def test_a_run_refused_before_its_first_step_leaves_the_disk_as_found(tiny_cfg, tmp_path):
    """config.yaml, run.lock and train.log of a run the data refused are removed again: from a
    --workdir it made, and from one that was there (empty, or holding the user's files)."""
    cfg = tiny_cfg("causal_decoder", None, "model.vocab_size=64")
    with pytest.raises(ScalestudyError, match="vocab_size"):
        loop.train(cfg, tmp_path / "new")
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("the user's")
    with pytest.raises(ScalestudyError, match="vocab_size"):
        loop.train(cfg, tmp_path / "mine")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def test_a_run_lock_refusal_is_the_only_line(tiny_cfg, tmp_path):
    (tmp_path / "run").mkdir()
    with rundir.run_lock(tmp_path / "run") as holder:
        code, lines = _cli_train(tmp_path, tiny_cfg("causal_decoder"))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: the run directory") and f"pid {holder['pid']}" in lines[0]


@pytest.mark.slow
def test_a_nan_is_the_only_line(tiny_cfg, tmp_path):
    cfg = tiny_cfg("causal_decoder", None, "train.stop_after_steps=4", "optim.learning_rate=1e30")
    code, lines = _cli_train(tmp_path, cfg)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: training loss is nan at step")


@pytest.mark.slow
def test_a_corrupt_checkpoint_is_one_warning_line(tiny_cfg, tmp_path):
    cfg = tiny_cfg("causal_decoder", None, "train.stop_after_steps=8")
    loop.train(cfg, tmp_path / "run")
    files = [p for p in (tmp_path / "run" / "checkpoints" / "8" / "train").rglob("*")]
    _flip_bytes(max((p for p in files if p.is_file()), key=lambda p: p.stat().st_size))
    code, lines = _cli_train(tmp_path, cfg)
    assert code == 0 and len(lines) == 1, lines
    assert lines[0].startswith("warning: checkpoint at step 8 cannot be restored")
    assert "checksums" in lines[0] and saved_run.latest_step(tmp_path / "run") == 8


@pytest.mark.slow
def test_a_full_disk_is_the_only_line(tiny_cfg, small_disk, fill):
    """The failed save's writer threads print tracebacks (tensorstore's callbacks on a closed
    event loop, asyncio's never-retrieved futures) before and after the error: none of them
    reaches the terminal."""
    loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=4"), small_disk / "run")
    fill(small_disk, leave=160 * 1024)
    cfg = tiny_cfg("causal_decoder", None, "train.stop_after_steps=40")
    code, lines = _cli_train(small_disk, cfg)
    assert code == 2 and len(lines) == 1, lines[:40]
    assert lines[0].startswith("error: cannot write the checkpoint of step 8")
    assert "No space left on device" in lines[0] and saved_run.latest_step(small_disk / "run") == 4


# ----------------------------------------------------------------------------- the mechanisms


def test_native_output_is_held_for_the_runs_log_or_shown_on_failure(tmp_path, capfd):
    with logfile.native_output_held("a library"):
        os.write(2, b"I0000 a C++ start-up line\n")
    assert capfd.readouterr().err == ""
    with logfile.library_logs_to_file(tmp_path):
        pass
    log = rundir.log_path(tmp_path).read_text()
    assert "output of a library on start-up\nI0000 a C++ start-up line\n" in log

    with pytest.raises(ImportError), logfile.native_output_held("a broken library"):
        os.write(2, b"why it failed\n")
        raise ImportError("broken")
    assert capfd.readouterr().err == "why it failed\n"  # a failure shows what it said


def test_the_first_import_is_held_and_later_ones_are_normal(tmp_path, capfd, monkeypatch):
    (tmp_path / "noisy_native.py").write_text("import os\nos.write(2, b'native noise\\n')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", [logfile._HeldImport("noisy_native"), *sys.meta_path])
    monkeypatch.setattr(logfile, "_held", [])
    import noisy_native

    assert capfd.readouterr().err == ""
    assert logfile._held == ["--- output of noisy_native on start-up\nnative noise\n"]
    assert not any(isinstance(f, logfile._HeldImport) for f in sys.meta_path)
    del sys.modules["noisy_native"]
    import noisy_native  # noqa: F401, F811

    assert capfd.readouterr().err == "native noise\n"
    del sys.modules["noisy_native"]


def test_a_signal_during_a_held_import_stops_once_the_import_is_over(tmp_path, monkeypatch):
    """A stop signal while a native library is first imported is answered once its import is
    over: raised half-way through, it could leave the library broken (a segfault, with no
    `stopped:` line, in 2 of 20 Ctrl-Cs at start-up)."""
    (tmp_path / "slow_native.py").write_text(
        "import os, pathlib, signal\nos.kill(os.getpid(), signal.SIGINT)\n"
        f"pathlib.Path({str(tmp_path / 'finished')!r}).touch()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    hook = logfile._HeldImport("slow_native", output=False)
    monkeypatch.setattr(sys, "meta_path", [hook, *sys.meta_path])
    previous = {s: signal.getsignal(s) for s in stop_signals.SIGNALS}
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal (see below)
    stop_signals.catch()
    try:
        with pytest.raises(stop_signals.Stopped, match="SIGINT"):
            import slow_native  # noqa: F401
        assert (tmp_path / "finished").exists()  # the whole module ran first
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        stop_signals._caught.clear()
        sys.modules.pop("slow_native", None)


def test_tensorflow_feeds_data_on_the_host_and_says_nothing_on_the_terminal():
    """The command's TensorFlow sees no GPU (it would take the memory JAX trains in), and its
    search for one (CUDA's failure on a host without a GPU) is held with its start-up output."""
    pytest.importorskip("tensorflow")
    code = (
        "from scalestudy.train.rundir import logfile\n"
        "logfile.quiet_terminal()\n"
        "import tensorflow as tf\n"
        "ds = tf.data.Dataset.range(3).map(lambda x: x + 1)\n"
        "print(list(map(int, ds.as_numpy_iterator())), tf.config.get_visible_devices('GPU'))\n"
    )
    drop = (logfile.TF_LOG_LEVEL, logfile.TF_LOG_LEVEL_DEFAULTED)  # the suite's own level
    env = {k: v for k, v in os.environ.items() if k not in drop}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-800:]
    assert done.stdout.split() == ["[1,", "2,", "3]", "[]"]
    assert done.stderr == ""


def test_a_users_tensorflow_log_level_is_left_alone(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setattr(logfile, "_cli", False)
    monkeypatch.delitem(sys.modules, "tensorflow", raising=False)
    monkeypatch.setenv(logfile.TF_LOG_LEVEL, "0")
    monkeypatch.delenv(logfile.TF_LOG_LEVEL_DEFAULTED, raising=False)
    logfile.quiet_terminal()
    assert os.environ[logfile.TF_LOG_LEVEL] == "0"
    assert not any(isinstance(f, logfile._HeldImport) for f in sys.meta_path)
    monkeypatch.delenv(logfile.TF_LOG_LEVEL)
    logfile.quiet_terminal()
    assert os.environ[logfile.TF_LOG_LEVEL] == logfile.DEFAULT_TF_LOG_LEVEL
    assert os.environ[logfile.TF_LOG_LEVEL_DEFAULTED] == "1"
    assert sum(isinstance(f, logfile._HeldImport) for f in sys.meta_path) == 1
    logfile.quiet_terminal()  # a subprocess inherits both variables: still the default
    assert sum(isinstance(f, logfile._HeldImport) for f in sys.meta_path) == 1


def test_library_thread_tracebacks_and_late_records_go_to_the_log(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(logfile, "_cli", True)
    hooks = sys.excepthook, sys.unraisablehook

    def callback_on_a_closed_loop():  # what tensorstore's completion callback prints
        try:
            raise RuntimeError("Event loop is closed")
        except RuntimeError:
            sys.excepthook(*sys.exc_info())

    try:
        with logfile.library_logs_to_file(tmp_path):
            thread = threading.Thread(target=callback_on_a_closed_loop)
            thread.start()
            thread.join()
        # After the run, as asyncio does at garbage collection or at exit.
        logging.getLogger("asyncio").error("Future exception was never retrieved")
    finally:
        while logfile._after:
            logfile._after.pop()()
    assert (sys.excepthook, sys.unraisablehook) == hooks
    assert capfd.readouterr().err == ""
    log = rundir.log_path(tmp_path).read_text()
    assert "RuntimeError: Event loop is closed" in log
    assert "asyncio: Future exception was never retrieved" in log


def test_warnings_of_the_package_are_one_line_and_the_libraries_go_to_the_log(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(warnings, "showwarning", logfile._show_warning)
    ours = str(Path(logfile.__file__).parent / "loop.py")
    with logfile.library_logs_to_file(tmp_path):
        warnings.warn_explicit("checkpoint at step 8\ncannot be restored", UserWarning, ours, 86)
        warnings.warn_explicit("a deprecated call", FutureWarning, "/lib/site/x.py", 3)
    assert capsys.readouterr().err == "warning: checkpoint at step 8 cannot be restored\n"
    log = rundir.log_path(tmp_path).read_text()
    assert "py.warnings: FutureWarning at /lib/site/x.py:3: a deprecated call" in log


def test_a_log_on_a_full_disk_never_hides_the_runs_error(tmp_path, capfd):
    """The library log shares the disk the run filled: its records and its last buffer are
    dropped, and the run's own error is the one raised."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (writes fail with ENOSPC)")
    rundir.log_path(tmp_path).symlink_to("/dev/full")

    class SaveFailed(Exception):
        pass

    with pytest.raises(SaveFailed), logfile.library_logs_to_file(tmp_path):
        for _ in range(100):  # more than one buffer
            logging.getLogger("orbax").error("a failed write of the save " + "x" * 200)
        raise SaveFailed
    assert capfd.readouterr().err == ""


# ----------------------------------------------------------------------------- signals


def _catches_sigterm(pid: int) -> bool:
    """Whether process `pid` has a handler for SIGTERM (Python sets none of its own: this is
    the command's, set as its first act)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def _as_from_a_terminal() -> None:
    """A command started from a terminal takes SIGINT's default. The suite itself may run as a
    background job, whose SIGINT is ignored and stays ignored in what it starts (the command
    keeps an ignored SIGINT ignored, as Python does)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signalled_train(tmp_path, cfg, signum, when) -> tuple[int, str]:
    """`scalestudy train` sent `signum` once `when(run directory, pid)` holds; (status, stderr)."""
    (tmp_path / "cfg.yaml").write_text(to_yaml(cfg))
    command = [sys.executable, "-m", "scalestudy.cli.main", "train", "--config", "cfg.yaml"]
    proc = subprocess.Popen(
        [*command, "--workdir", "run"],
        cwd=tmp_path,
        env=_user_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_from_a_terminal,
    )
    deadline = time.monotonic() + 300
    while (
        not when(tmp_path / "run", proc.pid) and proc.poll() is None and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


@pytest.mark.parametrize(
    "signum, moment",
    [
        (signal.SIGINT, "importing"),
        (signal.SIGTERM, "importing"),
        (signal.SIGINT, "building"),
        (signal.SIGTERM, "building"),
    ],
)
def test_a_signal_during_start_up_stops_with_one_line(tiny_cfg, tmp_path, signum, moment):
    """Ctrl-C or SIGTERM before the training loop starts (imports, data, compiling): one
    `stopped:` line and 128 + signal, as inside the loop. They were a KeyboardInterrupt
    traceback, a SIGTERM death without a word, or a Ctrl-C swallowed and the run trained on."""
    if moment == "importing":  # the command's handler is set; the commands are not imported
        when = lambda run, pid: _catches_sigterm(pid)
    else:  # the run directory is locked: its data and program are being built
        when = lambda run, pid: (run / rundir.LOCK).exists()
    status, err = _signalled_train(tmp_path, tiny_cfg("causal_decoder"), signum, when)
    lines = err.splitlines()
    assert status == 128 + signum, err
    assert len(lines) == 1 and lines[0].startswith("stopped: "), err
    assert signal.Signals(signum).name in lines[0]


def test_a_signal_a_library_wrapped_in_its_own_error_still_stops(monkeypatch, capsys):
    """pydantic's JSON serializer turns a Stopped raised inside a field's callback (the
    signal arriving there) into a PydanticSerializationError: once a stop signal came, the
    command stops with its one line; without one, the error is the library's own."""
    from pydantic import BaseModel, Field
    from pydantic_core import PydanticSerializationError

    def raise_stop(value):
        raise stop_signals.Stopped(signal.SIGINT)

    class Section(BaseModel):
        x: int = Field(1, exclude_if=raise_stop)

    def command(args):
        Section().model_dump_json()

    monkeypatch.setattr(cli, "parse_args", lambda argv: SimpleNamespace(fn=command))
    monkeypatch.setattr(cli.cli_args, "check_environment", lambda: None)
    with pytest.raises(PydanticSerializationError, match=r"SIGINT received"):
        cli.main(["train"])  # no signal came: the library's error, as it was
    monkeypatch.setattr(stop_signals, "_caught", [signal.SIGINT])
    assert cli.main(["train"]) == 128 + signal.SIGINT
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("stopped: SIGINT received")


def test_a_swallowed_signal_still_stops_the_run_at_its_first_step(tiny_cfg, tmp_path):
    """A start-up signal whose exception a library dropped (raised inside a garbage-collection
    callback) is recorded; the loop stops at its first step boundary instead of training."""
    stop_signals._caught[:] = [signal.SIGINT]
    try:
        with pytest.raises(loop.Preempted, match="SIGINT received: no step had completed"):
            loop.train(tiny_cfg("causal_decoder"), tmp_path)
    finally:
        stop_signals._caught.clear()
    assert saved_run.latest_step(tmp_path) is None and not rundir.read_metrics(tmp_path)


class _LogsWhenCollected:
    """Stands for a failed save's future: garbage in a reference cycle, it logs when collected."""

    def __init__(self):
        self.cycle = self

    def __del__(self):
        logging.getLogger("asyncio").error("Future exception was never retrieved")


def test_the_runs_log_collects_a_failed_saves_garbage_and_only_then(tmp_path, monkeypatch):
    import gc

    collections = []
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(a) or 0)
    with logfile.library_logs_to_file(tmp_path):
        pass
    assert collections == []  # a run that ended well: the heap is not walked
    with pytest.raises(RuntimeError), logfile.library_logs_to_file(tmp_path):
        raise RuntimeError("the run failed")
    assert len(collections) == 1
    monkeypatch.undo()

    (tmp_path / "saved").mkdir()
    gc.disable()  # the cycle below is collected by the block, not by chance
    try:
        with logfile.library_logs_to_file(tmp_path / "saved"):
            _LogsWhenCollected()
            logfile.expect_late_records()  # as a failed save says
    finally:
        gc.enable()
    log = rundir.log_path(tmp_path / "saved").read_text()
    assert "asyncio: Future exception was never retrieved" in log
