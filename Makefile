# The two entry points of the README: `make demo` runs the main job, `make test` runs every check.
UV ?= $(shell command -v uv 2>/dev/null || echo $(HOME)/.local/bin/uv)
RUN := $(UV) run --frozen
PYTEST_ARGS ?=

.PHONY: env demo test lint types pytest bench-engine clean

env:  ## create or sync .venv from uv.lock (installs uv when missing)
	@command -v $(UV) >/dev/null 2>&1 || python3 -m pip install --quiet --user uv || curl -LsSf https://astral.sh/uv/install.sh | sh
	$(UV) sync --frozen

lint: env
	$(RUN) ruff check .
	$(RUN) ruff format --check .

types: env
	$(RUN) mypy

pytest: env
	$(RUN) pytest $(PYTEST_ARGS)

test: lint types pytest  ## lint, types and the whole test suite

bench-engine: env  ## engine throughput vs torch.distributed.pipelining (K=2 processes, one thread each)
	$(RUN) python -m benchmarks.engine_speed.run

clean:
	rm -rf .venv .mypy_cache .ruff_cache .pytest_cache
