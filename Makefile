# The two commands of the README:
#   make demo   set up .venv and run the whole workflow on the embedded demo
#   make test   set up .venv and .venv-vllm and run every test (unit, workflow, vLLM on CPU, lint,
#               and the demo on a one-node Slurm cluster: needs root, installs Debian's Slurm)
PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm
PIP_FLAGS ?= -q --disable-pip-version-check

.PHONY: demo test test-base test-vllm test-slurm lint clean

$(VENV)/.installed: envs/base.txt envs/speculators.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) -r envs/base.txt
	# speculators' trainer data loader, for the export tests; --no-deps: envs/speculators.txt says why.
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps -r envs/speculators.txt
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps -e .
	touch $@

$(VLLM_VENV)/.installed: envs/vllm.txt pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install $(PIP_FLAGS) -r envs/vllm.txt
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` beside the
	# CPU torch, and triton has no CPU backend: `import vllm` then fails on a CPU-only host.
	$(VLLM_VENV)/bin/pip uninstall $(PIP_FLAGS) -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/pip install $(PIP_FLAGS) --no-deps -e .
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/snakemake --cores all
	@echo "make demo: done; open results/report/report.html (dataset in results/, README 'Output layout')"

test: test-base test-vllm test-slurm

test-base: $(VENV)/.installed
	$(VENV)/bin/pytest -m "not vllm and not slurm"

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/pytest -m vllm

# --executor slurm with profiles/slurm on a Slurm cluster that the test starts on localhost.
test-slurm: $(VENV)/.installed
	.ci/install-slurm.sh
	$(VENV)/bin/pytest -m slurm

clean:
	rm -rf results logs benchmarks .snakemake
