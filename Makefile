# Set-up is two commands: `make serve` and `make test`. Both build .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch first, so that no requirement pulls a multi-GB CUDA build
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

.PHONY: install test lint serve bench clean
install: $(VENV)/.installed

lint: install
	$(VENV)/bin/ruff check .

# two pytest processes: one runs the files that start Ray clusters, one after the other (one Ray on the machine at a
# time), the other the rest, a file at a time (tests/conftest.py groups them); the Ray tests wait on process starts
# a third of the time, which the other process fills
TEST_WORKERS ?= 2
test: lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup tests

# the gateway on the built-in tiny model, on 127.0.0.1:8000, every listener of Ray and Serve on loopback (README: Security)
serve: install
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(VENV)/bin/ppo-logprobs serve $(ARGS)

bench: install
	$(PY) benchmarks/bench_head.py

clean:
	rm -rf $(VENV) .pytest_cache
