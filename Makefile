# `make study` and `make test` both create .venv when it is missing and install the package.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SPEC ?= configs/studies/smoke.yaml
OUT ?= runs/smoke
# Runs trained at a time (each in its own process): tiny CPU runs leave cores idle.
WORKERS ?= 2
# Test processes (pytest-xdist): compiles and Python are single-threaded, so one per core.
# Most tests compile with XLA's backend optimisation off (half the compile time, the same HLO);
# those marked `optimized` compare programs bit for bit and run fully optimised (docs/testing.md).
TEST_WORKERS ?= 2

.PHONY: study test install lint format clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[seqio,test,tpu,lmeval,grain]'
	touch $(STAMP)

install: $(STAMP)

study: $(STAMP)
	$(BIN)/scalestudy study --spec $(SPEC) --out $(OUT) --workers $(WORKERS)

test: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	JAX_DISABLE_MOST_OPTIMIZATIONS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not optimized"
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m optimized

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) runs .pytest_cache
