"""Test set-up: 8 fake CPU devices (set before JAX is imported) and shared fixtures."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
# `make test` runs most tests with XLA's backend optimisation off (JAX_DISABLE_MOST_OPTIMIZATIONS:
# the same HLO and fusions, compiled in about half the time) and the tests marked `optimized`
# in a second pass with it on; see docs/testing.md.
FEW_OPTIMIZATIONS = os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS", "").lower() in (
    "1", "true", "t", "yes", "y", "on"
)  # fmt: skip


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data beside the repository; tests that need it skip where it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA} (../shared/data beside the repo)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


# Running in parallel (`pytest -n 2`, pytest-xdist; `--dist loadgroup` is set in pyproject.toml):
# one test at a time goes to whichever worker is free, except the groups below, which run
# whole, in order, on one worker.
SHARED_SCOPES = ("module", "class", "package")


def _module_shares_fixtures(module) -> bool:
    """Whether the test module defines a fixture wider than one test (a training run, a built
    model): its tests run together so the fixture is made once, not once per worker."""
    for obj in vars(module).values():
        marker = getattr(obj, "_fixture_function_marker", None)
        if marker is not None and marker.scope in SHARED_SCOPES:
            return True
    return False


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group the tests that must not run at the same time as each other or that share an
    expensive fixture, and, under xdist, start the slow ones first so that no worker ends the
    run alone with a long test."""
    if FEW_OPTIMIZATIONS:
        reason = "checks programs as users compile them: run without JAX_DISABLE_MOST_OPTIMIZATIONS"
        for item in items:
            if item.get_closest_marker("optimized") is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
    shares: dict[str, bool] = {}
    for item in items:
        module = getattr(item, "module", None)
        if item.get_closest_marker("xdist_group") is not None or module is None:
            continue
        name = module.__name__
        if name not in shares:
            shares[name] = _module_shares_fixtures(module)
        if shares[name]:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a plain run keeps the files' order

    def unit(item: pytest.Item) -> str:
        mark = item.get_closest_marker("xdist_group")
        return str(mark.args[0] if mark.args else mark.kwargs.get("name")) if mark else item.nodeid

    slow_units = {unit(i) for i in items if i.get_closest_marker("slow") is not None}
    items.sort(key=lambda i: unit(i) not in slow_units)  # stable: slow units first, in order


def pytest_configure(config: pytest.Config) -> None:
    """Refuse to run tests in parallel where `--dist loadgroup` would not group them: pytest
    9.2 keeps a test's id where pytest-xdist 3.8 cannot tag it with its group, so every test
    would go to any worker (shared fixtures made twice, tests that must not overlap side by
    side)."""
    from packaging.version import Version

    if os.environ.get("PYTEST_XDIST_WORKER") or not config.getoption("numprocesses", None):
        return
    if config.getoption("dist", "no") != "loadgroup":
        return
    import xdist

    if Version(pytest.__version__) >= Version("9.2") and Version(xdist.__version__) <= Version(
        "3.8"
    ):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__}: `--dist "
            "loadgroup` would not group tests; install the versions pyproject.toml's `test` "
            "extra names (make install)"
        )
