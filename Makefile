# Set-up is two commands: `make serve` and `make test`. Both build .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch first, so that no requirement pulls a multi-GB CUDA build
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test,bench,trl]'
	touch $@

# verl pins transformers below 5.11 and takes ~3 min to install: its adapter's tests run in an environment of their own
IVENV ?= .venv-integrations
$(IVENV)/.installed: pyproject.toml
	python3 -m venv $(IVENV)
	$(IVENV)/bin/python -m pip install -q --upgrade pip
	$(IVENV)/bin/python -m pip install -q $(TORCH_PIN)
	$(IVENV)/bin/python -m pip install -q -e '.[test,verl]'
	touch $@

.PHONY: install test test-integrations lint serve bench clean
install: $(VENV)/.installed

lint: install
	$(VENV)/bin/ruff check .

# two pytest processes side by side: one runs the files that start Ray clusters, one after the other (one Ray on the
# machine at a time, as the service and connect_pool() expect), the other the rest (its report printed after); the
# Ray tests wait on process starts a third of the time, which the other fills
RAY_TESTS := tests/service tests/workers/pool tests/client tests/deploy tests/examples tests/integrations
test: lint
	@$(PY) -m pytest -q -p no:cacheprovider tests --ignore=tests/service --ignore=tests/workers/pool \
	  --ignore=tests/client --ignore=tests/deploy --ignore=tests/examples --ignore=tests/integrations > .test-rest.log 2>&1 & rest=$$!; \
	$(PY) -m pytest $(RAY_TESTS); ray=$$?; wait $$rest; other=$$?; \
	echo "== the other tests (tests/workers but its pool, tests/test_layers.py) =="; cat .test-rest.log; \
	exit $$(( ray || other ))

# the verl adapter against verl itself (CI runs it after `make test`)
test-integrations: $(IVENV)/.installed
	$(IVENV)/bin/python -m pytest -q -p no:cacheprovider tests/integrations/test_verl.py tests/integrations/test_verl_example.py

# the gateway on the built-in tiny model, on 127.0.0.1:8000, every listener of Ray and Serve on loopback (docs/security.md)
serve: install
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(VENV)/bin/ppo-logprobs serve $(ARGS)

bench: install
	$(PY) benchmarks/bench_head.py

clean:
	rm -rf $(VENV) $(IVENV) .pytest_cache
