# streamlog build. The README's two commands are `make run` and `make test`;
# both set up everything they need on a fresh machine (Python 3.11 and PyPI).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Marks a virtualenv holding the project and its dev tools, installed from the
# current pyproject.toml: it is rebuilt when pyproject.toml is newer.
INSTALLED := $(VENV)/.installed
GEN := protos/gen
GENERATED := $(GEN)/.generated
# The sync client, generated from the async one (clients/aio.py is the one source; never committed).
SYNC_CLIENT := clients/client.py
PROTOS := $(shell find protos/streamlog -name '*.proto')
DATA ?= ./data
PORT ?= 7070
# The HTTP/JSON API and web console (http://127.0.0.1:$(HTTP_PORT)/); HTTP_PORT=0 turns it off.
HTTP_PORT ?= 7080

.PHONY: run test gen lint venv clean

run: $(GENERATED)
	$(BIN)/streamlog serve --data $(DATA) --port $(PORT) --set http_port=$(HTTP_PORT)

test: $(GENERATED)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest

gen: $(GENERATED)

lint: $(GENERATED)
	$(BIN)/ruff check .
	$(BIN)/mypy
	cd protos && ../$(BIN)/buf lint

venv: $(INSTALLED)

# The editable install maps the `streamlog` package to protos/gen/streamlog, so
# that directory must exist first; its modules are generated afterwards (that
# needs grpcio-tools, which this install brings).
$(INSTALLED): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	mkdir -p $(GEN)/streamlog
	$(BIN)/python -m pip install --quiet --editable '.[dev]'
	# Spark's Python workers import PySpark from its pyspark.zip: with bytecode in it they
	# start in a third of the CPU (pyspark_streamlog/compile_workers.py says why it matters).
	# Run as a file: the package's __init__ needs the generated code, which comes after.
	$(BIN)/python pyspark_streamlog/compile_workers.py
	touch $@

$(GENERATED): $(PROTOS) protos/generate.py $(INSTALLED) $(SYNC_CLIENT)
	$(BIN)/python protos/generate.py
	touch $@

$(SYNC_CLIENT): clients/aio.py clients/_generate_sync.py $(INSTALLED)
	$(BIN)/python clients/_generate_sync.py

clean:
	rm -rf $(GEN) $(SYNC_CLIENT) .pytest_cache .ruff_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
