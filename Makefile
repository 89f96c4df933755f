# Front door for developers and CI. `make install` leaves .venv/ with xeonsd, mpirun and the pinned stack.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: install test test-quick role-docs lint hooks demo demo-local clean cluster-up cluster-down lint-ansible

install: $(VENV)/.installed

# pip installs without byte-compiling, then compileall compiles on every core at once (pip compiles one file after
# the other: most of the install's time). Best effort, as pip's own: a few test files in the packages are newer
# Python (torch's py312_intrinsics.py).
$(VENV)/.installed: requirements.txt requirements-nodeps.txt requirements-dev.txt train/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet --no-compile -r requirements.txt
	$(PIP) install --quiet --no-compile --no-deps -r requirements-nodeps.txt
	$(PIP) install --quiet --no-compile -r requirements-dev.txt
	$(PIP) install --quiet --no-compile --no-deps -e train
	$(PY) -m compileall -qq -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || true
	touch $@

# Every test; the 25 slowest are listed at the end, so each run shows where its time went, and every skipped test
# with its reason (-rs: off CI the test cluster's tests skip when not root; with CI=true that fails instead,
# tests/cluster/ci_skips.py). Two workers: one runs the test cluster's tests (they wait on SSH and Ansible most of
# the time), the other the rest beside it, at a lower CPU priority (tests/conftest.py: the cluster chain is the
# critical path).
test: install
	$(VENV)/bin/pytest -q -rs --durations=25 -n 2 --dist loadgroup tests

# The edit loop: everything but the 4-node test cluster (tests/cluster).
# The generated end of every role README (requirements, variables, example) from its meta/ and defaults/.
role-docs:
	$(PY) tests/role_readmes.py

test-quick: install
	$(VENV)/bin/pytest -q -rs --durations=10 tests --ignore=tests/cluster

lint: install
	$(VENV)/bin/ruff check train tests plugins roles
	$(VENV)/bin/ruff format --check train tests plugins roles
	.ci/commit-subjects

# The same commit-message rule while committing (a subject of at most 72 characters, a blank line before the body).
hooks:
	git config core.hooksPath .githooks

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

# The main job on the built-in default: a 4-node test cluster on this machine (network namespaces + sshd; needs
# root), provisioned by provision.yml, then finetune.yml: 16 MPI ranks (-n 16 -ppn 4) train the concept on the
# demo's pretrained model (train/src/xeonsd/assets/demo_model: a small SD 1.x pipeline at 64 px that draws captioned
# scenes, "a red ball on grass"; rebuilt by `xeonsd make-demo-model`) and 5 synthetic captioned images of a yellow
# robot it never saw, export to OpenVINO, generate 5 images, write report.html.
# METHOD=lora (an adapter, generated with on the base model's export) or METHOD=full (the whole UNet; its pipeline
# stays on the primary and gets its own export) instead of the recipe's textual inversion. LAUNCHER=slurm:
# provision.yml also installs Slurm on the test cluster (the slurm role: munged and slurmctld on node1, a slurmd
# per node; tests/cluster/slurm_role_vars.yml) and the job is one batch job (sbatch from node1, the ranks srun's
# tasks) instead of mpirun over SSH.
ANSIBLE_PLAYBOOK := ANSIBLE_CONFIG=$(CURDIR)/ansible.cfg ANSIBLE_CACHE_PLUGIN_CONNECTION=$(CURDIR)/.cluster/facts $(VENV)/bin/ansible-playbook \
	-i .cluster/inventory.yml
