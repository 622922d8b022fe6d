# The two commands of the README: `make demo` (the main job) and `make test` (every test).
# Both provision what they need: the torpor binary and CRIU >= 4.1.

CARGO ?= cargo
PYTHON ?= python3
# Debug build for tests (faster to compile on 2 cores); release build for the demo and the GPU machine.
TEST_BIN := target/debug/torpor
RELEASE_BIN := target/release/torpor
# The device-memory hook (cdylib) that GPU workers preload; the harness finds it via TORPOR_HOOK_LIB.
TEST_HOOK := target/debug/libtorpor_hook.so
RELEASE_HOOK := target/release/libtorpor_hook.so

.PHONY: all build release criu test lint unit pytest demo demo-snapshot wheel gpu-carry clean

all: release

build:
	$(CARGO) build --workspace --bins
	$(CARGO) build -p torpor-hook --lib

release:
	$(CARGO) build --release --bin torpor
	$(CARGO) build --release -p torpor-hook --lib

criu:
	bash scripts/provision-criu.sh

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	@# Python: pyflakes' checks (unused and undefined names, syntax), as ruff runs them.
	@$(PYTHON) -m ruff --version >/dev/null 2>&1 || $(PYTHON) -m pip install -q ruff
	$(PYTHON) -m ruff check --select F,E9 --output-format concise .

unit: criu
	$(CARGO) test --workspace

pytest: build criu
	@$(PYTHON) -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ("pytest", "hypothesis", "jsonschema", "ray", "matplotlib", "safetensors", "pyroute2")))' || $(PYTHON) -m pip install -q -r tests/requirements.txt
	@$(PYTHON) -m mypy --version >/dev/null 2>&1 || $(PYTHON) -m pip install -q mypy
	@$(PYTHON) -m maturin --version >/dev/null 2>&1 || $(PYTHON) -m pip install -q 'maturin>=1.5,<2'
	TORPOR_BIN=$(CURDIR)/$(TEST_BIN) TORPOR_HOOK_LIB=$(CURDIR)/$(TEST_HOOK) $(PYTHON) -m pytest -q -ra tests

test: lint unit pytest

# The runtime: torpord deploys an example, boots, restores, scales, steps down and wakes it.
demo: release criu
	TORPOR_BIN=$(CURDIR)/$(RELEASE_BIN) TORPOR_HOOK_LIB=$(CURDIR)/$(RELEASE_HOOK) $(PYTHON) scripts/demo.py

# The transparent CLI underneath: torpor run, snapshot, restore twice side by side.
demo-snapshot: release criu
	TORPOR_BIN=$(CURDIR)/$(RELEASE_BIN) $(PYTHON) scripts/demo_snapshot.py

# One wheel with the torpor binary (CLI and daemon), the Python SDK and the device-memory hook:
# pip install target/wheels/torpor-*.whl (maturin, "bin" bindings; see docs/install.md).
# The SDK alone: pip install ./python.
wheel:
	@$(PYTHON) -m maturin --version >/dev/null 2>&1 || $(PYTHON) -m pip install -q 'maturin>=1.5,<2'
	PYTHON=$(PYTHON) bash scripts/build-wheel.sh release target/wheels

# What the GPU machine needs (it has no Rust and no network): the release binary and CRIU's .debs,
# the test dependencies' wheels and the peer benchmark's optional loaders' (bench/peers/carry.sh).
gpu-carry: release
	mkdir -p .gpu
	cp $(RELEASE_BIN) .gpu/torpor
	xz -T2 -6 -c $(RELEASE_BIN) > .gpu/torpor.xz
	cp $(RELEASE_HOOK) .gpu/libtorpor_hook.so
	bash scripts/gpu-carry-native.sh
	git rev-parse HEAD > .gpu/commit
	git status --porcelain --untracked-files=no > .gpu/dirty
	bash scripts/provision-criu.sh --download-only .criu-debs
	bash scripts/gpu-carry-wheels.sh .whl
	bash bench/peers/carry.sh .whl
	bash bench/cluster/carry.sh .whl-pull

clean:
	$(CARGO) clean
