# `make demo` and `make test` each create .venv when it is missing.
# torch is pinned and installed first so that pip takes the CPU build on disk
# instead of resolving a newer (CUDA) release.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

.PHONY: demo test test-slow lint bench readme-tables check-install clean fuzz

# requirements-corpus.txt: real attention libraries the doctor's tests check, test-only; --no-deps so that
# none of them can replace torch (their own dependencies are pinned in the file), and pip check proves it.
# torchvision's CUDA-only extension does not load beside the CPU torch: a startup hook defines the two
# operator schemas it would (tests/torchvision_ops.py), so that torchvision, and transformers, import.
$(BIN)/selfattn: pyproject.toml requirements-corpus.txt tests/torchvision_ops.py tests/torchvision_hook.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps -r requirements-corpus.txt
	$(BIN)/python -m pip check
	site=$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	cp tests/torchvision_ops.py "$$site/_selfattn_torchvision_ops.py" && \
	cp tests/torchvision_hook.py "$$site/_selfattn_torchvision_hook.py" && \
	echo "import _selfattn_torchvision_hook" > "$$site/_selfattn_torchvision_hook.pth"
	touch $(BIN)/selfattn

demo: $(BIN)/selfattn
	$(BIN)/selfattn demo

# The suite runs in TEST_JOBS processes (pytest-xdist), each on one thread unless OMP_NUM_THREADS says otherwise.
TEST_JOBS ?= 2
test: $(BIN)/selfattn
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q -n $(TEST_JOBS)

# The heavy grids the default run leaves out (marked slow: more world sizes, compiles, timing scripts).
test-slow: $(BIN)/selfattn
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q -n $(TEST_JOBS) -m slow

lint: $(BIN)/selfattn
	$(BIN)/ruff check src tests examples scripts
	$(BIN)/python -m mypy

# The long property-based search (random examples, database kept under .hypothesis/).
FUZZ_SECONDS ?= 3600
fuzz: $(BIN)/selfattn
	$(BIN)/python scripts/fuzz.py --seconds $(FUZZ_SECONDS)

bench: $(BIN)/selfattn
	$(BIN)/selfattn bench --quick

# README.md's performance tables, rewritten from the JSON of full bench runs, e.g.
# selfattn bench --suite masks --lengths 16384 65536 --json bench-results/masks.json
readme-tables: $(BIN)/selfattn
	$(BIN)/python scripts/readme_tables.py bench-results/*.json

# Build the wheel, install it with torch into a fresh virtualenv (no extras) and run it from there.
check-install:
	PY=$(PY) TORCH_VERSION=$(TORCH_VERSION) bash scripts/check_install.sh

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
