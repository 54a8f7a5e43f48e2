# make demo: set up .venv and train the digits MLP on 4 ranks.
# make test: set up .venv and run the whole test suite (unit tests, then the
#            multi-rank tests under mpiexec at 1, 2, 3 and 4 ranks, in the default
#            configuration at 2 and 4, and over TCP at 3), then torch's own
#            distributed suite on the pycoll backend at 3 ranks (tools/torch_suite.py),
#            also under an emulated link.
# make bench: the collectives and fusion benchmarks at 2 and 4 ranks, the partial all-reduce
#             against MPI at 4 and 8 ranks, the training
#             benchmarks and the emulated network against its model (bench/results/).
# make reproduce: the papers' headline experiments under emulation, one report.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
RUN     := $(VENV)/bin/pycollrun
PYTEST  := -m pytest -p no:cacheprovider
SOURCES := setup.py pyproject.toml CMakeLists.txt requirements-dev.txt $(wildcard csrc/*.* csrc/cuda/*.*)

# Open MPI refuses root without these; CI and these machines run as root.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
# Open MPI 5's libfabric BTL finds no fabric here, then sleeps a second in its close, at
# every MPI_Init; on one host it would carry nothing (sm and self do), so the thousand
# jobs the tests start go without it.
export OMPI_MCA_btl ?= ^ofi

.PHONY: install demo test bench reproduce clean

install: $(VENV)/.installed

$(VENV)/.installed: $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q -e .
	touch $@

demo: install
	$(RUN) -np 4 python examples/train_digits.py

# The multi-rank tests run with mismatch checks (PYCOLL_CHECK=1: a broken test fails
# loudly), then as users run them (checks off: the compiled short path and one-pass
# grouped reader), then over TCP on loopback, as between hosts.
test: install
	$(PY) $(PYTEST) -q tests
	for n in 1 2 3 4; do \
	  echo "== multi-rank tests at $$n ranks"; \
	  $(RUN) -np $$n python $(PYTEST) -q --with-mpi -m mpi tests || exit 1; \
	done
	for n in 2 4; do \
	  echo "== multi-rank tests at $$n ranks, default configuration"; \
	  PYCOLL_CHECK=0 $(RUN) -np $$n python $(PYTEST) -q --with-mpi -m mpi tests || exit 1; \
	done
	echo "== multi-rank tests at 3 ranks over TCP (btl tcp,self), default configuration"
	OMPI_MCA_btl=tcp,self PYCOLL_CHECK=0 $(RUN) -np 3 python $(PYTEST) -q --with-mpi -m mpi tests
	for as in pycoll mpi gloo; do \
	  echo "== torch's own distributed suite at 3 ranks, pycoll as the $$as backend"; \
	  PYCOLL_TORCH_SUITE_AS=$$as $(RUN) -np 3 python $(PYTEST) -q --timeout 300 -W ignore::DeprecationWarning \
	    tools/torch_suite.py || exit 1; \
	done
	echo "== torch's own distributed suite at 3 ranks, as the mpi backend, on an emulated 10 GbE link"
	PYCOLL_TORCH_SUITE_AS=mpi $(RUN) -np 3 --link 50us,1.25GB/s python $(PYTEST) -q --timeout 300 \
	  -W ignore::DeprecationWarning tools/torch_suite.py

bench: install
	mkdir -p bench/results
	$(RUN) -np 2 python bench/collectives.py --json bench/results/collectives-np2.json --plot bench/results/collectives-np2.png
	$(RUN) -np 4 python bench/collectives.py --json bench/results/collectives-np4.json --plot bench/results/collectives-np4.png
	$(RUN) -np 2 python bench/fusion.py --json bench/results/fusion-np2.json
	$(RUN) -np 4 python bench/fusion.py --json bench/results/fusion-np4.json
	for n in 2 4; do $(RUN) -np $$n python bench/check_cost.py || exit 1; done
	$(RUN) -np 2 python bench/timeline_cost.py
	for n in 4 8; do $(RUN) -np $$n python bench/partial.py --json bench/results/partial-np$$n.json || exit 1; done
	for n in 2 4; do $(RUN) -np $$n python bench/torch_training.py --json bench/results/torch-training-np$$n.json || exit 1; done
	$(RUN) -np 3 --servers 2 python bench/ps_throughput.py --json bench/results/ps-throughput.json
	$(PY) bench/ps_training.py --out bench/results
	$(PY) bench/ps_stragglers.py --out bench/results
	$(PY) bench/ripples_training.py --out bench/results/ripples-training
	$(PY) bench/overlap.py --out bench/results
	$(PY) bench/emulation.py --json bench/results/emulation.json --plot bench/results/emulation.png

# make reproduce: each paper's headline experiment and one report (QUICK=1: a few minutes);
#                an interrupted run resumes (bench/results/reproduce/).
reproduce: install
	$(PY) bench/reproduce.py $(if $(QUICK),--quick) $(if $(LINK),--link $(LINK))

clean:
	rm -rf $(VENV) build *.egg-info pycoll/_C*.so