DEMO_STEPS ?= 60
METHOD     ?= textual_inversion
LAUNCHER   ?= mpirun
DEMO_MODEL := $(CURDIR)/train/src/xeonsd/assets/demo_model
DEMO_PROMPT = a photo of a <dicoo> at the beach
# The demo model trains at its own 64 px (resolution auto; the test cluster's inventory says 128 for the tiny model).
# It is small (a 64-wide text encoder, a 1.5 M-parameter UNet): its learning rates are ten times the
# recipe's (before --scale_lr's × 16 ranks), and the concept takes 4 token vectors (with the recipe's one it moves
# the pictures a quarter as far: docs/trainer.md#the-demos-pretrained-model).
DEMO_LR_textual_inversion := 2.0e-03
DEMO_LR_lora := 1.0e-03
DEMO_LR_full := 1.0e-04
DEMO_VARS  := -e base_model_id=xeonsd/demo-model -e base_model_source_dir=$(DEMO_MODEL) -e finetune_resolution=auto \
	-e openvino_export_before=true
DEMO_TRAIN := -e finetune_learning_rate=$(DEMO_LR_$(METHOD)) -e finetune_num_vectors=4
demo: install
	$(PY) tests/cluster/harness.py down
	$(PY) tests/cluster/harness.py up --nodes 4
	$(ANSIBLE_PLAYBOOK) provision.yml $(DEMO_VARS) $(if $(filter slurm,$(LAUNCHER)),-e @tests/cluster/slurm_role_vars.yml)
	$(ANSIBLE_PLAYBOOK) finetune.yml $(DEMO_VARS) $(DEMO_TRAIN) -e finetune_max_train_steps=$(DEMO_STEPS) -e finetune_method=$(METHOD) \
		-e finetune_launcher=$(LAUNCHER) -e 'openvino_export_prompt="$(DEMO_PROMPT)"'
	@echo
	@echo "report:     runs/latest/report.html (it opens with the base model before and the concept after)"
	@echo "model card: runs/latest/README.md"
	@echo "images:     runs/latest/images/ (grid.png, timings.json; the base model's: images/before/)"
	@echo "loss plot:  runs/latest/loss.png"
	@echo "the test cluster stays up (doctor.yml, finetune.yml again...): make cluster-down removes it"

# The same job without the cluster: 4 MPI ranks on this machine, then export and generate.
DEMO_DIR   ?= runs/demo-local
DEMO_RANKS ?= 4
demo-local: install
	rm -rf $(DEMO_DIR) && mkdir -p $(DEMO_DIR)
	cp -r $(DEMO_MODEL) $(DEMO_DIR)/base-model
	$(VENV)/bin/xeonsd make-dataset $(DEMO_DIR)/dicoo
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH HF_HUB_OFFLINE=1 mpirun -n $(DEMO_RANKS) xeonsd train \
	  --pretrained_model_name_or_path=$(DEMO_DIR)/base-model --train_data_dir=$(DEMO_DIR)/dicoo \
	  --learnable_property=object --placeholder_token="<dicoo>" --initializer_token=toy --resolution=64 \
	  --train_batch_size=1 --seed=7 --gradient_accumulation_steps=1 --max_train_steps=$(DEMO_STEPS) \
	  --learning_rate=8.0e-03 --num_vectors=4 --scale_lr --lr_scheduler=constant --lr_warmup_steps=0 \
	  --output_dir=$(DEMO_DIR)/textual_inversion_output --mixed_precision=auto --checkpointing_steps=20
	HF_HUB_OFFLINE=1 $(VENV)/bin/xeonsd export $(DEMO_DIR)/base-model $(DEMO_DIR)/openvino \
	  --embeds $(DEMO_DIR)/textual_inversion_output/learned_embeds.safetensors --height 64 --width 64
	HF_HUB_OFFLINE=1 $(VENV)/bin/xeonsd generate $(DEMO_DIR)/openvino --num-images 5 --steps 20 \
	  --prompt "$(DEMO_PROMPT)" --out $(DEMO_DIR)/images
	@echo
	@echo "learned embedding: $(DEMO_DIR)/textual_inversion_output/learned_embeds.safetensors"
	@echo "loss plot:         $(DEMO_DIR)/textual_inversion_output/loss.png"
	@echo "images:            $(DEMO_DIR)/images (grid.png, timings.json)"
