# The two entry points of the README: `make demo` runs the main job, `make test` runs every check; `make test-fast`
# runs the in-process tests only, the first check while developing.
UV ?= $(shell command -v uv 2>/dev/null || echo $(HOME)/.local/bin/uv)
RUN := $(UV) run --frozen
PYTEST_ARGS ?=
# Two pytest workers (pytest-xdist), one per core: most tests run in one process and one thread, so a serial run leaves
# a core idle. Whole files go to one worker, so a module-scoped fixture (a launched job several tests read) runs once.
XDIST ?= -n 2 --dist loadfile
DOC_TESTS := tests/test_docs.py tests/test_api_reference.py  # run by `make docs`

.PHONY: env demo test test-fast lint types docs pytest bench bench-quick bench-engine bench-overhead bench-memory bench-fsdp bench-schedules bench-plan bench-state bench-generate bench-gpu gpu-check clean

env:  ## create or sync .venv from uv.lock (installs uv when missing)
	@command -v $(UV) >/dev/null 2>&1 || python3 -m pip install --quiet --user uv || curl -LsSf https://astral.sh/uv/install.sh | sh
	# Compiled at install: where PYTHONDONTWRITEBYTECODE is set (as on this project's CI machines) every process would
	# otherwise compile torch and Lightning again on import, 20-30 s of CPU for each rank a test spawns.
	$(UV) sync --frozen --compile-bytecode

lint: env
	$(RUN) ruff check .
	$(RUN) ruff format --check .

types: env
	$(RUN) mypy

docs: env  ## build the documentation site into site/ (any warning fails), then run the code examples of its pages
	NO_MKDOCS_2_WARNING=1 $(RUN) mkdocs build --strict --quiet
	OMP_NUM_THREADS=1 $(RUN) pytest $(DOC_TESTS) -q

demo: env  ## pretrain AmoebaNet-D with K=2 stages on 2 CPU processes, then fine-tune it; results in out/demo/
	OMP_NUM_THREADS=1 $(RUN) python examples/demo.py

pytest: env
	$(RUN) pytest $(PYTEST_ARGS)

test-fast: env  ## the in-process tests (under 2 minutes): no process started, no notebook, no long training or check
	OMP_NUM_THREADS=1 $(RUN) pytest $(XDIST) -m "not multiprocess and not heavy and not slow" $(PYTEST_ARGS)

test: lint types docs  ## lint, types, docs build and examples, and the rest of the test suite
	# One thread per process, as every spawned rank has: the same float reduction order in and out of the pipeline.
	OMP_NUM_THREADS=1 $(RUN) pytest $(XDIST) $(addprefix --ignore=,$(DOC_TESTS)) $(PYTEST_ARGS)

bench: env  ## every benchmark, full (about 2 hours on 2 CPU cores); results and plots in docs/benchmarks/
	OMP_NUM_THREADS=1 $(RUN) python -m benchmarks

bench-quick: env  ## the paper's Tables 1 and 2 and the bubble, quick (under 15 minutes); ends with the headline lines
	OMP_NUM_THREADS=1 $(RUN) python -m benchmarks --quick

bench-engine: env  ## engine throughput vs torch.distributed.pipelining (K=2 processes, one thread each); BASELINE=DIR also compares the common path with another checkout
	$(RUN) python -m benchmarks.engine_speed.run
	OMP_NUM_THREADS=1 $(RUN) python -m benchmarks.engine_speed.metadata
	$(if $(BASELINE),OMP_NUM_THREADS=1 $(RUN) python -m benchmarks.engine_speed.metadata --baseline $(BASELINE))

bench-overhead: env  ## GPipeStrategy with K=1, M=1 against strategy="auto"; then K=2 on a tiny model against DDP
	$(RUN) python -m benchmarks.strategy_overhead.run
	$(RUN) python -m benchmarks.strategy_overhead.tiny $(if $(BASELINE),--baseline $(BASELINE))

bench-memory: env  ## peak memory of re-materialization against the paper's formula
	$(RUN) python -m benchmarks.strategy_memory.run

bench-fsdp: env  ## data_parallel="fsdp" against "ddp", 2 pipelines x 2 stages on 4 CPU ranks: bytes per rank, peak RSS, step-time ratio, the planner's prediction (about 3 minutes; docs/benchmarks/fsdp.md)
	OMP_NUM_THREADS=1 $(RUN) python -m benchmarks.fsdp_memory.run

bench-schedules: env  ## our five schedules against torch.distributed.pipelining's on K = 2 and 4 CPU processes: throughput, bubble, activation memory, Gantt charts (about 15 minutes; QUICK=1: about 5, docs left alone)
	OMP_NUM_THREADS=1 $(RUN) python -m benchmarks.schedule_speed.run $(if $(QUICK),--quick)

bench-plan: env  ## the planner's predicted vs measured peak memory and step time; the paper's Tables 1-2 simulated
	OMP_NUM_THREADS=1 $(RUN) python -m benchmarks.plan_calibration.run
	$(RUN) python -m benchmarks.plan_paper.run

bench-state: env  ## each rank's memory and time loading, stepping, saving and resuming a 220M Llama, "full" and "sharded", K = 1, 2, 4 (K = 1 needs about 5 GiB; QUICK=1: a 10.5M Llama)
	OMP_NUM_THREADS=1 $(RUN) python -m benchmarks.state_memory.run $(if $(QUICK),--quick)

bench-generate: env  ## decoding with per-stage caches: the zoo's generate on one process and under K=2 (M=1, 2, 4) against transformers' generate (about 25 minutes; QUICK=1: a smoke test, docs left alone)
	OMP_NUM_THREADS=1 $(RUN) python -m benchmarks.generate.run $(if $(QUICK),--quick)

bench-gpu: env  ## on one CUDA GPU: auto, gpipe K=1 (M, re-materialization), hand loops, compiled layers (< 8 min; skips without CUDA); WORKLOAD=causal_lm times a 0.5B Qwen2 instead
	$(RUN) python -m benchmarks.gpu_speed.run $(if $(WORKLOAD),--workload $(WORKLOAD))

gpu-check: env  ## everything one CUDA GPU can verify, one line per check (under 10 minutes; skips without CUDA)
	$(RUN) python -m benchmarks.gpu_check

clean:
	rm -rf .venv .mypy_cache .ruff_cache .pytest_cache
