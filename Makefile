# Front door for developers and CI. `make install` leaves .venv/ with xeonsd, mpirun and the pinned stack.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: install test lint demo clean cluster-up cluster-down lint-ansible

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-nodeps.txt requirements-dev.txt train/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -r requirements.txt
	$(PIP) install --quiet --no-deps -r requirements-nodeps.txt
	$(PIP) install --quiet -r requirements-dev.txt
	$(PIP) install --quiet --no-deps -e train
	touch $@

test: install
	$(VENV)/bin/pytest -q tests

lint: install
	$(VENV)/bin/ruff check train tests
	$(VENV)/bin/ruff format --check train tests

clean:
	rm -rf $(VENV) .pytest_cache build

# The multi-node test cluster (root: network + mount namespaces, one sshd per node); writes .cluster/inventory.yml.
N ?= 4
cluster-up: install
	$(PY) tests/cluster/harness.py up --nodes $(N)

cluster-down:
	$(PY) tests/cluster/harness.py down

lint-ansible: install
	$(VENV)/bin/yamllint --strict .
	$(VENV)/bin/ansible-lint --profile production
