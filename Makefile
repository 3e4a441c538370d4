# The README's commands: `make train`, `make test` (everything), `make test-fast` (tests that launch no process).
# Each sets up .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# Pinned here so a fresh machine gets a known torch; pyproject accepts any torch>=2.11 you already have.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install train test test-fast test-avx2 lint

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import sys, torch; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 11))" 2>/dev/null \
		|| $(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# The CPU YAML of the faster precision here (training.pick_cpu_config: cpu_bf16.yaml where bf16 matmuls are clearly
# faster, else cpu.yaml); cpu_small.yaml trains as many steps as fit in 5 minutes at that precision's speed.
# Ctrl-C reaches every process in the terminal's group: the training process finishes its step, saves and says how
# to continue, so its launcher ignores the key (accelerate's one-process launcher would die at once with a traceback
# and give the prompt back while the run still saves). The run inherits the ignore and takes the key back in main(),
# after its imports: a press in those first seconds is lost.
# exec: make passes a SIGTERM (timeout, systemd, docker stop) to its recipe's process alone, so that is the launcher,
# which passes it to the run (a shell there would die of it, leaving the launcher and the run training on).
# ARGS: more train_accel.py flags, e.g. make train ARGS="--resume never" (a finished run's folder starts afresh); a
# --config among them replaces cpu_small.yaml (train_accel.py takes one run config).
# The threads: OMP_NUM_THREADS if set, else one per physical core, as accelerate picks for one CPU process, but named,
# so that accelerate does not print its "values were not passed" warning about having picked it.
train: install
	@yaml=$$($(PY) -m training.pick_cpu_config) && \
	threads=$${OMP_NUM_THREADS:-$$($(PY) -c "import psutil; print(psutil.cpu_count(logical=False) or 1)")} && \
	trap '' INT && exec $(VENV)/bin/accelerate launch -q --config_file $$yaml --num_cpu_threads_per_process $$threads \
	train_accel.py $(if $(filter --config --config=%,$(ARGS)),,--config configs/cpu_small.yaml) $(ARGS)

# One pytest worker per core (pytest-xdist), each test file on one worker, whose module fixtures it builds once,
# the files in tests/conftest.py's order (--no-loadscope-reorder: xdist would otherwise start with the files of most
# tests, leaving the one-test launch files, minutes each, to run alone at the end); conftest.py also gives each
# worker its share of the cores' threads.
XDIST := -n auto --dist loadfile --no-loadscope-reorder
test: install
	$(PY) -m pytest -q $(XDIST) --durations=15

test-fast: install
	$(PY) -m pytest -q $(XDIST) -m "not slow"

# The fast tests with the kernels of an AVX2-only CPU (a Zen 3, older Xeons): oneDNN and ATen held to AVX2, as on
# such a CPU, whatever this one has; its numerics tests then check the AVX2 paths against fp64.
test-avx2: install
	ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q $(XDIST) -m "not slow"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
