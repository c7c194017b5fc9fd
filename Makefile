# Two commands that work on a fresh machine (Python 3.11 with pip):
#   make demo   set up .venv and run the embedded demo (2 local ranks, ZeRO-2, tiny Llama)
#   make test   set up .venv and run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PINS := requirements/constraints.txt
# The venv's bin first on PATH, as for a user who activated it: DeepSpeed JIT-builds its CPU ops
# with the `ninja` PATH finds (tests/conftest.py does the same for the test suite).
RUN := PATH="$(CURDIR)/$(BIN):$$PATH"

.PHONY: setup demo test test-fast lint docs clean image-gpu image-cpu

setup: $(VENV)/.installed

# torch is installed first and on its own, from the pins: a range in another package's metadata
# must never be what picks the torch build (it could pull a multi-GB CUDA wheel).
$(VENV)/.installed: setup.cfg $(PINS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -c $(PINS) torch
	$(BIN)/pip install --quiet -c $(PINS) -e ".[test]"
	touch $@

demo: setup
	$(RUN) $(BIN)/toolkit train

test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15

test-fast: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow and not container and not gpu"

# ruff.toml holds the rules; tests/unit/test_lint.py runs the same check in the suite.
lint: setup
	$(BIN)/ruff check .

# The pages of docs/ as a site in site/ (mkdocs.yml); tests/unit/test_docs.py builds it with --strict.
docs: setup
	$(BIN)/mkdocs build --strict --site-dir site

# The images (docs/docker.md): docker build where a Docker engine answers; else podman as root on a
# debootstrapped Debian base (this build machine: tests/helpers/container_image.py, the recipe of
# the field notes), which prints the build time and the image size.
image-gpu:
	$(call build_image,gpu,docker/Dockerfile)

image-cpu:
	$(call build_image,cpu,docker/Dockerfile.cpu)

define build_image
	@if docker info >/dev/null 2>&1; then \
	  docker build -f $(2) -t hf-parallel-toolkit:$(1) . ; \
	else \
	  $(PYTHON) -m tests.helpers.container_image --build $(1) ; \
	fi
endef

clean:
	rm -rf $(VENV) runs site .pytest_cache .ruff_cache
