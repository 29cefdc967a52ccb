# Set-up is two commands: `make serve` and `make test`. Both build .venv on first use.
# Python writes each module's bytecode once, on its first import, even where the shell asks it not to: every test
# and service process would otherwise compile torch, transformers and Ray again
unexport PYTHONDONTWRITEBYTECODE
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch first, so that no requirement pulls a multi-GB CUDA build. torch's bytecode is compiled
	# on the other core while pip fetches the rest; the rest's is written by the first process that imports a module
	# (PYTHONDONTWRITEBYTECODE is unexported above: compiling all of site-packages up front took 24 s, most of it
	# for modules no process imports)
	$(PY) -m pip install -q --no-compile $(TORCH_PIN)
	site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))'); \
	  $(PY) -m compileall -qq -j0 $$site/torch & c=$$!; \
	  $(PY) -m pip install -q --no-compile -e '.[test,trl]' && { wait $$c || true; }
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

# The files that need the machine's only Ray (connect_pool's "auto", `ray stop`, HAProxy's fixed ports) run first,
# one after another, beside the tests that start no Ray (a process of their own, their report printed at the end);
# then the files that start Ray clusters, in three pytest processes side by side (each file starts a Ray of its own,
# on loopback). The Ray tests wait on process starts much of the time, which the others fill (with two lanes the
# machine's two cores stood idle 15-20% of the time); the lanes are balanced by their files' durations.
RAY_A := tests/service/test_gateway.py tests/service/test_serve_errors.py tests/examples
RAY_B := tests/workers/pool/test_tensor_parallel_pool.py tests/client tests/service/test_weights.py tests/integrations
RAY_C := tests/workers/pool/test_weight_owner.py tests/workers/pool/test_worker_pool.py tests/service/test_replicas.py \
  tests/deploy/test_multinode.py tests/workers/pool/test_weights_cuda.py tests/workers/pool/test_tensor_parallel_cuda.py
RAY_ALONE := tests/service/test_serve_command.py tests/service/test_readme.py tests/service/test_edge.py \
  tests/deploy/test_one_machine_cluster.py
PYTEST := $(PY) -m pytest -p no:cacheprovider
RAY_FILES := $(RAY_A) $(RAY_B) $(RAY_C) $(RAY_ALONE)
test: lint
	@$(PYTEST) -q tests $(addprefix --ignore=,$(RAY_FILES)) > .test-rest.log 2>&1 & rest=$$!; \
	$(PYTEST) $(RAY_ALONE); alone=$$?; \
	$(PYTEST) -q $(RAY_B) > .test-ray-b.log 2>&1 & b=$$!; \
	$(PYTEST) -q $(RAY_C) > .test-ray-c.log 2>&1 & c=$$!; \
	$(PYTEST) $(RAY_A); a=$$?; wait $$b; b=$$?; wait $$c; c=$$?; wait $$rest; rest=$$?; \
	echo "== the second Ray lane ($(RAY_B)) =="; cat .test-ray-b.log; \
	echo "== the third Ray lane ($(RAY_C)) =="; cat .test-ray-c.log; \
	echo "== the other tests =="; cat .test-rest.log; \
	exit $$(( a || b || c || alone || rest ))

# the verl adapter against verl itself (CI runs it after `make test`)
test-integrations: $(IVENV)/.installed
	$(IVENV)/bin/python -m pytest -q -p no:cacheprovider tests/integrations/test_verl.py tests/integrations/test_verl_example.py

# the gateway on the built-in tiny model, on 127.0.0.1:8000, every listener of Ray and Serve on loopback (docs/security.md).
# `exec`: the service takes the recipe's shell's place, so a SIGTERM to make (which make passes to its child) stops
# it in order, not only the shell
serve: install
	export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; exec $(VENV)/bin/ppo-logprobs serve $(ARGS)

bench: install
	$(PY) benchmarks/bench_head.py

clean:
	rm -rf $(VENV) $(IVENV) .pytest_cache
